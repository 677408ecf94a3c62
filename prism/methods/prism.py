"""PRISM as a :class:`~prism.methods.base.Method`: Algorithm 1 across all LoRA modules.

Per logical step (paper Alg. 1), as Opacus' three verbs (:mod:`prism.methods.base`):

0. :meth:`PrismMethod.zero_accumulators` snapshots every module's ``(A, B)``, factors it once
   (:func:`prism.mechanism.geometry.frames`) and checks full rank (never damp), in one batched check and one host
   read for all modules.
1. :meth:`PrismMethod.accumulate` (clip and accumulate) takes each example's global intrinsic norm
   ``s_i``, the norm of the lift (eq. 14) of its factor gradients over all modules (eqs. 15–16,
   :func:`prism.mechanism.geometry.lifted_norm_terms`, an upper bound for every factor pair), clips with
   ``α_i = min(1, C(1 − CLIP_MARGIN)/s_i)`` (docs/PRIVACY.md, "The clip margin"; 0 for a non-finite ``s_i``)
   and sums ``Σ α_i (g_A, g_B)_i`` (one product with ``α`` over the examples).
2. :meth:`PrismMethod.add_noise` lifts that sum once (the lift is linear, so this is ``Σ α_i ΔA_i``,
   ``Σ α_i ΔB_i``), divides by the expected batch size ``B``, adds ``(σC/B)·(Ξ_A, Ξ_B)`` (eqs. 17, 19)
   and horizontalises (Prop. A.11). The result, a :class:`~prism.methods.base.Release`, is the one object
   that leaves the private side.
3. :meth:`PrismMethod.update` reads the release and the public factors only: the rank-space adaptive
   transform (eqs. 24–26, :mod:`prism.mechanism.adaptive`) and the retraction (eq. 22).

Modules of equal shape ``(m, n, r)`` form a :class:`ShapeGroup` (a transformer has a handful: q, k,
v, up, down) whose factors, sums and adaptive moments are stacked ``[G, m, r]``, so every step above
runs as one chain of batched kernels per group, and each ``eigh``/SVD of the step is one call for all
groups (:func:`prism.mechanism.geometry.fused`). Nothing synchronises with the host: statistics are 0-dim device
tensors, and a non-finite lift becomes NaN factors (the loop's finite check stops the run).

Privacy of the factor components. The eq.-19 noise has ``AᵀΞ_A = 0`` while the clipped sum's lift
has ``AᵀΔ̄A = ½AᵀĜBN⁻¹``: the r×r vertical (gauge) block of the privatised factor pair is an exact,
noise-free function of the clipped sum (paper Alg. 1 as printed feeds it to the moments). Under DP
the privatised lift is therefore always horizontalised before it is released: the horizontal
representative depends only on the noised tangent vector ``ΔA Bᵀ + A ΔBᵀ`` and the public ``(A, B)``.
The geometry floor and the debias (eq. 50) use the exact moments of the horizontalised noise
(:func:`prism.mechanism.adaptive.horizontal_noise_second_moments`).

``horizontalize``: ``both`` (released code: the lift before the moments and the direction before the
retraction), ``pre_retract`` (the direction only) or ``none`` (paper Alg. 1). Under DP the lift is
horizontalised in every setting (above), so the setting changes the pre-moment gauge of non-DP runs
only, plus the (image-preserving) pre-retraction step.

Precision. Under DP the per-example norms, clip coefficients, clipped sums, noise and horizontalisation
run in float64 from the snapshots, and the norm carries a rounding bound (docs/DECISIONS.md D40, D60,
D70), so every clipped contribution has intrinsic norm ≤ C for every factor pair the rank check
admits. ``compute_dtype`` (default float32) is the dtype of the snapshots, the rank check's cutoff and
the adaptive moments (non-DP: of everything); bf16 parameters are never used for the linear algebra;
the retraction runs in float64.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from prism.mechanism import geometry
from prism.mechanism.adaptive import (
    RankSpaceAdaptive,
    horizontal_noise_second_moments,
    noise_second_moments,
    spectral_preconditioner,
    symmetric_part,
)
from prism.mechanism.lora import LoraPair, lora_pairs, read_pair, write_pair
from prism.methods.base import Method, PrivacySpec, Release
from prism.methods.schema import PrismConfig
from prism.privacy.noise import NoiseSource

log = logging.getLogger(__name__)

COMPUTE_DTYPES = {"float32": torch.float32, "float64": torch.float64}  # PrismConfig.compute_dtype
DP_DTYPE = torch.float64  # per-example lifts, norms, clipped sums and noise under DP (module docstring)


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


@dataclass
class ShapeGroup:
    """LoRA modules of one shape ``(m, n, r)``, processed as one batch ``[G, …]``."""

    pairs: list[LoraPair]
    adaptive: RankSpaceAdaptive
    frame: geometry.Frame | None = None
    sums: tuple[Tensor, Tensor] | None = None  # Σ α_i g_A [G, m, r], Σ α_i g_B [G, n, r] (working dtype)

    @property
    def modules(self) -> list[str]:
        return [p.module for p in self.pairs]


def group_by_shape(params: Mapping[str, Tensor], pairs: list[LoraPair]) -> list[list[LoraPair]]:
    """Pairs grouped by ``(m, n, r, dtype, device)`` in order of first appearance."""
    groups: dict[tuple, list[LoraPair]] = {}
    for pair in pairs:
        A, B = read_pair(params, pair)
        groups.setdefault((*A.shape, B.shape[0], A.dtype, B.dtype, A.device), []).append(pair)
    return list(groups.values())


@torch.no_grad()
def stack_pairs(tensors: Mapping[str, Tensor], pairs: list[LoraPair], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Paper ``(A, B)`` of several modules stacked in ``dtype``: ``[G, m, r]``, ``[G, n, r]`` (one fused copy each)."""
    A = torch.empty(len(pairs), *tensors[pairs[0].a_name].shape, dtype=dtype, device=tensors[pairs[0].a_name].device)
    Bt = torch.empty(len(pairs), *tensors[pairs[0].b_name].shape, dtype=dtype, device=A.device)
    torch._foreach_copy_(list(A.unbind(0)), [tensors[p.a_name] for p in pairs])
    torch._foreach_copy_(list(Bt.unbind(0)), [tensors[p.b_name] for p in pairs])
    return A, Bt.mT


class PrismMethod(Method):
    """PRISM (paper Alg. 1) over the peft LoRA parameters ``params``, the released code's variant (D15)."""

    name, label, config_class = "prism", "PRISM", PrismConfig
    tangent, per_example_power = True, 2

    def __init__(self, config: PrismConfig, params: Mapping[str, nn.Parameter], privacy: PrivacySpec | None):
        super().__init__(params, privacy)
        self.config = config
        pairs: list[LoraPair] = lora_pairs(self.params)
        if not pairs:
            raise ValueError("PRISM found no peft LoRA parameters (…lora_A/lora_B….weight) among the trainable ones")
        self.dtype = COMPUTE_DTYPES[self.config.compute_dtype]
        self.work_dtype = DP_DTYPE if self.dp else self.dtype
        self.horizontal_lift = self.dp or self.config.horizontalize == "both"
        self.groups: list[ShapeGroup] = []
        for group in group_by_shape(self.params, pairs):
            A, B = read_pair(self.params, group[0])
            (m, r), n = A.shape, B.shape[0]
            adaptive = RankSpaceAdaptive(self.config, m, n, r, self.dtype, A.device, batch=(len(group),))
            self.groups.append(ShapeGroup(pairs=group, adaptive=adaptive))
        self._norms: list[Tensor] = []

    # ---------------------------------------------------------------- step protocol
    @torch.no_grad()
    def zero_accumulators(self) -> None:
        """Snapshot and factor every group's ``(A, B)``, check full rank (one host read), zero the sums."""
        self._norms = []
        snapshots = [tuple(x.to(self.work_dtype) for x in stack_pairs(self.params, g.pairs, self.dtype))
                     for g in self.groups]
        for g, fr in zip(self.groups, geometry.frames(snapshots)):
            g.frame = fr
        try:
            self._check_rank()
        except geometry.RankDeficientError:
            if self.config.rank_fallback is None:
                raise
            self._floor_rank_deficient()
        for g in self.groups:
            g.sums = (torch.zeros_like(g.frame.A), torch.zeros_like(g.frame.B))

    @torch.no_grad()
    def accumulate(self, grads: Mapping[str, Tensor]) -> None:
        """Clip and accumulate one micro-batch (DP: per-example ``[k, *shape]`` grads, eq. 16; else their sum).

        The clip norm ``s_i`` bounds the norm of example ``i``'s lift from above (eq. 15 summed over all
        modules, eq. 16; :func:`geometry.lifted_norm_terms`): ``max(√Σ‖image‖² + √Σerr², √(Σfsq/2))``. The sums are
        ``Σ α_i (g_A, g_B)_i``, ``α_i = min(1, C(1 − CLIP_MARGIN)/s_i)`` (0 where ``s_i`` is not finite, whose
        gradient is zeroed); their lift (eq. 14, linear) is taken once per step.
        """
        if self.groups[0].frame is None:
            raise RuntimeError("call zero_accumulators() before accumulate()")
        stacked = [self._stack_grads(g, grads) for g in self.groups]
        if not self.dp:
            for g, (gA, gB) in zip(self.groups, stacked):
                g.sums[0].add_(gA), g.sums[1].add_(gB)
            return
        sq, err, fsq = 0.0, 0.0, 0.0
        for g, (gA, gB) in zip(self.groups, stacked):
            s, e, f = geometry.lifted_norm_terms(g.frame, gA, gB)  # [k, G]
            sq, err, fsq = sq + s.sum(-1), err + e.square().sum(-1), fsq + f.sum(-1)
        norms = torch.maximum(sq.sqrt() + err.sqrt(), (fsq / 2).sqrt())
        finite = torch.isfinite(norms)  # a non-finite gradient contributes nothing (0 · NaN would be NaN)
        alpha = torch.where(finite, (self.privacy.clip_target / norms).clamp(max=1.0), 0.0)
        self._norms.append(norms)
        for g, (gA, gB) in zip(self.groups, stacked):  # Σ_i α_i g_i over the buffers' example axis
            g.sums[0].add_(alpha @ gA.nan_to_num_(0.0, 0.0, 0.0).permute(1, 2, 0, 3))
            g.sums[1].add_(alpha @ gB.nan_to_num_(0.0, 0.0, 0.0).permute(1, 2, 0, 3))

    def _stack_grads(self, g: ShapeGroup, grads: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The group's factor gradients ``g_A`` ``[(k,) G, m, r]``, ``g_B`` ``[(k,) G, n, r]`` in the working dtype."""
        for pair in g.pairs:
            if pair.a_name not in grads or pair.b_name not in grads:
                raise KeyError(f"no gradient for LoRA module {pair.module}; every trainable LoRA tensor needs one")
            if grads[pair.a_name].ndim != (3 if self.dp else 2):
                raise ValueError(
                    f"{pair.module}: gradient of shape {tuple(grads[pair.a_name].shape)}; DP needs per-example "
                    "grads [k, *shape] (prism.privacy.per_example), non-DP their micro-batch sum [*shape]"
                )
        if not self.dp:
            return stack_pairs(grads, g.pairs, self.work_dtype)
        # [k, G, p, r] views of [G, p, k, r] buffers: the examples sit beside the columns, the layout in which
        # geometry.lifted_norm_terms takes every product over all examples at once (one fused copy each).
        (k, m, r), n = grads[g.pairs[0].a_name].shape, grads[g.pairs[0].b_name].shape[-1]
        like = {"dtype": self.work_dtype, "device": grads[g.pairs[0].a_name].device}
        gA, gB = torch.empty(len(g.pairs), m, k, r, **like), torch.empty(len(g.pairs), n, k, r, **like)
        torch._foreach_copy_(list(gA.permute(0, 2, 1, 3).unbind(0)), [grads[p.a_name] for p in g.pairs])
        torch._foreach_copy_(list(gB.permute(0, 2, 3, 1).unbind(0)), [grads[p.b_name] for p in g.pairs])
        return gA.permute(2, 0, 1, 3), gB.permute(2, 0, 1, 3)

    @torch.no_grad()
    def add_noise(self, denominator: float, noise: NoiseSource, diagnostics: bool = True) -> Release:
        """Eq. 17 for every group: ``H((Δ̄A, Δ̄B) + τ(Ξ_A, Ξ_B))``, ``τ = σC/denominator``, ``H`` = horizontalise.

        The unit draws of eq. 19 come from ``noise`` (float64) and are scaled by exactly ``τ`` (damped only
        with ``noise_damping``). The released tensors are ``ΔA`` (peft ``lora_B`` layout) and ``ΔBᵀ``
        (``lora_A``); ``noise_sq`` is eq. 21's ``Σ‖N_Z‖²_F`` (with ``diagnostics``).
        """
        if self.groups[0].frame is None:
            raise RuntimeError("call zero_accumulators() before add_noise()")
        tau = self.tau(denominator)
        tensors: dict[str, Tensor] = {}
        noise_sq = []
        for g in self.groups:
            fr = g.frame
            dA, dB = geometry.lift(fr.A, fr.B, *g.sums, frame=fr, rcond=self.config.pinv_rcond)
            dA, dB = dA / denominator, dB / denominator
            if tau > 0:
                omega = [noise.normal(tuple(X.shape), X.device).to(X.dtype) for X in (fr.A, fr.B)]
                XiA, XiB = geometry.tangent_noise(fr, *omega, damping=self.config.noise_damping)
                if diagnostics:
                    noise_sq.append(tau**2 * geometry.intrinsic_sqnorm(fr.A, fr.B, XiA, XiB, frame=fr).sum())
                dA, dB = dA + tau * XiA, dB + tau * XiB
            if self.horizontal_lift:
                dA, dB = geometry.horizontalize(fr.A, fr.B, dA, dB, frame=fr)
            for pair, a, bt in zip(g.pairs, dA.unbind(0), dB.mT.unbind(0)):  # views: one op each, any depth
                tensors[pair.a_name], tensors[pair.b_name] = a, bt
        total = torch.stack(noise_sq).sum() if noise_sq else None
        return Release(tensors=tensors, scale=tau, noise_sq=total)

    @torch.no_grad()
    def update(self, release: Release, diagnostics: bool = True) -> dict[str, Tensor]:
        """From the release and the public factors: adapt (eqs. 24–26), retract (eq. 22), write back.

        Each ``eigh``/SVD is one call for every group (:func:`geometry.fused`). Returns ``update_norm``
        (``‖Z' − Z‖_F`` over all modules) with ``diagnostics``.
        """
        tau, cfg = release.scale, self.config
        moments = horizontal_noise_second_moments if self.horizontal_lift else noise_second_moments
        lifts = [(torch.stack([release.tensors[p.a_name] for p in g.pairs]).to(self.dtype),
                  torch.stack([release.tensors[p.b_name] for p in g.pairs]).mT.to(self.dtype)) for g in self.groups]
        if cfg.preconditioner == "none":
            directions = lifts
        else:  # eqs. 24–26: one eigh for the rank-space moments of every factor of every group
            estimates = [e for g, (dA, dB) in zip(self.groups, lifts)
                         for e in g.adaptive.observe(dA, dB, tau, *(x.to(self.dtype) for x in moments(g.frame)))]
            eighs = geometry.fused(torch.linalg.eigh, [_finite_or_zero(symmetric_part(V)) for _, V, _ in estimates])
            U = [m_hat @ spectral_preconditioner(cfg, w, E, floor) for (m_hat, _, floor), (w, E) in zip(estimates, eighs)]
            directions = list(zip(U[0::2], U[1::2]))
        horizontal = self.config.horizontalize in ("both", "pre_retract")
        cores = [geometry.retraction_core(g.frame.A, g.frame.B, UA, UB, self.config.lr, frame=g.frame,
                                          horizontal=horizontal) for g, (UA, UB) in zip(self.groups, directions)]
        svds = geometry.fused(torch.linalg.svd, [_finite_or_zero(rt.core) for rt in cores])
        coefficients = [geometry.balanced_coefficients(svd, g.frame.A.shape[-1]) for g, svd in zip(self.groups, svds)]
        targets = [geometry.procrustes_target(rt, MA, MB) for rt, (MA, MB) in zip(cores, coefficients)]
        rotations = geometry.fused(torch.linalg.svd, [_finite_or_zero(t) for t in targets])
        update_sq = []
        for g, rt, (MA, MB), svd in zip(self.groups, cores, coefficients, rotations):
            Q = geometry.procrustes_rotation(svd)
            A_new, B_new = geometry.block_product(rt.Qu, MA @ Q), geometry.block_product(rt.Qv, MB @ Q)
            if diagnostics:
                update_sq.append(_product_sqdist(g.frame.A, g.frame.B, A_new, B_new).sum())
            self._write(g, A_new, B_new)
            g.frame, g.sums = None, None
        return {"update_norm": torch.stack(update_sq).sum().sqrt()} if diagnostics else {}

    def clip_stats(self) -> dict[str, Tensor]:
        if not self._norms:
            return {}
        norms = torch.cat(self._norms)
        return {"clip_fraction": (norms > self.privacy.clip_target).double().mean(), "grad_norm_mean": norms.mean()}

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Per module ``{t, mA, VA, mB, VB}`` (independent of the grouping)."""
        out = {}
        for g in self.groups:
            ad = g.adaptive
            for i, module in enumerate(g.modules):
                out[module] = {"t": ad.t, "mA": ad.A.m[i].clone(), "VA": ad.A.V[i].clone(),
                               "mB": ad.B.m[i].clone(), "VB": ad.B.V[i].clone()}
        return {"adaptive": out}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state["adaptive"]
        missing = {m for g in self.groups for m in g.modules} - set(saved)
        if missing:
            raise ValueError(f"checkpoint lacks PRISM state for modules {sorted(missing)}; it belongs to another model")
        for g in self.groups:
            ad = g.adaptive
            for i, module in enumerate(g.modules):
                for key, target in (("mA", ad.A.m[i]), ("VA", ad.A.V[i]), ("mB", ad.B.m[i]), ("VB", ad.B.V[i])):
                    if saved[module][key].shape != target.shape:
                        raise ValueError(
                            f"adaptive state {key} of {module} has shape {tuple(saved[module][key].shape)}, expected "
                            f"{tuple(target.shape)}; the checkpoint was written for another LoRA rank or model"
                        )
                    target.copy_(saved[module][key])
            ad.t = int(saved[g.modules[0]]["t"])

    # ---------------------------------------------------------------- helpers
    def _check_rank(self) -> None:
        """:func:`geometry.check_frames` with the cutoff of ``compute_dtype`` (under DP at most κ = 1e4)."""
        geometry.check_frames([g.frame for g in self.groups], [g.modules for g in self.groups],
                              geometry.default_rcond(self.dtype, self.dp))

    @torch.no_grad()
    def _write(self, g: ShapeGroup, A: Tensor, B: Tensor) -> None:
        """Copy the group's new factors into the peft parameters (one fused copy per factor)."""
        torch._foreach_copy_([self.params[p.a_name] for p in g.pairs], list(A.unbind(0)))
        torch._foreach_copy_([self.params[p.b_name] for p in g.pairs], list(B.mT.unbind(0)))

    def _floor_rank_deficient(self) -> None:
        """The logged ``rank_fallback: floor`` repair of every rank-deficient module, then re-check."""
        rcond = 10.0 * geometry.default_rcond(self.dtype, self.dp)
        for g in self.groups:
            for pair, A, B in zip(g.pairs, g.frame.A, g.frame.B):
                try:
                    geometry.check_full_rank(A, B, pair.module, geometry.default_rcond(self.dtype, self.dp))
                    continue
                except geometry.RankDeficientError:
                    pass
                A, B, raised = floor_spectrum(A, B, rcond)
                log.warning("rank_fallback=floor: %s had %d singular value(s) of ABᵀ raised to %.1e·σ_max",
                            pair.module, raised, rcond)
                write_pair(self.params, pair, A, B)
            g.frame = geometry.frame(*(x.to(self.work_dtype) for x in stack_pairs(self.params, g.pairs, self.dtype)))
        self._check_rank()


class PrismPaperMethod(PrismMethod):
    """PRISM with the paper's eqs. 25–26 (ridge, geometry floor, debias; D15): a variant of ``prism``,
    left out of ``make compare``'s default list."""

    name, label, compare_by_default = "prism_paper", "PRISM (eq. 25–26)", False


def _finite_or_zero(X: Tensor) -> Tensor:
    """Small matrices ``X`` [..., p, q] bound for ``eigh``/SVD (which fail on NaN), non-finite ones zeroed.

    A non-finite lift is not stopped here (no host read): the big factor-sized tensors keep their
    NaN, which reaches the new factors (``Q`` of a NaN QR is NaN), so the loop's finite check stops
    the run; only the ``r×r``/``2r×2r`` inputs of the decompositions are sanitised.
    """
    return torch.where(torch.isfinite(X).flatten(-2).all(-1)[..., None, None], X, torch.zeros_like(X))


def _product_sqdist(A: Tensor, B: Tensor, A2: Tensor, B2: Tensor) -> Tensor:
    """``‖A2 B2ᵀ − A Bᵀ‖²_F = ‖R_u R_vᵀ‖²_F`` for ``[A2, A] = Q_u R_u``, ``[B2, −B] = Q_v R_v`` (no m×n)."""
    Ru = torch.linalg.qr(torch.cat([A2, A], dim=-1), mode="r").R
    Rv = torch.linalg.qr(torch.cat([B2, -B], dim=-1), mode="r").R
    return (Ru @ Rv.mT).square().sum((-2, -1))
