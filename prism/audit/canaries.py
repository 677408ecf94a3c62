"""White-box gradient canaries for a one-run audit of a whole training run (:mod:`prism.audit.one_run`).

Each of ``m`` canaries is a fixed rank-1 direction ``d_c = u vᵀ`` in the space where the method clips,
supported on one block (one LoRA tensor, or one module for PRISM) and scaled so its norm there is ``2C``
(≥ C, so its clipped contribution is exactly the clip norm):

* ``factor`` (the factor-space baselines, eq. 3): the flat vector of the trainable LoRA tensors; on a
  tensor ``W`` ``[a, b]`` the direction is ``u vᵀ``, zero on every other tensor;
* ``tangent`` (PRISM, eqs. 13–16): on a module the ambient matrix ``G = u vᵀ`` (``u`` ``[m]``, ``v`` ``[n]``);
  the canary's per-example factor gradients at the step's factors are ``(G B, Aᵀ G)`` (the chain rule for
  a loss whose gradient in ``Z = A Bᵀ`` is ``G``), whose lift is ``P_{A,B}(G)`` (eq. 14, Lemma A.14), of
  intrinsic norm ``‖P_{A,B}(G)‖_F``.

On a block of shape ``[a, b]`` the directions are cells of a random orthonormal basis: ``u = Q_a e_i``,
``v = Q_b e_j`` with ``Q_a``, ``Q_b`` random orthogonal matrices and distinct cells ``(i, j)`` per canary,
so two canaries are exactly orthogonal (``⟨u_i v_jᵀ, u_k v_lᵀ⟩ = δ_ik δ_jl``; on different blocks too):
one canary's hits put nothing on another's score in the factor space, and in the tangent space only
through canaries that share ``i`` or ``j`` (independent random directions would each add about ``1/√(ab)``
of every hit on the block, docs/MEASUREMENTS.md, 2026-12-03). The rotation spreads every direction over
the block, so the real examples' gradients project on it as on a random direction; a canary costs the
``a + b`` numbers of its ``u`` and ``v``, so 10⁴–10⁵ of them are projected every step. A secret fair coin
includes each canary; an included canary joins each step's batch with the Poisson sampler's rate ``q``,
independently of the real records, and its gradient goes through the method's own ``accumulate`` (in
chunks of :data:`CHUNK`) with the real micro-batches, so it is clipped, summed and noised by the same code.

Score of canary ``c`` at step ``t``: ``⟨R_t, d_c(t)⟩ / ‖d_c(t)‖``, ``R_t`` the released privatised quantity
of step ``t`` in the clipping space's inner product: for ``factor``, the noised factor gradient
(``⟨R, u vᵀ⟩ = uᵀ R v``); for ``tangent``, the noised tangent vector ``ΔZ = ΔA Bᵀ + A ΔBᵀ`` at the factors
the step started from (public), ``⟨ΔZ, P(G)⟩ = ⟨ΔZ, u vᵀ⟩ = (uᵀΔA)(Bᵀv) + (uᵀA)(ΔBᵀv)``. For a correct
mechanism it is ``C/B`` if the canary was sampled at step ``t``, plus ``N(0, (σC/B)²)`` and the projections
of the real examples (and, for ``tangent``, the small ones of canaries sharing ``i`` or ``j``);
:class:`CanaryMethod` sums the steps or filters them (:func:`~prism.audit.one_run.filtered_scores`).

The released quantity is the :class:`~prism.methods.base.Release` of the method's ``add_noise`` (the
DP boundary, docs/DECISIONS.md D71): its tensors are keyed and shaped like the parameters.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from prism.audit.one_run import filtered_scores
from prism.mechanism.lora import lora_pairs, read_pair
from prism.methods.base import Method, Release
from prism.privacy.noise import NoiseSource

Space = Literal["factor", "tangent"]
CANARY_NORM = 2.0  # canary norm in units of C: ≥ 1, so clipping always scales it to exactly C
CHUNK = 64  # canaries per accumulate call: bounds the per-example gradients held at once


@dataclass(frozen=True)
class CanaryDirections:
    """``m`` rank-1 directions, each supported on one block (float64): canary ``c`` is row ``slot[c]`` of
    ``left[key]`` ``[m_key, a]`` (``uᵀ``) and ``right[key]`` ``[m_key, b]`` (``vᵀ``), ``key = keys[block[c]]``,
    a trainable tensor ``W`` ``[a, b]`` (``factor``) or a module with ``u`` ``[rows of A]``, ``v`` ``[rows of B]``
    (``tangent``)."""

    space: Space
    keys: tuple[str, ...]
    block: Tensor  # [m] index into keys
    slot: Tensor  # [m] row within the block's arrays
    left: dict[str, Tensor]
    right: dict[str, Tensor]

    @property
    def count(self) -> int:
        return len(self.block)

    def members(self, key: str) -> Tensor:
        """Canary ids on block ``key``, in the order of its rows."""
        return torch.nonzero(self.block == self.keys.index(key)).squeeze(1)


def draw_directions(space: Space, params: Mapping[str, Tensor], count: int, seed: int) -> CanaryDirections:
    """Orthonormal-basis directions (module docstring) for ``count`` canaries over ``params`` (the method's
    trainable parameters): blocks in order, each taking an equal share of the canaries not yet placed, at
    most its ``a·b`` cells, drawn without replacement."""
    if count < 2:
        raise ValueError(f"need at least 2 canaries (got {count})")
    g = torch.Generator().manual_seed(seed)
    if space == "factor":
        for name, p in params.items():
            if p.dim() != 2:
                raise ValueError(f"{name}: factor canaries need 2-D LoRA tensors, got shape {tuple(p.shape)}")
        shapes = {name: (p.shape[0], p.shape[1]) for name, p in params.items()}
    elif space == "tangent":  # u on A's rows, v on B's
        shapes = {pair.module: tuple(x.shape[0] for x in read_pair(params, pair)) for pair in _pairs(params)}
    else:
        raise ValueError(f"unknown canary space {space!r}; choose factor or tangent")
    if count > sum(a * b for a, b in shapes.values()):
        raise ValueError(f"{count} canaries: at most {sum(a * b for a, b in shapes.values())} orthogonal ones fit")
    keys = tuple(sorted(shapes, key=lambda k: shapes[k][0] * shapes[k][1]))  # the smallest blocks fill first
    counts, left, right = [], {}, {}
    for i, key in enumerate(keys):
        a, b = shapes[key]
        counts.append(min(a * b, -(-(count - sum(counts)) // (len(keys) - i))))
        cells = torch.randperm(a * b, generator=g)[:counts[-1]]
        left[key] = _orthogonal(a, g)[:, cells // b].T.contiguous()
        right[key] = _orthogonal(b, g)[:, cells % b].T.contiguous()
    block = torch.repeat_interleave(torch.arange(len(keys)), torch.tensor(counts))
    slot = torch.cat([torch.arange(n) for n in counts])
    return CanaryDirections(space, keys, block, slot, left, right)


def _orthogonal(n: int, g: torch.Generator) -> Tensor:
    """A random orthogonal ``[n, n]`` matrix (float64): the Q factor of a standard normal one."""
    return torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64)).Q


def _pairs(params: Mapping[str, Tensor]) -> list:
    pairs = lora_pairs(params)
    if not pairs:
        raise ValueError("tangent canaries need LoRA factor pairs (peft lora_A/lora_B names)")
    return pairs


def _factors(params: Mapping[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """Paper ``(A, B)`` per module, float64 copies (public: the parameters before the step)."""
    return {pair.module: tuple(x.detach().double() for x in read_pair(params, pair)) for pair in _pairs(params)}


def _by_block(d: CanaryDirections, ids: Tensor) -> list[tuple[str, Tensor, Tensor]]:
    """``(key, positions in ids, rows of the block's arrays)`` for every block with canaries among ``ids``."""
    out = []
    for i, key in enumerate(d.keys):
        pos = torch.nonzero(d.block[ids] == i).squeeze(1)
        if len(pos):
            out.append((key, pos, d.slot[ids[pos]]))
    return out


def sqnorms(d: CanaryDirections, params: Mapping[str, Tensor], ids: Tensor | None = None) -> Tensor:
    """Squared norms ``[len(ids)]`` of the canaries' directions in the clipping space (all canaries if None):
    ``‖x‖²‖y‖²`` (``factor``) or ``‖P_{A,B}(u vᵀ)‖²_F = ‖u‖²‖v‖² − ‖(I − Π_A)u‖²‖(I − Π_B)v‖²`` (``tangent``,
    eq. 13: ``G − P(G) = (I − Π_A) G (I − Π_B)``) at the factors of ``params``."""
    ids = torch.arange(d.count) if ids is None else ids
    total = torch.zeros(len(ids), dtype=torch.float64)
    factors = _factors(params) if d.space == "tangent" else None
    for key, pos, rows in _by_block(d, ids):
        X, Y = d.left[key][rows], d.right[key][rows]
        xx, yy = X.square().sum(1), Y.square().sum(1)
        if factors is None:
            total[pos] = xx * yy
            continue
        A, B = factors[key]
        QA, QB = torch.linalg.qr(A).Q, torch.linalg.qr(B).Q
        total[pos] = xx * yy - (xx - (X @ QA).square().sum(1)) * (yy - (Y @ QB).square().sum(1))
    return total


def gradients(d: CanaryDirections, params: Mapping[str, Tensor], ids: Tensor, clip_norm: float,
              per_example: bool) -> dict[str, Tensor]:
    """Per-example gradients ``[k, *shape]`` of canaries ``ids`` (their sum ``[*shape]`` if not
    ``per_example``), each of norm ``CANARY_NORM · C`` in the clipping space, in the parameters' dtypes."""
    scale = CANARY_NORM * clip_norm / sqnorms(d, params, ids).sqrt()  # [k]
    out = {n: torch.zeros(len(ids), *p.shape, dtype=p.dtype) for n, p in params.items()}
    factors = _factors(params) if d.space == "tangent" else None
    pairs = {pair.module: pair for pair in _pairs(params)} if factors is not None else {}
    for key, pos, rows in _by_block(d, ids):
        X, Y = d.left[key][rows] * scale[pos, None], d.right[key][rows]
        if factors is None:
            out[key][pos] = _outer(X, Y, out[key].dtype)
            continue
        A, B = factors[key]
        pair = pairs[key]
        out[pair.a_name][pos] = _outer(X, Y @ B, out[pair.a_name].dtype)  # G B = u (vᵀB)       [k, m, r]
        out[pair.b_name][pos] = _outer(X @ A, Y, out[pair.b_name].dtype)  # (AᵀG) = (Aᵀu) vᵀ   [k, r, n]
    return {n: (g if per_example else g.sum(0)).to(p.device) for (n, g), p in zip(out.items(), params.values())}


def _outer(X: Tensor, Y: Tensor, dtype: torch.dtype) -> Tensor:
    """Row-wise outer products ``[k, a, b]`` of ``X`` ``[k, a]`` and ``Y`` ``[k, b]`` in ``dtype``."""
    return X.to(dtype)[:, :, None] * Y.to(dtype)[:, None, :]


def project(d: CanaryDirections, release: Mapping[str, Tensor], params_before: Mapping[str, Tensor]) -> Tensor:
    """``⟨R, d_c⟩ / ‖d_c‖`` for every canary ``[m]`` (module docstring) of one step's ``release`` keyed like the
    parameters, ``params_before`` the parameters the step started from: ``⟨R, u vᵀ⟩ = uᵀ R v`` for ``factor``;
    for ``tangent`` in factored form, ``⟨ΔZ, u vᵀ⟩ = (uᵀΔA)(Bᵀv) + (uᵀA)(ΔBᵀv)``, without forming ``ΔZ``."""
    inner = torch.zeros(d.count, dtype=torch.float64)
    if d.space == "factor":
        for key in d.keys:
            inner[d.members(key)] = ((d.left[key] @ release[key].detach().double().cpu()) * d.right[key]).sum(1)
        return inner / sqnorms(d, params_before).sqrt()
    factors = _factors(params_before)
    for pair in _pairs(params_before):
        A, B = factors[pair.module]
        dA, dB = (x.detach().double().cpu() for x in read_pair(release, pair))
        r = A.shape[1]
        UA, VB = d.left[pair.module] @ torch.cat([dA, A], 1), d.right[pair.module] @ torch.cat([B, dB], 1)
        inner[d.members(pair.module)] = (UA[:, :r] * VB[:, :r]).sum(1) + (UA[:, r:] * VB[:, r:]).sum(1)
    return inner / sqnorms(d, params_before).sqrt()


class CanaryMethod(Method):
    """``inner`` with canaries: ``add_noise`` accumulates the canaries sampled this step through
    ``inner.accumulate`` (the real examples' path) and releases ``inner``'s step; ``update`` projects that
    :class:`~prism.methods.base.Release` (the factor methods' noised gradient; PRISM's noised, horizontalised
    lift of eq. 17 as ``ΔZ`` at the step's starting factors) on every canary (:func:`project`) into
    :attr:`trace`, then applies ``inner``'s update. :attr:`scores`: their sum over steps or, with ``filtered``,
    :func:`~prism.audit.one_run.filtered_scores` (any score that never sees the coins gives a valid audit)."""

    def __init__(self, inner: Method, directions: CanaryDirections, included: np.ndarray, sample_rate: float,
                 seed: int, filtered: bool = False) -> None:
        super().__init__(inner.params, inner.privacy)
        self.inner, self.directions = inner, directions
        self.included = torch.as_tensor(np.flatnonzero(included), dtype=torch.long)
        self.sample_rate = float(sample_rate)
        self.generator = torch.Generator().manual_seed(seed)  # the canaries' own Poisson draws
        self.sampled = torch.zeros(directions.count, dtype=torch.long)
        self.filtered, self.trace = filtered, []  # per-step scores [m] each
        self._before: Mapping[str, Tensor] = self.params

    @property
    def scores(self) -> Tensor:
        """Every canary's score so far ``[m]`` (float64)."""
        if not self.trace:
            return torch.zeros(self.directions.count, dtype=torch.float64)
        trace = torch.stack(self.trace)
        if self.filtered:
            return torch.from_numpy(filtered_scores(trace.numpy(), self.directions.block.numpy()))
        return trace.sum(0)

    def zero_accumulators(self) -> None:
        self.inner.zero_accumulators()

    def accumulate(self, grads: Mapping[str, Tensor]) -> None:
        self.inner.accumulate(grads)

    def add_noise(self, denominator: float, noise: NoiseSource, diagnostics: bool = True) -> Release:
        hit = torch.rand(len(self.included), generator=self.generator, dtype=torch.float64) < self.sample_rate
        ids = self.included[hit]
        clip = self.privacy.clip_norm if self.dp else 1.0
        for chunk in ids.split(CHUNK):
            self.inner.accumulate(gradients(self.directions, self.params, chunk, clip, per_example=self.dp))
        self.sampled[ids] += 1
        tangent = self.directions.space == "tangent"
        self._before = {n: p.detach().clone() for n, p in self.params.items()} if tangent else self.params
        return self.inner.add_noise(denominator, noise, diagnostics)

    def update(self, release: Release, diagnostics: bool = True) -> dict[str, Tensor]:
        self.trace.append(project(self.directions, release.tensors, self._before))
        return self.inner.update(release, diagnostics)

    def clip_stats(self) -> dict[str, Tensor]:
        return self.inner.clip_stats()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state)
