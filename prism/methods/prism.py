"""PRISM as a :class:`~prism.methods.base.Method`: Algorithm 1 across all LoRA modules.

Per logical step (paper Alg. 1):

1. :meth:`PrismMethod.zero_accumulators` snapshots every module's ``(A, B)`` in ``compute_dtype``,
   factors it once (:func:`prism.geometry.frame`) and checks full rank (never damp), in one batched
   check and one host read for all modules.
2. :meth:`PrismMethod.accumulate` takes each example's global intrinsic norm ``s_i``, the norm of the
   lift (eq. 14) of its factor gradients over all modules (eqs. 15–16, without forming the lift),
   clips with ``α_i = min(1, C/s_i)`` and sums ``Σ α_i (g_A, g_B)_i`` (batched over the micro-batch;
   no ``m×n`` matrix).
3. :meth:`PrismMethod.step` lifts that sum once (the lift is linear, so this is ``Σ α_i ΔA_i``,
   ``Σ α_i ΔB_i``), divides by the expected batch size ``B`` and adds ``(σC/B)·(Ξ_A, Ξ_B)``
   (eqs. 17, 19) — exactly the accountant's scale; optional Sylvester horizontalisation; the
   rank-space adaptive transform (eqs. 24–26, :mod:`prism.adaptive`); retraction (eq. 22).

Modules of equal shape ``(m, n, r)`` form a :class:`ShapeGroup` (a transformer has a handful: q, k,
v, up, down) whose factors, sums and adaptive moments are stacked ``[G, m, r]``, so every step above
runs as one chain of batched kernels per group, not per module, and each ``eigh``/SVD of the step is
one call for all groups; ``batched=False`` makes one group per module and one decomposition call per
module (the reference path). ``accumulate`` and ``step`` never synchronise with the host: statistics
are 0-dim device tensors, and a non-finite lift is written as NaN factors (the loop's finite check
stops the run) instead of being raised here.

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

Non-DP: grads arrive summed over the micro-batch and are summed, then lifted once, the same way.

Precision. Under DP the per-example intrinsic norms (eq. 15), clip coefficients, clipped sums,
noise and horizontalisation run in float64 from the snapshots, so every clipped contribution has
intrinsic norm ≤ C(1 + 1e-6) for every factor pair the rank check admits (float32 norms
under-estimate by up to 1.35× at κ = 2,500, the error growing like eps·κ²). The norms come from
``r×r`` float64 products of each example's float32 gradients (:func:`geometry.gram_lifted_sqnorms`;
docs/DECISIONS.md D40, D60): ``O(k m r²)`` flops per module against ``O(k L m r)`` for the
per-example gradients of ``L`` tokens, and no ``m×r`` lift per example.
``compute_dtype`` (default float32) is the dtype of the snapshots, the rank check's cutoff and the
adaptive moments (non-DP: of everything); bf16 parameters are never used for the linear algebra;
the retraction runs in float64 internally.

CPU cost of the step (docs/DECISIONS.md D66). With a float64 frame the privatised lift is one fused
pass (:func:`geometry.privatized_lift`: lift, noise and horizontalisation as ``r×r`` coefficients);
under float32 ``compute_dtype`` (the rank check bounds ``κ ≤ 2,896``) the batched frames' QRs are
CholeskyQR2 with Householder's signs (:func:`geometry.cholesky_qr2`; a failure reads as rank deficient
and is re-decided with Householder frames; the per-module reference path keeps Householder) and the lift multiplies by ``N⁻¹``, ``M⁻¹`` formed once. The
retraction's new blocks are factored by :func:`geometry.block_basis`. On the CPU the step's
factor-sized temporaries (snapshots, draws, lifts, moments' ``m̂``, directions, bases, new factors)
live in kept scratch tensors (:mod:`prism.methods.scratch`), each overwritten by the next step. The privatised
lift and the retraction's directions, QR extensions and core run over cache-sized tiles of a group's modules on
the CPU (:meth:`PrismMethod._step_tiles`, docs/DECISIONS.md D68).

CPU cost of the per-example pass (docs/DECISIONS.md D67). ``accumulate`` runs each group's two factor
sides in tiles (:mod:`prism.methods.clipping`): on the CPU of about 16 MiB, each converted into one
shared buffer and its products taken from cache, the weighted sum loading it again; elsewhere (and with
``tile_bytes=math.inf``) one tile per side, the same kernel chain whatever the depth.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
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
    spectral_preconditioner,
    symmetric_part,
)
from prism.lora import LoraPair, lora_pairs, read_pair, write_pair
from prism.methods import clipping
from prism.methods.base import Method, PrivacySpec
from prism.methods.scratch import Scratch, kept_on, tile_budget, tile_count

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


@dataclass
class ShapeGroup:
    """LoRA modules of one shape ``(m, n, r)``, processed as one batch ``[G, …]``."""

    pairs: list[LoraPair]
    adaptive: RankSpaceAdaptive
    frame: geometry.Frame | None = None
    sums: tuple[Tensor, Tensor] | None = None

    @property
    def modules(self) -> list[str]:
        return [p.module for p in self.pairs]


def group_by_shape(params: Mapping[str, Tensor], pairs: list[LoraPair], batched: bool = True) -> list[list[LoraPair]]:
    """Pairs grouped by ``(m, n, r, dtype, device)`` in order of first appearance (singletons if not ``batched``)."""
    if not batched:
        return [[pair] for pair in pairs]
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
    """PRISM (paper Alg. 1) over the peft LoRA parameters ``params``."""

    def __init__(self, cfg: Mapping[str, Any], params: Mapping[str, nn.Parameter], privacy: PrivacySpec | None,
                 batched: bool = True, tile_bytes: float | None = None):
        super().__init__(params, privacy)
        self.config = PrismConfig.from_mapping(cfg)
        pairs: list[LoraPair] = lora_pairs(self.params)
        if not pairs:
            raise ValueError("PRISM found no peft LoRA parameters (…lora_A/lora_B….weight) among the trainable ones")
        self.dtype = COMPUTE_DTYPES[self.config.compute_dtype]
        self.work_dtype = DP_DTYPE if self.dp else self.dtype
        self.horizontal_lift = self.dp or self.config.horizontalize == "both"
        self.groups: list[ShapeGroup] = []
        for group in group_by_shape(self.params, pairs, batched):
            A, B = read_pair(self.params, group[0])
            (m, r), n = A.shape, B.shape[0]
            adaptive = RankSpaceAdaptive(self.config.adaptive, m, n, r, self.dtype, A.device, batch=(len(group),))
            self.groups.append(ShapeGroup(pairs=group, adaptive=adaptive))
        self._norms: list[Tensor] = []
        self.scratch = Scratch(self.work_dtype)  # kept CPU workspaces of accumulate/step (prism.methods.scratch)
        self._fresh = True
        self._ready = False
        self.batched = batched
        self.tile_bytes = tile_bytes  # tiles' budget (prism.methods.scratch.tile_budget); math.inf: whole groups
        self._fused = geometry.fused if batched else _one_by_one

    # ---------------------------------------------------------------- step protocol
    def zero_accumulators(self) -> None:
        """Snapshot and factor every group's ``(A, B)``, check full rank (one host read), start the sums
        (the first :meth:`accumulate` overwrites them, so they are never zeroed first)."""
        self._norms = []
        snapshots = [self._snapshot(g) for g in self.groups]
        cholesky = self.batched and self.dtype == torch.float32 and self.work_dtype == torch.float64
        work = self._frame_work(snapshots) if cholesky else None
        for g, fr in zip(self.groups, geometry.frames(snapshots, cholesky=cholesky, work=work)):
            g.frame = fr
        try:
            self._check_rank(cholesky)
        except geometry.RankDeficientError:
            if cholesky:  # re-decide with Householder frames (a failed CholeskyQR2 reads as rank deficient)
                for g, fr in zip(self.groups, geometry.frames(snapshots)):
                    g.frame = fr
            try:
                self._check_rank()
            except geometry.RankDeficientError:
                if self.config.rank_fallback is None:
                    raise
                self._floor_rank_deficient()
        flat = self.scratch.flat("sums", sum(g.frame.A.numel() + g.frame.B.numel() for g in self.groups),
                                 self.groups[0].frame.A.device)
        offset = 0
        for g in self.groups:  # g_A, g_Bᵀ layouts; written by the first accumulate (or zeroed by step)
            (G, m, r), n = g.frame.A.shape, g.frame.B.shape[-2]
            g.sums = (flat[offset: offset + G * m * r].view(G, m, r),
                      flat[offset + G * m * r: offset + G * (m + n) * r].view(G, r, n))
            offset += G * (m + n) * r
        self._ready, self._fresh = True, True

    def _frame_work(self, snapshots: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]] | None:
        """Kept CPU workspaces ``(Q₁, Q)`` of :func:`geometry.cholesky_qr2` per factor, in the order of
        :func:`geometry.frames`, for batched float32 ``compute_dtype`` under DP (float64 snapshots, ``κ ≤ 2,896``
        admitted); the frames' ``Q`` stay in them for the step."""
        if not kept_on(snapshots[0][0].device):
            return None
        work = []
        for g, (A, B) in zip(self.groups, snapshots):  # Q₁ in the buffer of the step's draws, free until then
            Q1A, Q1B = self.scratch.pair(f"noise:{g.modules[0]}", A.shape, B.shape, A.device)
            QA, QB = self.scratch.pair(f"frame:{g.modules[0]}", A.shape, B.shape, A.device)
            work += [(Q1A, QA), (Q1B, QB)]
        return work

    def accumulate(self, grads: Mapping[str, Tensor]) -> None:
        """Add one micro-batch (DP: per-example ``[k, *shape]`` grads, clipped by eq. 16; else a sum).

        Sums the clipped factor gradients ``Σ α_i (g_A, g_B)_i``; their lift (eq. 14, linear) is taken
        once per step. The clip norm ``s_i`` is the exact norm of example ``i``'s lift
        (:func:`geometry.gram_lifted_sqnorms`), summed over all modules (eq. 16). The grads are
        converted to the working dtype tile by tile (:meth:`_plans`, :mod:`prism.methods.clipping`), each
        tile's products taken right after its copy; the weighted sum (a second pass: its coefficients
        need every module's norm) reads a side's copy again when the side is one tile, else loads its
        tiles again. The sums are kept in the grads' own layouts (``g_A``, ``g_Bᵀ``).
        """
        if not self._ready:
            raise RuntimeError("call zero_accumulators() before accumulate()")
        for g in self.groups:
            for pair in g.pairs:
                if pair.a_name not in grads or pair.b_name not in grads:
                    raise KeyError(f"no gradient for LoRA module {pair.module}; every trainable LoRA tensor needs one")
                if grads[pair.a_name].ndim != (3 if self.dp else 2):
                    raise ValueError(
                        f"{pair.module}: gradient of shape {tuple(grads[pair.a_name].shape)}; DP needs per-example "
                        "grads [k, *shape] (prism.privacy.per_example), non-DP their micro-batch sum [*shape]"
                    )
        if not self.dp:
            add = torch._foreach_copy_ if self._fresh else torch._foreach_add_
            for g in self.groups:
                add(list(g.sums[0].unbind(0)), [grads[p.a_name] for p in g.pairs])
                add(list(g.sums[1].unbind(0)), [grads[p.b_name] for p in g.pairs])
            self._fresh = False
            return
        k = grads[self.groups[0].pairs[0].a_name].shape[0]
        plans = self._plans(k)
        sq = 0.0
        for g, plan in zip(self.groups, plans):
            products = self._products(g, k)
            for side, tile, buffer, _ in plan:  # each tile's products right after its copy, from cache
                self._tile_products(g, side, tile, self._load(g, side, tile, buffer, grads), products)
            sq = sq + geometry.gram_lifted_sqnorms(*products, *self._whiteners(g)).sum(0)
        norms = sq.sqrt()  # NaN stays NaN: it reaches the update and the loop's finite check
        alpha = (self.privacy.clip_norm / norms).clamp(max=1.0)
        self._norms.append(norms)
        for g, plan in zip(reversed(self.groups), reversed(plans)):  # the latest copies first
            SA, SBt = g.sums
            for side, tile, buffer, shared in reversed(plan):
                if shared:  # the shared tile buffer holds another tile by now
                    buffer = self._load(g, side, tile, buffer, grads)
                S = clipping.select(SA, tile.modules, tile.span) if side == "A" else clipping.select(
                    SBt, tile.modules, tile.span, 2)
                clipping.add_clipped(S, alpha, buffer, self._fresh)
        self._fresh = False

    def _plans(self, k: int) -> list[list[tuple[str, clipping.Tile, Tensor, bool]]]:
        """Per group, its tiles ``(side, tile, buffer, shared)`` (:func:`prism.methods.clipping.plan`, budget ``tile_bytes``,
        by default :func:`prism.methods.scratch.tile_budget` of the device): ``buffer`` is the working-dtype
        slot of the tile's per-example grads, ``[c, k, l, r]`` rows of ``g_A`` or ``[c, k, r, l]`` columns of
        ``g_Bᵀ``; ``shared``: whether the buffer is shared with other tiles.

        A side in one tile (every side off the CPU) has its own slot in one workspace, so its copy is made
        once per micro-batch and read again by the weighted sum (about twice the float32 grads' memory). The
        tiles of a side cut into several share one buffer, so the weighted sum loads them again (the float32
        grads are read twice, as by the factor-space methods, and their float64 copy stays in cache)."""
        device = self.groups[0].frame.A.device
        budget = self.tile_bytes if self.tile_bytes is not None else tile_budget(device)
        width = self.work_dtype.itemsize
        sides = []
        for g in self.groups:
            (G, m, r), n = g.frame.A.shape, g.frame.B.shape[-2]
            sides.append([(side, clipping.plan(G, lines, k * r * width, budget)) for side, lines in (("A", m), ("B", n))])
        own = sum(_numel(tiles[0], k, g.frame.A.shape[-1])
                  for g, group in zip(self.groups, sides) for _, tiles in group if len(tiles) == 1)
        shared = max([_numel(t, k, g.frame.A.shape[-1]) for g, group in zip(self.groups, sides) for _, tiles in group
                      if len(tiles) > 1 for t in tiles], default=0)
        flat = self.scratch.flat("examples", own + shared, device)
        plans, offset = [], 0
        for g, group in zip(self.groups, sides):
            r, plan = g.frame.A.shape[-1], []
            for side, tiles in group:
                for tile in tiles:
                    c, lines = tile.modules.stop - tile.modules.start, tile.span.stop - tile.span.start
                    start = offset if len(tiles) == 1 else own
                    slot = flat[start: start + c * k * lines * r]
                    view = slot.view(c, k, lines, r) if side == "A" else slot.view(c, k, r, lines)
                    plan.append((side, tile, view, len(tiles) > 1))
                if len(tiles) == 1:
                    offset += _numel(tiles[0], k, r)
            plans.append(plan)
        return plans

    def _load(self, g: ShapeGroup, side: str, tile: clipping.Tile, buffer: Tensor,
              grads: Mapping[str, Tensor]) -> Tensor:
        """Copy the tile's per-example grads into its buffer, converting them; returns the buffer."""
        names = [p.a_name if side == "A" else p.b_name for p in g.pairs[tile.modules]]
        sources = [clipping.select(grads[name], None, tile.span, 1 if side == "A" else 2) for name in names]
        torch._foreach_copy_(list(buffer.unbind(0)), sources)
        return buffer

    def _products(self, g: ShapeGroup, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The group's ``r×r`` products ``P_A``, ``K_A``, ``P_B``, ``K_B`` ``[G, k, r, r]``, as (transposed) views
        of the buffers :meth:`_tile_products` writes."""
        G, r = len(g.pairs), g.frame.A.shape[-1]
        PA, KA, PB, KBt = torch.empty(4, G, k, r, r, dtype=self.work_dtype, device=g.frame.A.device).unbind(0)
        KA = KA.view(k, G, r, r).transpose(0, 1)  # example-major: each example's slice is contiguous
        return PA, KA, PB, KBt.mT

    def _tile_products(self, g: ShapeGroup, side: str, tile: clipping.Tile, buffer: Tensor,
                       products: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
        """Add one tile's products of :func:`geometry.gram_lifted_sqnorms` (eqs. 15–16) into the group's.
        With ``compute_dtype: float64`` (κ up to 1/√eps64) the gradients are whitened first, so the products
        carry no κ² amplification."""
        fr, j = g.frame, tile.modules
        PA, KA, PB, KB = (clipping.select(x, j) for x in products)
        if side == "A":
            X = buffer @ clipping.select(fr.RBi, j)[:, None] if self.dtype == torch.float64 else buffer
            clipping.products_a(X, clipping.select(fr.QA, j, tile.span), PA, KA, tile.first)
        else:
            Y = clipping.select(fr.RAi, j).mT[:, None] @ buffer if self.dtype == torch.float64 else buffer
            clipping.products_b(Y, clipping.select(fr.QB, j, tile.span), PB, KB.mT, tile.first)

    def _whiteners(self, g: ShapeGroup) -> tuple[Tensor, Tensor]:
        """``W_A = R_B⁻¹``, ``W_B = R_A⁻¹`` of :func:`geometry.gram_lifted_sqnorms`, broadcast over the examples (the
        identity when :meth:`_tile_products` whitened the gradients)."""
        fr = g.frame
        if self.dtype == torch.float64:
            eye = torch.eye(fr.A.shape[-1], dtype=fr.A.dtype, device=fr.A.device)
            return eye, eye
        return fr.RBi[:, None], fr.RAi[:, None]

    def privatized_group(
        self, g: ShapeGroup, denominator: float, generator: torch.Generator | None, diagnostics: bool = True,
        workspace: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Eq. 17 for one group: ``(Δ̄A, Δ̄B) + τ(Ξ_A, Ξ_B)``, ``τ = σC/denominator``, and ``Σ‖N_Z‖²_F`` (eq. 21).

        The unit sampler of eq. 19 is scaled by exactly ``τ`` (damped only with ``noise_damping``). Under DP (and with
        ``horizontalize: both``) the result is horizontalised, so its factor components are a
        function of the noised tangent vector and the public ``(A, B)`` only. Non-DP: ``τ = 0``.
        The noise energy (a device tensor) is computed only with ``diagnostics``. A float64 frame
        (always under DP) takes the fused :func:`geometry.privatized_lift` (with ``N⁻¹``, ``M⁻¹`` formed
        once when ``compute_dtype`` is float32, whose rank check bounds ``κ``); ``workspace`` (the
        step's call) puts the draws and the result in kept CPU buffers, overwritten by the next step.
        """
        fr = g.frame
        SA, SBt = g.sums
        if self._fresh:  # no micro-batch this step (an empty Poisson batch): the sums are zero
            SA.zero_(), SBt.zero_()
        tau = self.tau(denominator)
        noise_sq = SA.new_zeros(()) if diagnostics else None
        if fr.A.dtype == torch.float64 and self.config.pinv_rcond is None and self.config.noise_damping is None:
            omega = self._draw(g, generator, workspace) if tau > 0 else None
            out, tiles = None, [None]
            if workspace:
                flat = self.scratch.flat(f"lift:{g.modules[0]}", SA.numel() + SBt.numel(), SA.device)
                out = (flat[: SA.numel()].view(SA.shape), flat[SA.numel():].view(SBt.mT.shape))
                tiles = self._step_tiles(g)
            for j in tiles:  # each module's lift is its own: tile by tile (the draws stay one stream)
                dA, dB = geometry.privatized_lift(_part(fr, j), _part(SA, j), _part(SBt, j).mT, 1.0 / denominator, tau,
                                                  _part(omega, j), self.horizontal_lift,
                                                  gram_inverse=self.dtype == torch.float32, out=_part(out, j))
            dA, dB = (dA, dB) if out is None else out
            if diagnostics and omega is not None:
                noise_sq = tau**2 * geometry.tangent_noise_sqnorm(fr, *omega).sum()
            return dA, dB, noise_sq
        dA, dB = geometry.lift(fr.A, fr.B, SA, SBt.mT, frame=fr, rcond=self.config.pinv_rcond)
        dA, dB = dA.div_(denominator), dB.div_(denominator)  # the lift is linear; its outputs are fresh tensors
        if tau > 0:
            XiA, XiB = geometry.tangent_noise(fr.A, fr.B, generator=generator, frame=fr,
                                              damping=self.config.noise_damping)
            if diagnostics:
                noise_sq = tau**2 * geometry.intrinsic_sqnorm(fr.A, fr.B, XiA, XiB, frame=fr).sum()
            dA, dB = dA.add_(XiA, alpha=tau), dB.add_(XiB, alpha=tau)
        if self.horizontal_lift:
            dA, dB = geometry.horizontalize(fr.A, fr.B, dA, dB, frame=fr)
        return dA, dB, noise_sq

    def _draw(self, g: ShapeGroup, generator: torch.Generator | None, workspace: bool) -> tuple[Tensor, Tensor]:
        """The unit draws ``(Ω_A, Ω_B)`` of :func:`geometry.tangent_noise` for the group's frame (same stream),
        in kept buffers with ``workspace``."""
        fr = g.frame
        chunk = math.inf if self.tile_bytes == math.inf else geometry.NORMAL_CHUNK  # whole groups: one pass
        if not workspace:
            return tuple(geometry.standard_normal(X.shape, generator, X.dtype, X.device, chunk=chunk)
                         for X in (fr.A, fr.B))
        sizes = [2 * ((X.numel() + 1) // 2) for X in (fr.A, fr.B)]
        flat = self.scratch.flat(f"noise:{g.modules[0]}", sum(sizes), fr.A.device)
        scratch = self.scratch.flat("draws", max(sizes), fr.A.device)
        return tuple(geometry.standard_normal(X.shape, generator, X.dtype, X.device, workspace=(part, scratch),
                                              chunk=chunk) for X, part in zip((fr.A, fr.B), flat.split(sizes)))

    def privatized_lifts(
        self, denominator: float, generator: torch.Generator | None
    ) -> tuple[dict[str, tuple[Tensor, Tensor]], Tensor]:
        """Per module the privatised lift of :meth:`privatized_group`, and ``‖N_Z‖_F`` over all modules."""
        self._check_denominator(denominator)
        out, noise_sq = {}, torch.zeros((), dtype=self.work_dtype)
        for g in self.groups:
            dA, dB, sq = self.privatized_group(g, denominator, generator)
            out.update({module: (a, b) for module, a, b in zip(g.modules, dA, dB)})
            if sq is not None:
                noise_sq = noise_sq.to(sq.device) + sq
        return out, noise_sq.sqrt()

    @torch.no_grad()
    def step(self, denominator: float, generator: torch.Generator | None, diagnostics: bool = True) -> dict[str, Tensor]:
        """Privatise and horizontalise (eq. 17), adapt (eqs. 24–26), retract (eq. 22), write back.

        Runs stage by stage over all groups, so each ``eigh``/SVD is one call for every group
        (:func:`geometry.fused`). Returns 0-dim device tensors; ``noise_norm`` and ``update_norm``
        only with ``diagnostics``.
        """
        self._check_denominator(denominator)
        tau, h, cfg = self.tau(denominator), self.config.horizontalize, self.config.adaptive
        moments = horizontal_noise_second_moments if self.horizontal_lift else noise_second_moments
        noise_sq, lifts = [], []
        for g in self.groups:
            dA, dB, sq = self.privatized_group(g, denominator, generator, diagnostics, workspace=True)
            if sq is not None:
                noise_sq.append(sq)
            lifts.append(self._cast(f"lift32:{g.modules[0]}", dA, dB))
        if cfg.preconditioner == "none":
            directions = lifts
        else:  # eqs. 24–26: one eigh for the rank-space moments of every factor of every group
            estimates = [e for g, (dA, dB) in zip(self.groups, lifts) for e in g.adaptive.observe(
                dA, dB, tau, *(x.to(self.dtype) for x in moments(g.frame)),
                out=self.scratch.pair(f"moment:{g.modules[0]}", dA.shape, dB.shape, dA.device, dA.dtype))]
            eighs = self._fused(torch.linalg.eigh, [_finite_or_zero(symmetric_part(V)) for _, V, _ in estimates])
            # U into the cast lifts' buffers, read by now (never into privatized_group's outputs: callers may hold them)
            outs = [x if self.dtype != self.work_dtype and kept_on(x.device) else None for pair in lifts for x in pair]
            U = [(m_hat, spectral_preconditioner(cfg, w, E, floor), out)
                 for (m_hat, _, floor), (w, E), out in zip(estimates, eighs, outs)]
            directions = list(zip(U[0::2], U[1::2]))
        new = self._retract(directions, horizontal=h in ("both", "pre_retract"))
        update_sq = []
        for g, (A_new, B_new) in zip(self.groups, new):
            if diagnostics:
                update_sq.append(_product_sqdist(g.frame.A, g.frame.B, A_new, B_new).sum())
            self._write(g, A_new, B_new)
        stats: dict[str, Tensor] = {}
        if diagnostics:
            stats["update_norm"] = torch.stack(update_sq).sum().sqrt()
            if self.dp:
                stats["noise_norm"] = torch.stack(noise_sq).sum().sqrt()
        if self._norms:
            norms = torch.cat(self._norms)
            stats["clip_fraction"] = (norms > self.privacy.clip_norm).double().mean()
            stats["grad_norm_mean"] = norms.mean()
        for g in self.groups:
            g.frame, g.sums = None, None
        self._ready = False
        return stats

    def _retract(self, directions: list[tuple[Tensor | tuple[Tensor, Tensor, Tensor | None], ...]], horizontal: bool
                 ) -> list[tuple[Tensor, Tensor]]:
        """:func:`geometry.retract` (aligned; of the horizontalised directions with ``horizontal``) of every
        group, each of its two SVDs fused over the groups.

        ``directions``: per group and factor the direction ``U`` or ``(m̂, P, out)`` for ``U = m̂P`` (eq. 25, into
        ``out``). With kept CPU buffers and a float64 frame the stage before the first SVD runs tile by tile
        (:meth:`_step_tiles`): ``U``, its copy in the working dtype and the retraction's QR extensions and core
        (:meth:`_direction`, :func:`geometry.retraction_core`), the tile's ``U`` and ``Y`` in tile-sized buffers
        that stay in cache; only the new blocks ``Q₂`` go to the group's buffers."""
        cores = []
        for g, direction in zip(self.groups, directions):
            fr = g.frame
            tiles = self._step_tiles(g) if self._kept_frame(g) else [None]
            parts = []
            for j in tiles:
                UA, UB = self._direction(g, direction, j)
                parts.append(geometry.retraction_core(_part(fr.A, j), _part(fr.B, j), UA, UB, self.config.lr,
                                                      frame=_part(fr, j), horizontal=horizontal,
                                                      work=self._extension_work(g, (UA, UB), j)))
            if len(parts) > 1:  # the new blocks Q₂ were written into slices of the group's buffers
                QA2, QB2 = self._new_blocks(g)
                parts = [geometry.joined_retractions(parts, (fr.QA, QA2), (fr.QB, QB2))]
            cores.append(parts[0])
        svds = self._fused(torch.linalg.svd, [_finite_or_zero(rt.core) for rt in cores])
        coefficients = [geometry.balanced_coefficients(svd, g.frame.A.shape[-1]) for g, svd in zip(self.groups, svds)]
        targets = [geometry.procrustes_target(rt, MA, MB) for rt, (MA, MB) in zip(cores, coefficients)]
        rotations = self._fused(torch.linalg.svd, [_finite_or_zero(t) for t in targets])
        out = []
        for g, rt, (MA, MB), Q in zip(self.groups, cores, coefficients,
                                      (geometry.procrustes_rotation(svd) for svd in rotations)):
            A, B = None, None  # a float32 frame (non-DP float32): the float64 product, then rounded
            if MA.dtype == self.work_dtype:  # into the directions' buffer (consumed as extend_qr's Y by now)
                A, B = self.scratch.pair(f"direction:{g.modules[0]}", g.frame.A.shape, g.frame.B.shape, MA.device)
            new = geometry.block_product(rt.Qu, MA @ Q, out=A), geometry.block_product(rt.Qv, MB @ Q, out=B)
            out.append(tuple(x.to(self.work_dtype) for x in new))
        return out

    def _direction(self, g: ShapeGroup, direction: tuple[Tensor | tuple[Tensor, Tensor, Tensor | None], ...],
                   j: slice | None) -> tuple[Tensor, Tensor]:
        """Modules ``j`` of the group's direction (see :meth:`_retract`) in the working dtype (:meth:`_in_work_dtype`);
        a tile's ``U = m̂P`` goes to a kept tile-sized buffer instead of ``out``."""
        products = not isinstance(direction[0], Tensor)
        if products and j is not None and direction[0][2] is not None:
            outs = self.scratch.pair("U tile", direction[0][0][j].shape, direction[1][0][j].shape,
                                     g.frame.A.device, self.dtype)
        else:
            outs = [_part(X[2], j) if products else None for X in direction]
        U = tuple(torch.matmul(_part(X[0], j), _part(X[1], j), out=out) if products else _part(X, j)
                  for X, out in zip(direction, outs))
        return self._in_work_dtype(g, U, j)

    def _step_tiles(self, g: ShapeGroup) -> list[slice | None]:
        """Consecutive slices of the group's modules over which a stage of the step runs its factor-sized passes in
        turn: as many modules per tile as :func:`prism.methods.scratch.tile_count` fits float64 copies of their
        factors in ``tile_bytes`` (each tensor of the stage holds that much per tile); ``[None]`` (the whole group,
        no slicing) when one tile holds them all (always off the CPU, and with ``tile_bytes=math.inf``)."""
        a, b = self.params[g.pairs[0].a_name], self.params[g.pairs[0].b_name]
        G = len(g.pairs)
        c = tile_count(a.device, (a.numel() + b.numel()) * 8, G, self.tile_bytes)
        return [None] if c >= G else [slice(start, min(start + c, G)) for start in range(0, G, c)]

    def _kept_frame(self, g: ShapeGroup) -> bool:
        """Whether the group's step runs in kept CPU buffers with a float64 frame (:func:`geometry.extend_qr`'s path)."""
        return kept_on(g.frame.A.device) and g.frame.A.dtype == self.work_dtype == torch.float64

    def _new_blocks(self, g: ShapeGroup) -> tuple[Tensor, Tensor]:
        """The kept buffers of the retraction's new blocks ``Q₂`` of the group's two factors (those of its draws, read
        by :meth:`privatized_group` before)."""
        return self.scratch.pair(f"noise:{g.modules[0]}", g.frame.A.shape, g.frame.B.shape, g.frame.A.device)

    def _extension_work(self, g: ShapeGroup, direction: tuple[Tensor, Tensor], j: slice | None
                        ) -> tuple[tuple[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]] | None:
        """Kept CPU workspaces of :func:`geometry.extend_qr` for the two factors of the group's modules ``j``: ``Y``
        is the direction itself (:meth:`_in_work_dtype`'s buffer, consumed), ``Q₁`` is shared by all groups and
        tiles (read right away; the draws' scratch), ``Q₂`` is per group (read by the block product;
        :meth:`_new_blocks`)."""
        if not self._kept_frame(g):
            return None
        scratch = self.scratch.flat("draws", max(X.numel() for h in self.groups for X in (h.frame.A, h.frame.B)),
                                    g.frame.A.device)
        return tuple((U, scratch[: U.numel()].view(U.shape), _part(Q2, j))
                     for U, Q2 in zip(direction, self._new_blocks(g)))

    def _cast(self, name: str, A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
        """``(A, B)`` in ``compute_dtype`` (the adaptive moments' dtype), on the CPU in the kept buffer ``name``."""
        if A.dtype == self.dtype:
            return A, B
        out = self.scratch.pair(name, A.shape, B.shape, A.device, self.dtype)
        return out[0].copy_(A), out[1].copy_(B)

    def _in_work_dtype(self, g: ShapeGroup, U: tuple[Tensor, Tensor], j: slice | None) -> tuple[Tensor, Tensor]:
        """The direction ``(U_A, U_B)`` of the group's modules ``j`` converted to the working dtype, on the CPU into
        the group's kept buffer, or for a tile (``j`` not ``None``) a kept tile-sized one, where
        :func:`geometry.extend_qr` turns it into its ``Y``."""
        if not kept_on(U[0].device) or self.work_dtype != torch.float64:  # float32: the frame is too (no extend_qr)
            return tuple(x.to(self.work_dtype) for x in U)
        if j is not None:
            A, B = self.scratch.pair("direction tile", U[0].shape, U[1].shape, U[0].device)
            return A.copy_(U[0]), B.copy_(U[1])
        A, B = self.scratch.pair(f"direction:{g.modules[0]}", g.frame.A.shape, g.frame.B.shape, U[0].device)
        return A.copy_(U[0]), B.copy_(U[1])

    def tau(self, denominator: float) -> float:
        """Noise standard deviation ``σC/denominator`` of the averaged lift (0 without DP)."""
        return 0.0 if self.privacy is None else self.privacy.sigma * self.privacy.clip_norm / denominator

    @property
    def example_norms(self) -> Tensor:
        """Intrinsic per-example norms ``s_i`` (eq. 16) accumulated so far in this logical step."""
        return torch.cat(self._norms) if self._norms else torch.zeros(0, dtype=self.work_dtype)

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
    @torch.no_grad()
    def _snapshot(self, g: ShapeGroup) -> tuple[Tensor, Tensor]:
        """The group's ``(A, B)`` stacked ``[G, m, r]``, ``[G, n, r]``: rounded to ``compute_dtype``, held in the working dtype.

        Parameters that ``compute_dtype`` holds exactly (e.g. float32 or bf16 for float32) are copied straight
        into the working dtype (the same values, one pass), on the CPU into a kept buffer that the next
        snapshot overwrites (a frame lives for one step)."""
        names = [name for p in g.pairs for name in (p.a_name, p.b_name)]
        if any(not self.params[name].is_floating_point()
               or torch.finfo(self.params[name].dtype).bits > torch.finfo(self.dtype).bits for name in names):
            return tuple(x.to(self.work_dtype) for x in stack_pairs(self.params, g.pairs, self.dtype))
        G, (m, r), n = len(g.pairs), self.params[names[0]].shape, self.params[names[1]].shape[-1]
        flat = self.scratch.flat(f"snapshot:{g.modules[0]}", G * (m + n) * r, self.params[names[0]].device)
        A, Bt = flat[: G * m * r].view(G, m, r), flat[G * m * r:].view(G, r, n)
        torch._foreach_copy_(list(A.unbind(0)), [self.params[p.a_name] for p in g.pairs])
        torch._foreach_copy_(list(Bt.unbind(0)), [self.params[p.b_name] for p in g.pairs])
        return A, Bt.mT

    def _check_rank(self, cholesky: bool = False) -> None:
        """:func:`geometry.check_frames` with the cutoff of ``compute_dtype`` (frames may be float64; ``cholesky``:
        CholeskyQR2 frames, whose NaN ``R`` marks a non-finite factor)."""
        geometry.check_frames([g.frame for g in self.groups], [g.modules for g in self.groups],
                              geometry.default_rcond(self.dtype), nan_R=cholesky)

    @torch.no_grad()
    def _write(self, g: ShapeGroup, A: Tensor, B: Tensor) -> None:
        """Copy the group's new factors into the peft parameters (one fused copy per factor)."""
        torch._foreach_copy_([self.params[p.a_name] for p in g.pairs], list(A.unbind(0)))
        torch._foreach_copy_([self.params[p.b_name] for p in g.pairs], list(B.mT.unbind(0)))

    def _check_denominator(self, denominator: float) -> None:
        if not self._ready:
            raise RuntimeError("call zero_accumulators() before step()")
        if not denominator > 0:
            raise ValueError(f"denominator={denominator} must be positive (skip empty Poisson batches)")

    def _floor_rank_deficient(self) -> None:
        """The logged ``rank_fallback: floor`` repair of every rank-deficient module, then re-check."""
        rcond = 10.0 * geometry.default_rcond(self.dtype)
        for g in self.groups:
            for pair, A, B in zip(g.pairs, g.frame.A, g.frame.B):
                try:
                    geometry.check_full_rank(A, B, pair.module, geometry.default_rcond(self.dtype))
                    continue
                except geometry.RankDeficientError:
                    pass
                A, B, raised = floor_spectrum(A, B, rcond)
                log.warning("rank_fallback=floor: %s had %d singular value(s) of ABᵀ raised to %.1e·σ_max",
                            pair.module, raised, rcond)
                write_pair(self.params, pair, A, B)
            g.frame = geometry.frame(*self._snapshot(g))
        self._check_rank()


def _numel(tile: clipping.Tile, k: int, r: int) -> int:
    """Elements of a tile's buffer (``k`` examples of ``r`` columns per line)."""
    return (tile.modules.stop - tile.modules.start) * k * (tile.span.stop - tile.span.start) * r


def _one_by_one(fn: Callable[[Tensor], Any], batches: list[Tensor]) -> list[tuple[Tensor, ...]]:
    """The reference path's :func:`geometry.fused`: one call of ``fn`` per batch."""
    return [tuple(fn(X)) for X in batches]


def _part(x: Any, j: slice | None) -> Any:
    """Modules ``j`` of a group's batched tensor, frame or tuple of tensors (``None``: all of it, no op)."""
    if j is None or x is None:
        return x
    if isinstance(x, geometry.Frame):
        return geometry.frame_part(x, j)
    return tuple(_part(y, j) for y in x) if isinstance(x, tuple) else x[j]


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
