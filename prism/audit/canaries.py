"""White-box gradient canaries for a one-run audit of a whole training run (:mod:`prism.audit.one_run`).

Each of ``m`` canaries is a fixed random direction ``d_c`` in the space where the method clips, scaled so its
norm there is ``2C`` (≥ C, so its clipped contribution is exactly the clip norm):

* ``factor`` (the factor-space baselines, eq. 3): the flat vector of the trainable LoRA tensors; on each
  tensor ``W`` ``[a, b]`` the direction is ``x yᵀ`` with ``x``, ``y`` standard normal;
* ``tangent`` (PRISM, eqs. 13–16): on each module the ambient matrix ``G = u vᵀ`` (``u`` ``[m]``, ``v`` ``[n]``);
  the canary's per-example factor gradients at the step's factors are ``(G B, Aᵀ G)`` (the chain rule for
  a loss whose gradient in ``Z = A Bᵀ`` is ``G``), whose lift is ``P_{A,B}(G)`` (eq. 14, Lemma A.14), of
  intrinsic norm ``‖P_{A,B}(G)‖_F`` summed over modules in quadrature.

Independent rank-1 directions are nearly orthogonal (``⟨x₁y₁ᵀ, x₂y₂ᵀ⟩ = (x₁·x₂)(y₁·y₂)``, of relative
size ``1/√(ab)`` like dense ones) and cost ``a + b`` numbers each to keep, so all ``m`` are projected every
step. A secret fair coin includes each canary; an included canary joins each step's batch with the
Poisson sampler's rate ``q``, independently of the real records (Poisson sampling is per record), and
its gradient goes through the method's own ``accumulate`` with the real micro-batches, so it is clipped,
summed and noised by the same code.

Score of canary ``c``: ``Σ_t ⟨R_t, d_c(t)⟩ / ‖d_c(t)‖`` over steps, ``R_t`` the released privatised quantity
of step ``t`` in the clipping space's inner product: for ``factor``, the noised factor gradient
(``⟨R, x yᵀ⟩ = xᵀ R y``); for ``tangent``, the noised tangent vector ``ΔZ = ΔA Bᵀ + A ΔBᵀ`` at the factors
the step started from (public), ``⟨ΔZ, P(G)⟩ = ⟨ΔZ, u vᵀ⟩ = (uᵀΔA)(Bᵀv) + (uᵀA)(ΔBᵀv)``. For a correct
mechanism a score is ``(C/B)·(number of times sampled) + N(0, T(σC/B)²)`` plus the (small) projections of
the other canaries and the real examples.

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

from prism.mechanism.lora import lora_pairs, read_pair
from prism.methods.base import Method, Release
from prism.privacy.noise import NoiseSource

Space = Literal["factor", "tangent"]
CANARY_NORM = 2.0  # canary norm in units of C: ≥ 1, so clipping always scales it to exactly C


@dataclass(frozen=True)
class CanaryDirections:
    """``m`` rank-1 directions per block: ``left[name]`` ``[m, a]``, ``right[name]`` ``[m, b]`` (float64).

    ``factor``: blocks are the trainable tensors ``W`` ``[a, b]`` (direction ``x yᵀ``). ``tangent``: blocks
    are the modules (keyed by module name), ``u`` ``[m, rows of A]``, ``v`` ``[m, rows of B]``.
    """

    space: Space
    left: dict[str, Tensor]
    right: dict[str, Tensor]

    @property
    def count(self) -> int:
        return next(iter(self.left.values())).shape[0]


def draw_directions(space: Space, params: Mapping[str, Tensor], count: int, seed: int) -> CanaryDirections:
    """Random directions for ``count`` canaries over ``params`` (the method's trainable parameters)."""
    if count < 2:
        raise ValueError(f"need at least 2 canaries (got {count})")
    g = torch.Generator().manual_seed(seed)
    left, right = {}, {}
    if space == "factor":
        for name, p in params.items():
            if p.dim() != 2:
                raise ValueError(f"{name}: factor canaries need 2-D LoRA tensors, got shape {tuple(p.shape)}")
            left[name] = torch.randn(count, p.shape[0], generator=g, dtype=torch.float64)
            right[name] = torch.randn(count, p.shape[1], generator=g, dtype=torch.float64)
    elif space == "tangent":
        for pair in _pairs(params):
            A, B = read_pair(params, pair)
            left[pair.module] = torch.randn(count, A.shape[0], generator=g, dtype=torch.float64)
            right[pair.module] = torch.randn(count, B.shape[0], generator=g, dtype=torch.float64)
    else:
        raise ValueError(f"unknown canary space {space!r}; choose factor or tangent")
    return CanaryDirections(space, left, right)


def _pairs(params: Mapping[str, Tensor]) -> list:
    pairs = lora_pairs(params)
    if not pairs:
        raise ValueError("tangent canaries need LoRA factor pairs (peft lora_A/lora_B names)")
    return pairs


def _factors(params: Mapping[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """Paper ``(A, B)`` per module, float64 copies (public: the parameters before the step)."""
    return {pair.module: tuple(x.detach().double() for x in read_pair(params, pair)) for pair in _pairs(params)}


def sqnorms(d: CanaryDirections, params: Mapping[str, Tensor], ids: Tensor | None = None) -> Tensor:
    """Squared norms of the canaries' directions in the clipping space ``[len(ids)]`` (all canaries if None).

    ``factor``: ``Σ_W ‖x‖²‖y‖²``. ``tangent``: ``Σ_modules ‖P_{A,B}(u vᵀ)‖²_F =
    ‖u‖²‖v‖² − ‖(I − Π_A)u‖²‖(I − Π_B)v‖²`` (eq. 13: ``G − P(G) = (I − Π_A) G (I − Π_B)``).
    """
    total = 0.0
    factors = _factors(params) if d.space == "tangent" else None
    for key, X in d.left.items():
        Y = d.right[key]
        if ids is not None:
            X, Y = X[ids], Y[ids]
        xx, yy = X.square().sum(1), Y.square().sum(1)
        if factors is None:
            total = total + xx * yy
            continue
        A, B = factors[key]
        QA, QB = torch.linalg.qr(A).Q, torch.linalg.qr(B).Q
        total = total + xx * yy - (xx - (X @ QA).square().sum(1)) * (yy - (Y @ QB).square().sum(1))
    return total


def gradients(d: CanaryDirections, params: Mapping[str, Tensor], ids: Tensor, clip_norm: float,
              per_example: bool) -> dict[str, Tensor]:
    """Per-example gradients ``[k, *shape]`` of canaries ``ids`` (their sum ``[*shape]`` if not
    ``per_example``), each of norm ``CANARY_NORM · C`` in the clipping space, in the parameters' dtypes."""
    scale = CANARY_NORM * clip_norm / sqnorms(d, params, ids).sqrt()  # [k]
    out: dict[str, Tensor] = {}
    if d.space == "factor":
        for name, X in d.left.items():
            out[name] = torch.einsum("k,ka,kb->kab", scale, X[ids], d.right[name][ids])
    else:
        factors = _factors(params)
        for pair in _pairs(params):
            A, B = factors[pair.module]
            U, V = d.left[pair.module][ids] * scale[:, None], d.right[pair.module][ids]
            out[pair.a_name] = U[:, :, None] * (V @ B)[:, None, :]  # G B = u (vᵀB)       [k, m, r]
            out[pair.b_name] = (U @ A)[:, :, None] * V[:, None, :]  # (AᵀG) = (Aᵀu) vᵀ   [k, r, n]
    ref = {n: p for n, p in params.items()}
    return {n: (g if per_example else g.sum(0)).to(ref[n].dtype).to(ref[n].device) for n, g in out.items()
            if n in ref}


def project(d: CanaryDirections, release: Mapping[str, Tensor], params_before: Mapping[str, Tensor]) -> Tensor:
    """``⟨R, d_c⟩ / ‖d_c‖`` for every canary ``[m]`` (module docstring), float64.

    ``release``: the step's privatised quantity keyed like the parameters (``factor``: the noised factor
    gradient; ``tangent``: the noised lift, ``ΔA`` under peft ``lora_B``'s name and ``ΔBᵀ`` under ``lora_A``'s),
    ``params_before``: the parameters the step started from.
    """
    inner = 0.0
    if d.space == "factor":
        for name, X in d.left.items():
            R = release[name].detach().double().cpu()
            inner = inner + ((X @ R) * d.right[name]).sum(1)
    else:
        factors = _factors(params_before)
        for pair in _pairs(params_before):
            A, B = factors[pair.module]
            dA, dB = (x.detach().double().cpu() for x in read_pair(release, pair))
            U, V = d.left[pair.module], d.right[pair.module]
            inner = inner + ((U @ dA) * (V @ B)).sum(1) + ((U @ A) * (V @ dB)).sum(1)
    return inner / sqnorms(d, params_before).sqrt()


class CanaryMethod(Method):
    """``inner`` with canaries: ``add_noise`` first accumulates the canaries sampled this step through
    ``inner.accumulate`` (the real examples' path) and releases ``inner``'s step; ``update`` scores every
    canary on that :class:`~prism.methods.base.Release` (the factor methods' noised flat factor gradient
    ``(Σ clip(g_i) + σCξ)/B``; PRISM's noised, horizontalised lift of eq. 17 at the factors the step started
    from, ``ΔA`` under peft ``lora_B``, ``ΔBᵀ`` under ``lora_A``), then applies ``inner``'s update from it.
    """

    def __init__(self, inner: Method, directions: CanaryDirections, included: np.ndarray, sample_rate: float,
                 seed: int) -> None:
        super().__init__(inner.params, inner.privacy)
        self.inner, self.directions = inner, directions
        self.included = torch.as_tensor(np.flatnonzero(included), dtype=torch.long)
        self.sample_rate = float(sample_rate)
        self.generator = torch.Generator().manual_seed(seed)  # the canaries' own Poisson draws
        self.scores = torch.zeros(directions.count, dtype=torch.float64)
        self.sampled = torch.zeros(directions.count, dtype=torch.long)
        self._before: Mapping[str, Tensor] = self.params

    def zero_accumulators(self) -> None:
        self.inner.zero_accumulators()

    def accumulate(self, grads: Mapping[str, Tensor]) -> None:
        self.inner.accumulate(grads)

    def add_noise(self, denominator: float, noise: NoiseSource, diagnostics: bool = True) -> Release:
        hit = torch.rand(len(self.included), generator=self.generator, dtype=torch.float64) < self.sample_rate
        ids = self.included[hit]
        if len(ids):
            clip = self.privacy.clip_norm if self.dp else 1.0
            self.inner.accumulate(gradients(self.directions, self.params, ids, clip, per_example=self.dp))
            self.sampled[ids] += 1
        tangent = self.directions.space == "tangent"
        self._before = {n: p.detach().clone() for n, p in self.params.items()} if tangent else self.params
        return self.inner.add_noise(denominator, noise, diagnostics)

    def update(self, release: Release, diagnostics: bool = True) -> dict[str, Tensor]:
        self.scores += project(self.directions, release.tensors, self._before)
        return self.inner.update(release, diagnostics)

    def clip_stats(self) -> dict[str, Tensor]:
        return self.inner.clip_stats()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state)
