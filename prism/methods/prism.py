"""PRISM as a :class:`~prism.methods.base.Method`: Algorithm 1 across all LoRA modules.

Per logical step (paper Alg. 1; SPEC §3):

1. :meth:`PrismMethod.zero_accumulators` snapshots every module's ``(A, B)`` in ``compute_dtype``,
   factors it once (:func:`prism.geometry.frame`) and checks full rank (SPEC §3: never damp).
2. :meth:`PrismMethod.accumulate` lifts each example's factor gradients (eq. 14), takes the global
   intrinsic norm ``s_i`` over all modules (eqs. 15–16), clips with ``α_i = min(1, C/s_i)`` and sums
   ``Σ α_i ΔA_i``, ``Σ α_i ΔB_i`` (batched over the micro-batch; no ``m×n`` matrix).
3. :meth:`PrismMethod.step` divides by the expected batch size ``B`` and adds ``(σC/B)·(Ξ_A, Ξ_B)``
   (eqs. 17, 19) — exactly the accountant's scale; optional Sylvester horizontalisation; the
   rank-space adaptive transform (eqs. 24–26, :mod:`prism.adaptive`); retraction (eq. 22).

Privacy of the factor components. The eq.-19 noise has ``AᵀΞ_A = 0`` while the clipped sum's lift
has ``AᵀΔ̄A = ½AᵀĜBN⁻¹``: the r×r vertical (gauge) block of the privatised factor pair is an exact,
noise-free function of the clipped sum (paper Alg. 1 as printed feeds it to the moments). Under DP
the privatised lift is therefore always horizontalised (Prop. A.11) before anything reads its
factor components: the horizontal representative depends only on the noised tangent vector
``ΔA Bᵀ + A ΔBᵀ`` and the public ``(A, B)``. The geometry floor and the debias (eq. 50) then use the
exact moments of the horizontalised noise (:func:`prism.adaptive.horizontal_noise_second_moments`).

``horizontalize``: ``both`` (released code: the lift before the moments and the direction before the
retraction), ``pre_retract`` (the direction only) or ``none`` (paper Alg. 1). Under DP the lift is
horizontalised in every setting (above), so the setting changes the pre-moment gauge of non-DP runs
only, plus the (image-preserving) pre-retraction step.

Non-DP: grads arrive summed over the micro-batch; the lift is linear, so the sum is lifted once.

Precision. Under DP the per-example lifts, intrinsic norms (eq. 15, block form), clip coefficients,
clipped sums, noise and horizontalisation run in float64 from the snapshots, so every clipped
contribution has intrinsic norm ≤ C(1 + 1e-6) for every factor pair the rank check admits
(float32 norms under-estimate by up to 1.35× at κ = 2,500, the error growing like eps·κ²).
Measured on CPU: the float64 per-example path costs ~1.75× the float32 one (SmolLM2-135M shapes,
r = 16, micro-batch 8; float32 lifts with float64 norms cost the same as all-float64). Its cost is
``O(k m r²)`` per module against ``O(k L m r)`` for the per-example gradients of ``L`` tokens. ``compute_dtype`` (default float32)
is the dtype of the snapshots, the rank check and the adaptive moments (non-DP: of everything);
bf16 parameters are never used for the linear algebra; the retraction runs in float64 internally.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from prism import geometry
from prism.adaptive import (
    AdaptiveConfig,
    RankSpaceAdaptive,
    horizontal_noise_second_moments,
    noise_second_moments,
)
from prism.lora import LoraPair, lora_pairs, read_pair, write_pair
from prism.methods.base import Method, PrivacySpec

log = logging.getLogger(__name__)

HORIZONTALIZE = ("both", "pre_retract", "none")
RANK_FALLBACKS = (None, "floor")
COMPUTE_DTYPES = {"float32": torch.float32, "float64": torch.float64}
# Fields of the method node this class reads besides the AdaptiveConfig ones; "name"/"init"/"init_svd" belong
# to build_method / prism.models.
_OWN_FIELDS = {"name", "lr", "init", "init_svd", "horizontalize", "rank_fallback", "compute_dtype", "noise_damping",
               "pinv_rcond"}
DP_DTYPE = torch.float64  # per-example lifts, norms, clipped sums and noise under DP (module docstring)


@dataclass(frozen=True)
class PrismConfig:
    """The ``method`` node for ``prism`` / ``prism_paper`` (see ``conf/method/prism*.yaml``)."""

    lr: float
    horizontalize: str = "both"
    rank_fallback: str | None = None
    compute_dtype: str = "float32"
    adaptive: AdaptiveConfig = AdaptiveConfig()
    noise_damping: float | None = None  # released protocol: (N + δI)^{-1/2} whitening (geometry.tangent_noise)
    pinv_rcond: float | None = None  # released protocol: eigen-cut pseudo-inverses in the lift (geometry.lift)

    def __post_init__(self) -> None:
        if self.horizontalize not in HORIZONTALIZE:
            raise ValueError(f"method.horizontalize={self.horizontalize!r}; choose one of {HORIZONTALIZE}")
        if self.rank_fallback not in RANK_FALLBACKS:
            raise ValueError(f"method.rank_fallback={self.rank_fallback!r}; choose null or 'floor'")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"method.compute_dtype={self.compute_dtype!r}; choose float32 or float64")
        if not self.lr > 0:
            raise ValueError(f"method.lr={self.lr} must be a positive float")

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> PrismConfig:
        """Read a method node; unknown keys are an error (a typo would otherwise be ignored)."""
        known = _OWN_FIELDS | set(AdaptiveConfig.__dataclass_fields__)
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"unknown PRISM method field(s) {unknown}; known fields: {sorted(known)}")
        own = {k: cfg[k] for k in ("horizontalize", "rank_fallback", "compute_dtype", "noise_damping", "pinv_rcond")
               if k in cfg}
        return cls(lr=float(cfg["lr"]), adaptive=AdaptiveConfig.from_mapping(cfg), **own)


def floor_spectrum(A: Tensor, B: Tensor, rcond: float) -> tuple[Tensor, Tensor, int]:
    """Balanced refactorisation of ``Z = ABᵀ`` with singular values raised to ``≥ rcond·σ_max(Z)``.

    The explicit ``rank_fallback: floor`` repair: post-processing of already-released factors (so
    DP-neutral) that changes ``Z`` by at most ``rcond·σ_max`` per raised direction. Returns the new
    factors and how many singular values were raised; raises if ``Z = 0``.
    """
    QA, RA = torch.linalg.qr(A, mode="reduced")
    QB, RB = torch.linalg.qr(B, mode="reduced")
    U, S, Vh = torch.linalg.svd(RA @ RB.mT)
    if not (torch.isfinite(S).all() and S[0] > 0):
        raise geometry.RankDeficientError("LoRA product ABᵀ is zero or non-finite; rank_fallback cannot repair it")
    floored = S.clamp_min(rcond * S[0])
    root = floored.sqrt()
    return QA @ (U * root), QB @ (Vh.mT * root), int((floored > S).sum())


class PrismMethod(Method):
    """PRISM (paper Alg. 1) over the peft LoRA parameters ``params``."""

    def __init__(self, cfg: Mapping[str, Any], params: Mapping[str, nn.Parameter], privacy: PrivacySpec | None):
        super().__init__(params, privacy)
        self.config = PrismConfig.from_mapping(cfg)
        self.pairs: list[LoraPair] = lora_pairs(self.params)
        if not self.pairs:
            raise ValueError("PRISM found no peft LoRA parameters (…lora_A/lora_B….weight) among the trainable ones")
        self.dtype = COMPUTE_DTYPES[self.config.compute_dtype]
        self.work_dtype = DP_DTYPE if self.dp else self.dtype
        self.horizontal_lift = self.dp or self.config.horizontalize == "both"
        self.adaptive: dict[str, RankSpaceAdaptive] = {}
        for pair in self.pairs:
            A, B = read_pair(self.params, pair)
            (m, r), n = A.shape, B.shape[0]
            self.adaptive[pair.module] = RankSpaceAdaptive(self.config.adaptive, m, n, r, self.dtype, A.device)
        self._frames: dict[str, geometry.Frame] = {}
        self._sums: dict[str, tuple[Tensor, Tensor]] = {}
        self._norms: list[Tensor] = []

    # ---------------------------------------------------------------- step protocol
    def zero_accumulators(self) -> None:
        """Snapshot ``(A, B)`` in ``compute_dtype``, check full rank, factor in the working dtype, zero the sums."""
        self._frames, self._sums, self._norms = {}, {}, []
        for pair in self.pairs:
            A, B = (x.detach().to(self.dtype) for x in read_pair(self.params, pair))
            A, B = (x.to(self.work_dtype) for x in self._full_rank(pair, A, B))
            self._frames[pair.module] = geometry.frame(A, B)
            self._sums[pair.module] = (torch.zeros_like(A), torch.zeros_like(B))

    def accumulate(self, grads: Mapping[str, Tensor]) -> None:
        """Add one micro-batch (DP: per-example ``[k, *shape]`` grads, clipped by eq. 16; else a sum)."""
        if not self._frames:
            raise RuntimeError("call zero_accumulators() before accumulate()")
        lifts = {}
        for pair in self.pairs:
            if pair.a_name not in grads or pair.b_name not in grads:
                raise KeyError(f"no gradient for LoRA module {pair.module}; every trainable LoRA tensor needs one")
            gA, gB = (g.detach().to(self.work_dtype) for g in read_pair(grads, pair))
            if gA.ndim != (3 if self.dp else 2):
                raise ValueError(
                    f"{pair.module}: gradient of shape {tuple(grads[pair.a_name].shape)}; DP needs per-example "
                    "grads [k, *shape] (prism.privacy.per_example), non-DP their micro-batch sum [*shape]"
                )
            fr = self._frames[pair.module]
            lifts[pair.module] = geometry.lift(fr.A, fr.B, gA, gB, frame=fr, rcond=self.config.pinv_rcond)
        if not self.dp:
            for module, (dA, dB) in lifts.items():
                self._sums[module][0].add_(dA)
                self._sums[module][1].add_(dB)
            return
        sq = sum(geometry.intrinsic_sqnorm(fr.A, fr.B, *lifts[mod], frame=fr) for mod, fr in self._frames.items())
        norms = sq.clamp_min(0.0).sqrt()
        if not torch.isfinite(norms).all():
            raise FloatingPointError("non-finite per-example gradient norm; lower the learning rate or check the loss")
        alpha = (self.privacy.clip_norm / norms).clamp(max=1.0)
        self._norms.append(norms)
        for module, (dA, dB) in lifts.items():
            self._sums[module][0].add_(torch.einsum("k,kmr->mr", alpha, dA))
            self._sums[module][1].add_(torch.einsum("k,knr->nr", alpha, dB))

    def privatized_lifts(
        self, denominator: float, generator: torch.Generator | None
    ) -> tuple[dict[str, tuple[Tensor, Tensor]], float]:
        """Eq. 17: per module ``(Δ̄A, Δ̄B) + τ(Ξ_A, Ξ_B)``, ``τ = σC/denominator``; and ``‖N_Z‖_F`` (eq. 21).

        The unit sampler of eq. 19 is scaled by exactly ``τ`` (damped only with ``noise_damping``). Under DP (and with
        ``horizontalize: both``) the result is horizontalised, so its factor components are a
        function of the noised tangent vector and the public ``(A, B)`` only. Non-DP: ``τ = 0``.
        """
        if not self._frames:
            raise RuntimeError("call zero_accumulators() before step()")
        if not denominator > 0:
            raise ValueError(f"denominator={denominator} must be positive (the expected batch size B under DP, the realised one otherwise)")
        tau = self.tau(denominator)
        out, noise_sq = {}, 0.0
        for module, fr in self._frames.items():
            dA, dB = (s / denominator for s in self._sums[module])
            if tau > 0:
                XiA, XiB = geometry.tangent_noise(fr.A, fr.B, generator=generator, frame=fr,
                                                  damping=self.config.noise_damping)
                XiA, XiB = tau * XiA, tau * XiB
                noise_sq += geometry.intrinsic_sqnorm(fr.A, fr.B, XiA, XiB, frame=fr).item()
                dA, dB = dA + XiA, dB + XiB
            if self.horizontal_lift:
                dA, dB = geometry.horizontalize(fr.A, fr.B, dA, dB, frame=fr)
            out[module] = (dA, dB)
        return out, math.sqrt(noise_sq)

    @torch.no_grad()
    def step(self, denominator: float, generator: torch.Generator | None) -> dict[str, float]:
        """Privatise and horizontalise (eq. 17), adapt (eqs. 24–26), retract (eq. 22), write back."""
        lifts, noise_norm = self.privatized_lifts(denominator, generator)
        tau, h = self.tau(denominator), self.config.horizontalize
        moments = horizontal_noise_second_moments if self.horizontal_lift else noise_second_moments
        update_sq = 0.0
        for pair in self.pairs:
            fr = self._frames[pair.module]
            dA, dB = (x.to(self.dtype) for x in lifts[pair.module])
            sigma_A, sigma_B = (x.to(self.dtype) for x in moments(fr))
            UA, UB = (x.to(self.work_dtype) for x in self.adaptive[pair.module].step(dA, dB, tau, sigma_A, sigma_B))
            if h in ("both", "pre_retract"):
                UA, UB = geometry.horizontalize(fr.A, fr.B, UA, UB, frame=fr)
            A_new, B_new = geometry.retract(fr.A, fr.B, UA, UB, self.config.lr)
            update_sq += _product_sqdist(fr.A, fr.B, A_new, B_new)
            write_pair(self.params, pair, A_new, B_new)
        stats = {"update_norm": math.sqrt(update_sq)}
        if self.dp:
            stats["noise_norm"] = noise_norm
        if self._norms:
            norms = torch.cat(self._norms)
            stats["clip_fraction"] = (norms > self.privacy.clip_norm).double().mean().item()
            stats["grad_norm_mean"] = norms.mean().item()
        self._frames, self._sums = {}, {}
        return stats

    def tau(self, denominator: float) -> float:
        """Noise standard deviation ``σC/denominator`` of the averaged lift (0 without DP)."""
        return 0.0 if self.privacy is None else self.privacy.sigma * self.privacy.clip_norm / denominator

    @property
    def example_norms(self) -> Tensor:
        """Intrinsic per-example norms ``s_i`` (eq. 16) accumulated so far in this logical step."""
        return torch.cat(self._norms) if self._norms else torch.zeros(0, dtype=self.dtype)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {"adaptive": {module: ad.state_dict() for module, ad in self.adaptive.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = set(self.adaptive) - set(state["adaptive"])
        if missing:
            raise ValueError(f"checkpoint lacks PRISM state for modules {sorted(missing)}; it belongs to another model")
        for module, ad in self.adaptive.items():
            ad.load_state_dict(state["adaptive"][module])

    # ---------------------------------------------------------------- helpers
    def _full_rank(self, pair: LoraPair, A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`geometry.check_full_rank`, or the logged ``floor`` repair when configured."""
        try:
            geometry.check_full_rank(A, B, pair.module)
            return A, B
        except geometry.RankDeficientError:
            if self.config.rank_fallback is None:
                raise
        rcond = 10.0 * geometry.default_rcond(self.dtype)
        A, B, raised = floor_spectrum(A, B, rcond)
        log.warning("rank_fallback=floor: %s had %d singular value(s) of ABᵀ raised to %.1e·σ_max",
                    pair.module, raised, rcond)
        geometry.check_full_rank(A, B, pair.module)
        write_pair(self.params, pair, A, B)
        return A, B


def _product_sqdist(A: Tensor, B: Tensor, A2: Tensor, B2: Tensor) -> float:
    """``‖A2 B2ᵀ − A Bᵀ‖²_F = ‖R_u R_vᵀ‖²_F`` for ``[A2, A] = Q_u R_u``, ``[B2, −B] = Q_v R_v`` (no m×n)."""
    Ru = torch.linalg.qr(torch.cat([A2, A], dim=1), mode="r").R
    Rv = torch.linalg.qr(torch.cat([B2, -B], dim=1), mode="r").R
    return (Ru @ Rv.mT).square().sum().item()
