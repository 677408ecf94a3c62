"""Measurements behind the paper's mechanism claims (§2, §3, App. A.7, App. C): pure tensor functions.

Monte-Carlo noise energies of factor-space DP (eqs. 7–9, 32–33) and of PRISM (eqs. 19–21), gauge
rescaling ``(cA, c⁻¹B)`` (eq. 4, Thm. 3.3), per-example clip statistics under both norms (eq. 3 vs
eq. 16), the factor-norm sum ``S_t`` of Fig. 3, ``‖ΔZ_t‖_F`` of Fig. 2 and the noise amplification
``‖P^{-1/2}ξ‖/‖ξ‖`` of the adaptive step (Figs. 4, 14–15). The closed forms they are checked against
live in :mod:`prism.mechanism.geometry`; the experiment that runs them is ``pipelines/verbs/diagnostics.py``.

Notation as in :mod:`prism.mechanism.geometry`: ``A`` [m, r], ``B`` [n, r], ``τ`` the per-coordinate noise
standard deviation (``σC/b``). Nothing forms an ``m×n`` matrix.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from prism.mechanism import geometry
from prism.mechanism.adaptive import (
    RankSpaceAdaptive,
    moment_estimates,
    noise_floor,
    noise_second_moments,
    preconditioner,
)
from prism.mechanism.lora import LoraPair, read_pair, write_pair


class FactorNoise(NamedTuple):
    """Per-draw squared norms of factor-space DP noise in ``Z`` (eq. 7 at unit step):
    ``first = ‖ξ_A Bᵀ + A ξ_Bᵀ‖²``, ``bilinear = ‖ξ_A ξ_Bᵀ‖²``, ``total`` = their sum plus the cross term."""

    first: Tensor
    bilinear: Tensor
    total: Tensor


def factor_noise_energies(A: Tensor, B: Tensor, xi_A: Tensor, xi_B: Tensor) -> FactorNoise:
    """The energies of eq. 7 for given factor noise ``ξ_A`` [..., m, r], ``ξ_B`` [..., n, r], in trace forms
    (``M = AᵀA``, ``N = BᵀB``, ``X = ξ_Aᵀξ_A``, ``Y = ξ_Bᵀξ_B``): first order ``tr(XN) + tr(YM) +
    2tr((Aᵀξ_A)(Bᵀξ_B))``, bilinear ``tr(XY)``, cross ``2tr(X ξ_BᵀB) + 2tr((Aᵀξ_A) Y)``; for i.i.d.
    ``N(0, τ²)`` noise their expectations are eqs. 8, 9 and 0."""
    X, Y = xi_A.mT @ xi_A, xi_B.mT @ xi_B
    AxA, BxB = A.mT @ xi_A, B.mT @ xi_B
    first = (X * (B.mT @ B)).sum((-2, -1)) + (Y * (A.mT @ A)).sum((-2, -1)) + 2.0 * (AxA * BxB.mT).sum((-2, -1))
    bilinear = (X * Y).sum((-2, -1))
    cross = 2.0 * (X * (xi_B.mT @ B).mT).sum((-2, -1)) + 2.0 * (AxA * Y.mT).sum((-2, -1))
    return FactorNoise(first=first, bilinear=bilinear, total=first + bilinear + cross)


def factor_noise_draws(A: Tensor, B: Tensor, tau: float, draws: int, generator: torch.Generator | None = None,
                       noised: str = "AB") -> FactorNoise:
    """:func:`factor_noise_energies` of ``draws`` i.i.d. ``ξ_A ~ N(0, τ²I_{m×r})``, ``ξ_B ~ N(0, τ²I_{n×r})``;
    only the factors in ``noised`` get noise (``"A"``: FFA's one-sided noise, eq. 32)."""
    if noised not in ("AB", "A", "B"):
        raise ValueError(f"noised={noised!r}; choose 'AB', 'A' or 'B'")
    opts = {"generator": generator, "dtype": A.dtype, "device": A.device}
    xi_A = tau * torch.randn(draws, *A.shape, **opts) if "A" in noised else A.new_zeros(draws, *A.shape)
    xi_B = tau * torch.randn(draws, *B.shape, **opts) if "B" in noised else B.new_zeros(draws, *B.shape)
    return factor_noise_energies(A, B, xi_A, xi_B)


def sample_tangent_noise(A: Tensor, B: Tensor, generator: torch.Generator | None = None,
                         frame: geometry.Frame | None = None, sample_shape: tuple[int, ...] = (),
                         damping: float | None = None) -> tuple[Tensor, Tensor]:
    """:func:`geometry.tangent_noise` of fresh unit draws ``Ω_A``, ``Ω_B`` (``torch.randn`` from ``generator``,
    ``sample_shape`` independent draws in front), for measurements of the sampler's law."""
    fr = geometry.frame(A, B) if frame is None else frame
    opts = {"generator": generator, "dtype": A.dtype, "device": A.device}
    omega = (torch.randn(*sample_shape, *A.shape, **opts), torch.randn(*sample_shape, *B.shape, **opts))
    return geometry.tangent_noise(fr, *omega, damping=damping)


def prism_noise_draws(A: Tensor, B: Tensor, tau: float, draws: int, generator: torch.Generator | None = None) -> Tensor:
    """``draws`` samples of ``‖τ(Ξ_A Bᵀ + A Ξ_Bᵀ)‖²_F`` with the mechanism's own sampler (eq. 19);
    expectation ``τ² r(m+n−r)`` (eq. 20)."""
    XiA, XiB = sample_tangent_noise(A, B, generator=generator, sample_shape=(draws,))
    return tau**2 * geometry.intrinsic_sqnorm(A, B, XiA, XiB)


def effective_noise(sqnorms: Tensor) -> float:
    """Def. 2.1: ``E_Z = √(E‖N_Z‖²_F)`` estimated by the Monte-Carlo mean."""
    return float(sqnorms.double().mean().sqrt())


def gauge(A: Tensor, B: Tensor, c: float) -> tuple[Tensor, Tensor]:
    """The gauge orbit point ``(cA, c⁻¹B)`` (same ``Z = ABᵀ``; eq. 4)."""
    if not c > 0:
        raise ValueError(f"gauge c={c} must be positive")
    return c * A, B / c


@torch.no_grad()
def apply_gauge(params: Mapping[str, Tensor], pairs: Sequence[LoraPair], c: float) -> None:
    """Rescale every LoRA module's factors in place to ``(cA, c⁻¹B)``."""
    for pair in pairs:
        write_pair(params, pair, *gauge(*read_pair(params, pair), c))


def gauge_scan(A: Tensor, B: Tensor, tau: float, cs: Sequence[float], draws: int,
               generator: torch.Generator | None = None) -> FactorNoise:
    """Factor noise energies of eq. 7 at every gauge in ``cs`` (App. C.2): fields are ``[len(cs), draws]``."""
    rows = [factor_noise_draws(*gauge(A, B, c), tau, draws, generator) for c in cs]
    return FactorNoise(*(torch.stack(parts) for parts in zip(*rows)))


def factor_sum(pairs: Sequence[LoraPair], params: Mapping[str, Tensor]) -> dict[str, float]:
    """Fig. 3's ``S`` per module: ``m‖B‖²_F + n‖A‖²_F`` (eq. 8 at ``τ = 1``); ``S_t`` is the sum."""
    out = {}
    for pair in pairs:
        A, B = (t.detach().double() for t in read_pair(params, pair))
        out[pair.module] = A.shape[0] * B.square().sum().item() + B.shape[0] * A.square().sum().item()
    return out


def product_distance(A: Tensor, B: Tensor, A2: Tensor, B2: Tensor) -> float:
    """``‖A2 B2ᵀ − A Bᵀ‖_F`` via ``[A2, A] = Q_u R_u``, ``[B2, −B] = Q_v R_v``: it equals ``‖R_u R_vᵀ‖_F``."""
    A, B, A2, B2 = (t.detach().double() for t in (A, B, A2, B2))
    Ru = torch.linalg.qr(torch.cat([A2, A], 1), mode="r").R
    Rv = torch.linalg.qr(torch.cat([B2, -B], 1), mode="r").R
    return float((Ru @ Rv.mT).norm())


def delta_z_norm(pairs: Sequence[LoraPair], before: Mapping[str, Tensor], after: Mapping[str, Tensor]) -> float:
    """Fig. 2's ``‖ΔZ_t‖_F = ‖Z_{t+1} − Z_t‖_F`` over all modules (in quadrature)."""
    sq = sum(product_distance(*read_pair(before, p), *read_pair(after, p)) ** 2 for p in pairs)
    return float(np.sqrt(sq))


def factor_example_norms(grads: Mapping[str, Tensor], names: Sequence[str]) -> Tensor:
    """Per-example flat factor norms ``‖(g_A,i, g_B,i)‖`` over all ``names`` (eq. 3; not gauge invariant)."""
    k = grads[names[0]].shape[0]
    return torch.sqrt(sum(grads[n].double().reshape(k, -1).square().sum(1) for n in names))


def intrinsic_example_norms(pairs: Sequence[LoraPair], params: Mapping[str, Tensor],
                            grads: Mapping[str, Tensor]) -> Tensor:
    """Per-example intrinsic norms ``s_i = (Σ_ℓ ‖P_{A,B}(G_{i,ℓ})‖²_F)^{1/2}`` (eqs. 14–16; gauge invariant)."""
    total = 0.0
    for pair in pairs:
        A, B = (t.detach().double() for t in read_pair(params, pair))
        gA, gB = (g.detach().double() for g in read_pair(grads, pair))
        fr = geometry.frame(A, B)
        total = total + geometry.intrinsic_sqnorm(A, B, *geometry.lift(A, B, gA, gB, frame=fr), frame=fr)
    return torch.as_tensor(total).clamp_min(0.0).sqrt()


def clip_stats(norms: Tensor, clip_norm: float, eps: float = 0.0) -> tuple[float, float]:
    """``(clip fraction, mean clip coefficient)`` with ``α_i = min(1, C/(‖g_i‖ + eps))`` (eq. 3 / eq. 16)."""
    coef = (clip_norm / (norms.double() + eps)).clamp(max=1.0)
    return float((norms > clip_norm).double().mean()), float(coef.mean())


def adam_amplification(optimizer: torch.optim.Optimizer, generator: torch.Generator | None = None) -> float:
    """``‖P^{-1/2}ξ‖/‖ξ‖`` for (Adam/AdamW) ``P^{-1/2} = diag(1/(√v̂ + eps))``, ``ξ ~ N(0, I)`` over all
    parameters with state (the ratio does not depend on the noise scale τ); ``generator`` on their device."""
    num = den = 0.0
    for group in optimizer.param_groups:
        beta2, eps = group["betas"][1], group["eps"]
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state or "exp_avg_sq" not in state:
                continue
            t = float(state["step"])
            v_hat = state["exp_avg_sq"].double() / (1.0 - beta2**t)
            xi = torch.randn(p.shape, generator=generator, dtype=torch.float64, device=p.device)
            num += (xi / (v_hat.sqrt() + eps)).square().sum().item()
            den += xi.square().sum().item()
    if den == 0.0:
        raise ValueError("the optimizer has no second-moment state yet; take a step first")
    return float(np.sqrt(num / den))


def prism_amplification(adaptive: Mapping[str, RankSpaceAdaptive], factors: Mapping[str, tuple[Tensor, Tensor]],
                        tau: float, generator: torch.Generator | None = None) -> float:
    """``‖(Ξ_A P_A, Ξ_B P_B)‖/‖(Ξ_A, Ξ_B)‖`` over modules, ``P = P(V̂)`` the rank-space preconditioner
    (eq. 25, with the floor of eq. 26 at ``τ``) and ``Ξ`` the tangent noise of eq. 19 at the factors."""
    num = den = 0.0
    for module, ad in adaptive.items():
        plain = ad.cfg.preconditioner == "none"  # U = Δ: P = I
        if ad.t == 0 and not plain:
            continue
        A, B = factors[module]
        fr = geometry.frame(A, B)
        sigma_A, sigma_B = noise_second_moments(fr)
        XiA, XiB = sample_tangent_noise(A, B, generator=generator, frame=fr)
        for Xi, state, sig in ((XiA, ad.A, sigma_A), (XiB, ad.B, sigma_B)):
            if plain:
                P = torch.eye(Xi.shape[-1], dtype=Xi.dtype, device=Xi.device)
            else:
                _, V_hat = moment_estimates(ad.cfg, state, ad.t, tau, sig)
                P = preconditioner(ad.cfg, V_hat, noise_floor(ad.cfg, tau, sig))
            num += (Xi @ P).square().sum().item()
            den += Xi.square().sum().item()
    if den == 0.0:
        raise ValueError("the adaptive transform has no moments yet; take a step first")
    return float(np.sqrt(num / den))


def linear_fit(x: Sequence[float], y: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``y ≈ a x + b``: returns ``(a, b, R²)`` (Fig. 3)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    a, b = np.polyfit(x, y, 1)
    resid = y - (a * x + b)
    total = ((y - y.mean()) ** 2).sum()
    return float(a), float(b), float(1.0 - (resid**2).sum() / total) if total > 0 else float("nan")
