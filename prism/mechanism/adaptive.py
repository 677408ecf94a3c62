"""DP-aware rank-space adaptive transform of PRISM (paper §3.3, eqs. 24–27, App. A.26–A.27).

One factor ``X ∈ {A, B}`` of one module keeps a first moment ``m ∈ R^{rows×r}`` and a right-invariant
rank-space second moment ``V ∈ R^{r×r}`` of its privatised tangent lift ``Δ`` (``rows = m`` for the
A factor, ``n`` for the B factor)::

    m ← β1 m + (1−β1) Δ,      V ← β2 V + (1−β2) ΔᵀΔ / rows                      (eq. 24)
    U = m̂ P(V̂),               P(V̂) = E diag(p(w)) Eᵀ for V̂ = E diag(w) Eᵀ       (eq. 25)

Two preconditioners ``P`` (config ``preconditioner``), the same code otherwise:

* ``floor`` — what the released code ran (docs/DECISIONS.md D15): eigenvalues clamped at 0,
  ``w ← max(w + eps, λ)`` (a floor, not a ridge), then the condition clamp
  ``w ← max(w, max(w)/cond_max)``; ``p(w) = w^{-1/2}``. ``‖U‖_F ≤ λ^{-1/2}‖m̂‖_F``.
* ``ridge`` — the paper's eq. 25: ``p(w) = (w + λ + eps)^{-1/2}`` (condition clamp optional), so
  ``‖U‖_F ≤ λ^{-1/2}‖m̂‖_F`` (Thm. 3.5, eq. 27).
* ``none`` — no adaptivity, ``U = Δ`` (the plain tangent mechanism of eq. 22).

The DP floor ``λ`` scales with the per-coordinate noise variance ``τ² = (σC/B)²`` of the privatised
lift (eq. 17): ``scalar`` mode ``λ = floor_factor·τ²`` (released code); ``geometry`` mode
``λ = floor_factor·τ²·tr(Σ)/r`` with ``Σ`` the rank-space second moment of the unit noise (eq. 50):
``Σ_A = E[Ξ_AᵀΞ_A/m] = ((m−r)/m) N⁻¹``, ``Σ_B = E[Ξ_BᵀΞ_B/n] = M⁻¹``. This is eq. 26
(``λ_A ≍ (σC/B)² tr(N⁻¹)/r``) with the ``(m−r)/m`` factor of the exact noise moment kept (as the
released code's unused geometry mode also does; it differs from eq. 26 by < r/m) and without that
mode's extra ``max`` with the scalar floor. ``debias`` subtracts the known noise moment ``τ²Σ`` from
``V̂`` and clamps the result PSD (App. A.26). Non-DP (``τ = 0``): ``λ = 0``, only ``eps`` and the
condition clamp act.

Every function also takes a leading module dim: a group of ``G`` modules of one shape keeps moments
``m`` [G, rows, r], ``V`` [G, r, r] and is transformed in one batched ``eigh``
(``RankSpaceAdaptive(..., batch=(G,))``); module ``i`` of the group equals the unbatched transform.

The transform is equivariant under orthogonal gauges (Lemma A.30): feeding ``ΔR`` and ``RᵀΣR``
gives ``UR``. Everything is computed in the dtype of the inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from prism.mechanism.geometry import Frame

if TYPE_CHECKING:  # the knobs below are fields of PRISM's method config (annotations only)
    from prism.methods.schema import PrismConfig

def noise_second_moments(fr: Frame) -> tuple[Tensor, Tensor]:
    """Eq. 50: rank-space moments of the unit tangent noise, ``Σ_A = ((m−r)/m) N⁻¹``, ``Σ_B = M⁻¹``.

    ``N⁻¹ = R_B⁻¹R_B⁻ᵀ`` and ``M⁻¹ = R_A⁻¹R_A⁻ᵀ`` from the frame's thin QRs (no Gram inversion).
    """
    (m, r), RB_inv, RA_inv = fr.A.shape[-2:], fr.RBi, fr.RAi
    return ((m - r) / m) * (RB_inv @ RB_inv.mT), RA_inv @ RA_inv.mT


def horizontal_noise_second_moments(fr: Frame) -> tuple[Tensor, Tensor]:
    """Eq. 50 for the horizontalised unit noise ``H(Ξ_A, Ξ_B)`` (what DP feeds the moments).

    ``H`` (:func:`prism.mechanism.geometry.horizontalize`) adds ``(AΩ, −BΩᵀ)`` with ``MΩ + ΩN = Ξ_BᵀB``. In the
    eigenbases ``M = U diag(μ) Uᵀ``, ``N = V diag(ν) Vᵀ`` the entries of ``UᵀΩV`` are independent,
    ``N(0, ν_j/μ_i)/(μ_i + ν_j)``, which gives the closed forms
    ``Σ_A = V diag((m−r)/ν_j + ν_j Σ_i (μ_i+ν_j)⁻²) Vᵀ / m`` and
    ``Σ_B = U diag((n−r)/μ_i + μ_i Σ_j (μ_i+ν_j)⁻²) Uᵀ / n`` (symmetric in the two factors, as the
    horizontal slice is). The eigenbases are the frame's (no further decomposition).
    """
    (m, r), n = fr.A.shape[-2:], fr.B.shape[-2]
    mu, nu, U, V = fr.SA.square(), fr.SB.square(), fr.VA, fr.VB
    inv_sq = (mu[..., :, None] + nu[..., None, :]).pow(-2)  # [..., i, j]
    diag_A = (m - r) / nu + nu * inv_sq.sum(-2)
    diag_B = (n - r) / mu + mu * inv_sq.sum(-1)
    return (V * diag_A[..., None, :]) @ V.mT / m, (U * diag_B[..., None, :]) @ U.mT / n


def noise_floor(cfg: PrismConfig, tau: float, sigma_noise: Tensor) -> float | Tensor:
    """Eq. 26 DP floor ``λ``: ``floor_factor·τ²`` (scalar) or ``floor_factor·τ²·tr(Σ)/r`` (geometry).

    The geometry floor stays on the device, shaped ``[..., 1]`` to broadcast over eigenvalues.
    """
    base = cfg.floor_factor * tau**2
    if cfg.floor_mode == "scalar":
        return base
    return base * sigma_noise.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True) / sigma_noise.shape[-1]


def symmetric_part(V_hat: Tensor) -> Tensor:
    """``(V̂ + V̂ᵀ)/2``, the matrix whose ``eigh`` :func:`preconditioner` uses."""
    return 0.5 * (V_hat + V_hat.mT)


def preconditioner(cfg: PrismConfig, V_hat: Tensor, floor: float | Tensor) -> Tensor:
    """``P(V̂) = E diag(p(w)) Eᵀ`` (eq. 25; ``floor`` or ``ridge`` form, see module docstring)."""
    return spectral_preconditioner(cfg, *torch.linalg.eigh(symmetric_part(V_hat)), floor)


def spectral_preconditioner(cfg: PrismConfig, w: Tensor, E: Tensor, floor: float | Tensor) -> Tensor:
    """:func:`preconditioner` from the eigendecomposition ``(w, E)`` of ``symmetric_part(V̂)``."""
    w = w.clamp_min(0.0)
    w = (w + cfg.eps).clamp_min(floor) if cfg.preconditioner == "floor" else w + floor + cfg.eps
    if cfg.cond_max is not None:
        w = torch.maximum(w, w.amax(-1, keepdim=True) / cfg.cond_max)
    return (E * w.rsqrt()[..., None, :]) @ E.mT


@dataclass
class FactorMoments:
    """State of one factor: first moment ``m`` [rows, r] and rank-space second moment ``V`` [r, r]."""

    m: Tensor
    V: Tensor


def update_moments(cfg: PrismConfig, state: FactorMoments, delta: Tensor) -> None:
    """Eq. 24 in place: ``m ← β1 m + (1−β1)Δ``, ``V ← β2 V + (1−β2) ΔᵀΔ/rows``."""
    state.m.mul_(cfg.beta1).add_(delta, alpha=1.0 - cfg.beta1)
    state.V.mul_(cfg.beta2).add_(delta.mT @ delta, alpha=(1.0 - cfg.beta2) / delta.shape[-2])


def moment_estimates(
    cfg: PrismConfig, state: FactorMoments, t: int, tau: float, sigma_noise: Tensor, out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(m̂, V̂)`` at step ``t ≥ 1``: bias-corrected moments, ``V̂`` debiased when configured.

    ``m̂ = m/(1−β1ᵗ)``, ``V̂ = V/(1−β2ᵗ)`` with ``bias_correction`` (else ``m``, ``V``). The debias
    term is the expected noise part of ``V̂`` (App. A.26, eq. 50): ``τ²Σ`` with bias correction,
    ``(1−β2ᵗ)τ²Σ`` without. Not yet clamped PSD (:func:`preconditioner` does that). ``out``: a tensor
    shaped like ``m`` for ``m̂``.
    """
    c1 = 1.0 - cfg.beta1**t if cfg.bias_correction else 1.0
    c2 = 1.0 - cfg.beta2**t if cfg.bias_correction else 1.0
    m_hat, V_hat = torch.div(state.m, c1, out=out), state.V / c2
    if cfg.debias and tau > 0:
        V_hat = V_hat - (tau**2 * (1.0 - cfg.beta2**t) / c2) * sigma_noise
    return m_hat, V_hat


class RankSpaceAdaptive:
    """Moments of one module's two factors plus the step counter ``t`` (eqs. 24–26).

    ``batch=(G,)`` holds a group of ``G`` modules of one shape that always step together.
    """

    def __init__(self, cfg: PrismConfig, m: int, n: int, r: int, dtype: torch.dtype, device: torch.device,
                 batch: tuple[int, ...] = ()):
        self.cfg = cfg
        self.t = 0
        zeros = {"dtype": dtype, "device": device}
        self.A = FactorMoments(m=torch.zeros(*batch, m, r, **zeros), V=torch.zeros(*batch, r, r, **zeros))
        self.B = FactorMoments(m=torch.zeros(*batch, n, r, **zeros), V=torch.zeros(*batch, r, r, **zeros))

    def step(
        self, dA: Tensor, dB: Tensor, tau: float, sigma_A: Tensor, sigma_B: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Update the moments with the privatised lift ``(ΔA, ΔB)`` and return ``(U_A, U_B)``.

        ``tau = σC/B`` is the noise scale of the lift (0 non-DP); ``sigma_A``, ``sigma_B`` are the
        unit noise moments of :func:`noise_second_moments` (read only by geometry floor / debias).
        """
        if self.cfg.preconditioner == "none":
            return dA, dB
        return tuple(m_hat @ preconditioner(self.cfg, V_hat, floor)
                     for m_hat, V_hat, floor in self.observe(dA, dB, tau, sigma_A, sigma_B))

    def observe(
        self, dA: Tensor, dB: Tensor, tau: float, sigma_A: Tensor, sigma_B: Tensor,
        out: tuple[Tensor, Tensor] | None = None,
    ) -> list[tuple[Tensor, Tensor, float | Tensor]]:
        """Eq. 24 update, then per factor ``(m̂, V̂, λ)``: ``U = m̂ P(V̂)`` with floor ``λ`` (eqs. 25–26).

        The first half of :meth:`step`; a caller batching several groups runs one ``eigh`` of all
        ``symmetric_part(V̂)`` and finishes with :func:`spectral_preconditioner`. ``out``: tensors shaped
        like ``m_A``, ``m_B`` for the two ``m̂``.
        """
        self.t += 1
        update_moments(self.cfg, self.A, dA)
        update_moments(self.cfg, self.B, dB)
        return [(*moment_estimates(self.cfg, state, self.t, tau, sigma, out=m_hat), noise_floor(self.cfg, tau, sigma))
                for state, sigma, m_hat in ((self.A, sigma_A, out and out[0]), (self.B, sigma_B, out and out[1]))]
