"""PRISM's per-example clipping (eqs. 15–16) over one shape group, tile by tile: pure tensor functions.

A group's per-example factor gradients have two *sides*, paper ``g_A`` ``[G, k, m, r]`` (peft ``lora_B``)
and ``g_Bᵀ`` ``[G, k, r, n]`` (peft ``lora_A``). A side is cut into tiles (:func:`plan`) of whole modules
or, for a module larger than a tile, of a span of its *lines* (the ``m`` rows of ``g_A``, the ``n``
columns of ``g_Bᵀ``). Each tile is converted once into a working-dtype buffer, and its ``r×r`` products
(:func:`prism.geometry.gram_lifted_sqnorms`' ``P`` and ``K``) are accumulated over the spans right away,
while the buffer is in cache: a product over lines is a sum over them. After every module's norm is
known, the weighted sum ``Σ_i α_i g_i`` reads each tile again (:func:`add_clipped`),
reloading it unless the side is one tile that kept its buffer. On a GPU every side is one tile (the
whole group: one kernel per op however many modules); on the CPU, tiles of about a core's cache
(docs/DECISIONS.md D67).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Tile:
    """Modules ``modules`` of a group, lines ``span`` of each of them (all lines unless a single module)."""

    modules: slice
    span: slice

    @property
    def first(self) -> bool:
        """Whether the tile starts its modules' lines (its products overwrite instead of adding)."""
        return self.span.start == 0


def select(x: Tensor, modules: slice | None, span: slice | None = None, dim: int = 1) -> Tensor:
    """``x[modules]``, and ``span`` along ``dim``; ``x`` itself (no indexing op) where they cover it or are None."""
    if modules is not None and modules != slice(0, x.shape[0]):
        x = x[modules]
    if span is not None and span != slice(0, x.shape[dim]):
        x = x.narrow(dim, span.start, span.stop - span.start)
    return x


def plan(modules: int, lines: int, line_bytes: int, budget: float) -> list[Tile]:
    """Tiles of at most ``budget`` bytes covering ``modules × lines`` lines of ``line_bytes`` each: the
    whole side if it fits, else runs of whole modules, else spans of one module's lines (at least one)."""
    if budget >= modules * lines * line_bytes:
        return [Tile(slice(0, modules), slice(0, lines))]
    if budget >= lines * line_bytes:
        c = int(budget // (lines * line_bytes))
        return [Tile(slice(j, min(modules, j + c)), slice(0, lines)) for j in range(0, modules, c)]
    span = max(1, int(budget // line_bytes))
    return [Tile(slice(j, j + 1), slice(s, min(lines, s + span))) for j in range(modules) for s in range(0, lines, span)]


def products_a(X: Tensor, Q: Tensor, P: Tensor, K: Tensor, first: bool) -> None:
    """Add one tile's ``P_A = g_Aᵀg_A`` and ``K_A = Q_Aᵀg_A`` (overwrite if ``first``).

    ``X`` ``[c, k, l, r]``: the tile's ``l`` rows of ``g_A`` (whitened if the caller whitens);
    ``Q`` ``[c, l, r]``: the same rows of the frame; ``P``, ``K`` ``[c, k, r, r]`` with ``P`` contiguous
    and each example's ``K[:, i]`` contiguous. One batched product for ``P`` over modules and
    examples, one per example for ``K``."""
    c, k, lines, r = X.shape
    beta = 0.0 if first else 1.0
    flat = X.reshape(c * k, lines, r)
    P.view(c * k, r, r).baddbmm_(flat.mT, flat, beta=beta)
    Qt = Q.mT
    for i in range(k):
        K[:, i].baddbmm_(Qt, X[:, i], beta=beta)


def products_b(Y: Tensor, Q: Tensor, P: Tensor, Kt: Tensor, first: bool) -> None:
    """Add one tile's ``P_B = g_Bᵀg_B`` and ``K_Bᵀ = g_Bᵀ Q_B`` (overwrite if ``first``).

    ``Y`` ``[c, k, r, l]``: the tile's ``l`` columns of ``g_Bᵀ``; ``Q`` ``[c, l, r]``: the same rows of the
    frame; ``P``, ``Kt`` ``[c, k, r, r]`` contiguous. One batched product each, over modules and examples."""
    c, k, r, lines = Y.shape
    beta = 0.0 if first else 1.0
    flat = Y.reshape(c * k, r, lines)
    P.view(c * k, r, r).baddbmm_(flat, flat.mT, beta=beta)
    Kt.view(c, k * r, r).baddbmm_(Y.reshape(c, k * r, lines), Q, beta=beta)


def add_clipped(S: Tensor, alpha: Tensor, X: Tensor, fresh: bool) -> None:
    """``S += Σ_i α_i X_i`` (``S = …`` if ``fresh``) for one tile of either side: ``X`` ``[c, k, …]``, ``S`` its
    ``[c, …]`` slice of the sums; one batched ``αᵀ`` product over the tile's modules, straight into ``S`` when it is
    contiguous (always for ``g_A``), else through one temporary (a span of a module's ``g_Bᵀ`` columns)."""
    c, k = X.shape[:2]
    if S.is_contiguous():
        S.view(c, 1, -1).baddbmm_(alpha.expand(c, 1, k), X.reshape(c, k, -1), beta=0.0 if fresh else 1.0)
        return
    total = torch.bmm(alpha.expand(c, 1, k), X.reshape(c, k, -1)).view(S.shape)
    S.copy_(total) if fresh else S.add_(total)
