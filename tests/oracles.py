"""Reference implementations that production does not run, kept as oracles for the tests.

* :func:`retract`: eq. 22 composed from :mod:`prism.mechanism.geometry`'s pieces for one batch (the method fuses
  each SVD over all shape groups instead).
* :func:`lifted_sqnorm_by_differences`: the difference-of-squares form of eq. 15 from factor gradients
  (exact for gradients ``(GB, GᵀA)``, loses everything on gauge-dominated pairs; docs/DECISIONS.md D70).
* :func:`prism_noise_energy`, :func:`min_gauge_noise_energy`: eqs. 20–21 and 35 in closed form.
* :class:`PerModulePrism`: PRISM with one shape group per module (one decomposition call per module).
* :func:`release_lifts`, :func:`example_norms`: read a method's release and clip norms in tests.
* :func:`read_metrics`: a run's ``metrics.jsonl`` as a reader takes it after a resume.
* :func:`grads_of`: per-example factor gradients of ``⟨G_i, ABᵀ⟩`` in closed form (what autograd gives).
* :func:`exact_sqnorm`: the intrinsic norm ``‖ΔA Bᵀ + A ΔBᵀ‖²_F`` in exact rational arithmetic.
* :func:`repeat_and_select_rdp`, :func:`delta_from_rdp`, :func:`candidate_rdp`, :func:`selection_epsilon`: a private
  selection's accounting written out from Papernot & Steinke (2022), Thm 2 and 6, on this package's RDP curve
  (:mod:`prism.privacy.selection` composes it with ``dp_accounting``; docs/PRIVACY.md "ε includes tuning").
"""
from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from prism.mechanism import geometry
from prism.mechanism.adaptive import RankSpaceAdaptive
from prism.mechanism.lora import lora_pairs, read_pair
from prism.methods.prism import PrismMethod, ShapeGroup
from prism.privacy.limits import ORDERS, rdp_curve, rdp_to_epsilon
from prism.privacy.noise import as_noise_source
from prism.privacy.selection import POISSON, tnb_gamma


def retract(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, lr: float, align: bool = True,
            frame: geometry.Frame | None = None, horizontal: bool = False) -> tuple[Tensor, Tensor]:
    """Eq. 22 with the balanced refactorisation and (``align``) the Procrustes rotation (App. A.22, A.24)."""
    fr = geometry.frame(A, B) if frame is None else frame
    rt = geometry.retraction_core(A, B, dA, dB, lr, frame=fr, horizontal=horizontal)
    MA, MB = geometry.balanced_coefficients(torch.linalg.svd(rt.core), A.shape[-1])
    if align:
        Q = geometry.procrustes_rotation(torch.linalg.svd(geometry.procrustes_target(rt, MA, MB)))
        MA, MB = MA @ Q, MB @ Q
    return geometry.block_product(rt.Qu, MA).to(A.dtype), geometry.block_product(rt.Qv, MB).to(B.dtype)


def lifted_sqnorm_by_differences(A: Tensor, B: Tensor, gA: Tensor, gB: Tensor) -> Tensor:
    """``¼‖c_A + c_Bᵀ‖² + (‖X_A‖² − ‖c_A‖²) + (‖X_B‖² − ‖c_B‖²)``, clamped at 0 (the form before D70)."""
    fr = geometry.frame(A, B)
    XA, XB = gA @ fr.RBi, gB @ fr.RAi
    cA, cB = fr.QA.mT @ XA, fr.QB.mT @ XB

    def sq(X: Tensor) -> Tensor:
        return X.square().sum((-2, -1))

    return 0.25 * sq(cA + cB.mT) + (sq(XA) - sq(cA)).clamp_min(0.0) + (sq(XB) - sq(cB)).clamp_min(0.0)


def prism_noise_energy(m: int, n: int, r: int, tau: float) -> float:
    """Eqs. 20–21: ``E‖τ P_{A,B}(Ξ)‖²_F = τ² r(m + n − r)``, independent of ``A``, ``B``."""
    return tau**2 * geometry.tangent_dim(m, n, r)


def min_gauge_noise_energy(A: Tensor, B: Tensor, tau: float) -> float:
    """Eq. 35: ``min_c`` of the gauge noise energy, ``2τ² √(mn) ‖A‖_F ‖B‖_F``."""
    m, n = A.shape[0], B.shape[0]
    return 2.0 * tau**2 * math.sqrt(m * n) * A.norm().item() * B.norm().item()


class PerModulePrism(PrismMethod):
    """:class:`PrismMethod` with every module its own shape group (the per-module reference path)."""

    def __init__(self, cfg: Any, params: Any, privacy: Any) -> None:
        super().__init__(cfg, params, privacy)
        groups = []
        for pair in [p for g in self.groups for p in g.pairs]:
            A, B = read_pair(self.params, pair)
            adaptive = RankSpaceAdaptive(self.config, A.shape[0], B.shape[0], A.shape[1], self.dtype,
                                         A.device, batch=(1,))
            groups.append(ShapeGroup(pairs=[pair], adaptive=adaptive))
        self.groups = groups


def release_lifts(method: PrismMethod, denominator: float, noise: Any = None
                  ) -> tuple[dict[str, tuple[Tensor, Tensor]], Any]:
    """Per module the released ``(ΔA, ΔB)`` of :meth:`PrismMethod.add_noise`, and the release itself."""
    release = method.add_noise(denominator, as_noise_source(noise))
    pairs = lora_pairs(method.params)
    return {p.module: (release.tensors[p.a_name], release.tensors[p.b_name].mT) for p in pairs}, release


def example_norms(method: Any) -> Tensor:
    """The clip norms of this logical step's examples (PRISM: eq. 16 with its rounding bound)."""
    norms = method._norms if isinstance(method, PrismMethod) else method.norms
    return torch.cat(norms) if norms else torch.zeros(0, dtype=torch.float64)


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    """Step records, one per ``step`` (the last line wins after a resume), in step order."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    by_step: dict[Any, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            by_step[record.get("step")] = record
    return sorted(by_step.values(), key=lambda r: (r.get("step") is None, r.get("step") or 0))


def grads_of(A: Tensor, B: Tensor, G: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
    """Per-example factor grads of ⟨G_i, ABᵀ⟩ for G [k, m, n] under peft's names: g_A = G B, g_Bᵀ = Aᵀ G."""
    A, B = A.to(torch.float64), B.to(torch.float64)
    return {"x.lora_B.default.weight": (G @ B).to(dtype), "x.lora_A.default.weight": (A.T @ G).to(dtype)}


def exact_sqnorm(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor) -> Fraction:
    """‖ΔA Bᵀ + A ΔBᵀ‖²_F of the stored floats, in exact rational arithmetic."""
    A, B, dA, dB = ([[Fraction(float(v)) for v in row] for row in t.tolist()] for t in (A, B, dA, dB))
    rank = len(A[0])
    total = Fraction(0)
    for i in range(len(A)):
        for j in range(len(B)):
            entry = sum(dA[i][k] * B[j][k] + A[i][k] * dB[j][k] for k in range(rank))
            total += entry * entry
    return total


def repeat_and_select_rdp(rdp: np.ndarray, mean: float, shape: float,
                          orders: np.ndarray | None = None) -> np.ndarray:
    """Rényi DP of publishing the best of ``K`` independent candidates, each with RDP ``rdp``.

    Thm 6 (Poisson ``K``): ``ε'(λ) = ε(λ) + μ δ̂ + log μ / (λ − 1)``, ``δ̂`` the candidate's δ at
    ``ε̂ = log(1 + 1/(λ − 1))``. Thm 2 (truncated negative binomial):
    ``ε'(λ) = ε(λ) + log μ / (λ − 1) + (1 + η) min_λ̂ [(1 − 1/λ̂) ε(λ̂) + log(1/γ)/λ̂]``, then made
    non-decreasing in ``λ`` (an RDP bound at a higher order holds at every lower one).
    """
    alpha = np.asarray(ORDERS if orders is None else orders, dtype=np.float64)
    rdp = np.asarray(rdp, dtype=np.float64)
    log_mean = math.log(mean)
    if shape == POISSON:
        hat = np.array([delta_from_rdp(rdp, math.log1p(1 / (a - 1)), alpha) for a in alpha])
        return rdp + mean * hat + log_mean / (alpha - 1)
    gamma = tnb_gamma(mean, shape)
    constant = (1 + shape) * float(np.min((1 - 1 / alpha) * rdp - math.log(gamma) / alpha))
    out = rdp + log_mean / (alpha - 1) + constant
    return np.minimum.accumulate(out[::-1])[::-1]


def delta_from_rdp(rdp: np.ndarray, epsilon: float, orders: np.ndarray | None = None) -> float:
    """The smallest δ an RDP curve gives at ``ε`` (Canonne, Kamath & Steinke 2020, Prop. 12).

    ``δ ≤ exp((λ − 1)(ε(λ) − ε + log(1 − 1/λ)) − log λ)``, and ``δ ≤ sqrt(1 − exp(−ε(λ)))`` (the
    KL bound), minimised over ``λ``.
    """
    alpha = np.asarray(ORDERS if orders is None else orders, dtype=np.float64)
    rdp = np.asarray(rdp, dtype=np.float64)
    with np.errstate(divide="ignore"):
        kl = 0.5 * np.log(-np.expm1(-np.maximum(rdp, 0.0)))
    tail = (alpha - 1) * (rdp - epsilon + np.log1p(-1 / alpha)) - np.log(alpha)
    return float(min(1.0, math.exp(float(np.min(np.minimum(kl, tail))))))


def candidate_rdp(sigma: float, sample_rate: float, steps: int, score_sigma: float) -> np.ndarray:
    """One candidate's RDP: ``T`` subsampled Gaussian steps, then a count of sensitivity 1 with
    Gaussian noise ``score_sigma`` (``λ / (2 σ_s²)``), composed by addition."""
    if not score_sigma > 0:
        raise ValueError(f"the score's noise must be > 0, got {score_sigma}")
    return steps * rdp_curve(sigma, sample_rate) + np.asarray(ORDERS, dtype=np.float64) / (2 * score_sigma**2)


def selection_epsilon(sigma: float, sample_rate: float, steps: int, delta: float, *, score_sigma: float,
                      mean: float, shape: float) -> float:
    """ε at ``δ`` of the whole selection (Balle et al. 2020, Thm 21, at the best order)."""
    rdp = repeat_and_select_rdp(candidate_rdp(sigma, sample_rate, steps, score_sigma), mean, shape)
    return float(np.min(rdp_to_epsilon(rdp, delta)))
