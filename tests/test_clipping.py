"""Accumulate's tiles (prism.methods.clipping): the plan covers every line once, and products and weighted
sums summed over a tiling equal the whole-tensor products (a brute-force einsum)."""
from __future__ import annotations

import math

import pytest
import torch

from prism.methods import clipping

F64 = torch.float64


@pytest.mark.parametrize("modules, lines, budget", [(5, 7, math.inf), (5, 7, 5 * 7 * 8), (5, 7, 2 * 7 * 8 + 3),
                                                    (5, 7, 3 * 8), (5, 7, 1), (1, 10, 4 * 8)])
def test_plan_covers_each_line_once_within_the_budget(modules: int, lines: int, budget: float) -> None:
    line_bytes = 8
    tiles = clipping.plan(modules, lines, line_bytes, budget)
    seen = torch.zeros(modules, lines, dtype=torch.int64)
    for t in tiles:
        seen[t.modules, t.span] += 1
        size = (t.modules.stop - t.modules.start) * (t.span.stop - t.span.start) * line_bytes
        assert size <= budget or (t.span.stop - t.span.start == 1), t  # one line may exceed a tiny budget
        assert t.modules.stop - t.modules.start == 1 or t.span == slice(0, lines)  # spans only of single modules
    assert (seen == 1).all()
    if budget >= modules * lines * line_bytes:
        assert len(tiles) == 1


def test_tiled_products_and_sums_equal_the_whole_products() -> None:
    g = torch.Generator().manual_seed(0)
    G, k, m, n, r = 3, 4, 11, 9, 2
    gA, gBt = torch.randn(G, k, m, r, generator=g, dtype=F64), torch.randn(G, k, r, n, generator=g, dtype=F64)
    QA, QB = torch.randn(G, m, r, generator=g, dtype=F64), torch.randn(G, n, r, generator=g, dtype=F64)
    alpha = torch.rand(k, generator=g, dtype=F64)
    expect = {"PA": torch.einsum("gkmi,gkmj->gkij", gA, gA), "KA": torch.einsum("gmi,gkmj->gkij", QA, gA),
              "PB": torch.einsum("gkin,gkjn->gkij", gBt, gBt), "KBt": torch.einsum("gkin,gnj->gkij", gBt, QB),
              "SA": torch.einsum("k,gkmr->gmr", alpha, gA), "SBt": torch.einsum("k,gkrn->grn", alpha, gBt)}
    for budget in (math.inf, 2 * m * k * r * 8, 3 * k * r * 8, 1):
        PA, KA, PB, KBt = (torch.full((G, k, r, r), math.nan, dtype=F64) for _ in range(4))
        SA, SBt = torch.full((G, m, r), math.nan, dtype=F64), torch.full((G, r, n), math.nan, dtype=F64)
        for t in clipping.plan(G, m, k * r * 8, budget):
            X = gA[t.modules, :, t.span].contiguous()
            clipping.products_a(X, QA[t.modules, t.span], PA[t.modules], KA[t.modules], t.first)
            clipping.add_clipped(SA[t.modules, t.span], alpha, X, fresh=True)
            clipping.add_clipped(SA[t.modules, t.span], alpha, X, fresh=False)  # a second micro-batch adds
        for t in clipping.plan(G, n, k * r * 8, budget):
            Y = gBt[t.modules][..., t.span].contiguous()
            clipping.products_b(Y, QB[t.modules, t.span], PB[t.modules], KBt[t.modules], t.first)
            clipping.add_clipped(SBt[t.modules][..., t.span], alpha, Y, fresh=True)
            clipping.add_clipped(SBt[t.modules][..., t.span], alpha, Y, fresh=False)
        got = {"PA": PA, "KA": KA, "PB": PB, "KBt": KBt, "SA": SA / 2, "SBt": SBt / 2}
        for key, value in expect.items():
            torch.testing.assert_close(got[key], value, rtol=1e-13, atol=1e-13, msg=f"{key} at budget {budget}")
