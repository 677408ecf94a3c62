"""PRISM's step over CPU tiles of modules (``PrismMethod._step_tiles``) against the same step on whole groups.

With ``tile_bytes=1`` every module is its own tile, with ``2·(m + n)·r·8`` bytes two modules are (three: a
short last tile), and ``math.inf`` runs every group as one batch (the chain used off the CPU). The privatised lift (eq. 17) and the
retraction's QR extensions and core (eq. 22) act on each module alone, so the three runs must agree to rounding:
lifts, new factors, adaptive moments and step statistics within 1e-12, over several DP (σ > 0, the same
generator stream) and non-DP steps, float32 and float64 ``compute_dtype``. Also the float64 normal draws,
whose transform runs over chunks of pairs, against one pass over all of them.
"""
from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from prism.methods.base import PrivacySpec
from prism.methods.prism import PrismMethod

R = 3
ROWS = 14  # m + n of every shape below, so a two-module tile is the same size in every group
SHAPES = ((8, 6), (6, 8), (8, 6), (6, 8), (8, 6), (9, 5), (6, 8), (8, 6), (6, 8))  # groups of 4, 4, 1 modules
TILES = {"one module": 1, "two modules": 2 * ROWS * R * 8, "three modules": 3 * ROWS * R * 8, "whole groups": math.inf}


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return ((x - y).norm() / y.norm().clamp_min(1e-300)).item()


def make_params(seed: int = 0) -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = {}
    for i, (m, n) in enumerate(SHAPES):
        scale = torch.logspace(0, 1, R)  # conditioned factors, so a module mixed up with another one shows
        params[f"m.layers.{i}.proj.lora_A.default.weight"] = nn.Parameter((torch.randn(R, n, generator=g).mT
                                                                            * scale).mT.contiguous())
        params[f"m.layers.{i}.proj.lora_B.default.weight"] = nn.Parameter(torch.randn(m, R, generator=g) * scale)
    return params


def grads(params: dict[str, nn.Parameter], k: int, seed: int, dp: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {name: torch.randn(k, *p.shape, generator=g) * 10.0 ** torch.linspace(-2, 1, k)[:, None, None]
           for name, p in params.items()}
    return out if dp else {name: t.sum(0) for name, t in out.items()}


def run(tile_bytes: float, dp: bool, compute_dtype: str, preconditioner: str, steps: int = 3) -> list:
    params = make_params()
    cfg = {"name": "prism", "lr": 0.05, "init": "spectral", "compute_dtype": compute_dtype,
           "preconditioner": preconditioner}
    method = PrismMethod(OmegaConf.create(cfg), params, PrivacySpec(sigma=0.7, clip_norm=1.0) if dp else None,
                         tile_bytes=tile_bytes)
    assert [len(g.pairs) for g in method.groups] == [4, 4, 1]
    lifts = []
    inner = method.privatized_group
    method.privatized_group = lambda group, *a, **k: lifts.append(inner(group, *a, **k)) or lifts[-1]
    generator = torch.Generator().manual_seed(5)
    trace = []
    for step in range(steps):
        lifts.clear()
        method.zero_accumulators()
        for micro in range(2):
            method.accumulate(grads(params, 3, seed=10 * step + micro, dp=dp))
        tiles = [method._step_tiles(g) for g in method.groups]
        stats = method.step(4.0, generator if dp else None)
        trace.append(([x.clone() for out in lifts for x in out[:2]], {k: v.clone() for k, v in stats.items()},
                      {k: p.detach().clone() for k, p in params.items()}, method.state_dict()["adaptive"], tiles))
    return trace


@pytest.mark.parametrize("preconditioner", ["floor", "none"])
@pytest.mark.parametrize("compute_dtype", ["float32", "float64"])
@pytest.mark.parametrize("dp", [True, False], ids=["dp", "nondp"])
def test_step_tiles_equal_whole_groups(dp: bool, compute_dtype: str, preconditioner: str) -> None:
    runs = {label: run(tile_bytes, dp, compute_dtype, preconditioner) for label, tile_bytes in TILES.items()}
    whole = runs["whole groups"]
    assert whole[0][4] == [[None]] * 3  # no slicing at all
    assert [len(t) for t in runs["one module"][0][4]] == [4, 4, 1]
    assert [len(t) for t in runs["two modules"][0][4]] == [2, 2, 1]
    assert [[j.stop - j.start for j in t] for t in runs["three modules"][0][4][:2]] == [[3, 1], [3, 1]]  # a short last tile
    for label, trace in runs.items():
        for (lifts, stats, params, moments, _), (lifts0, stats0, params0, moments0, _) in zip(trace, whole):
            assert len(lifts) == len(lifts0) == 6
            for x, x0 in zip(lifts, lifts0):
                assert rel(x, x0) <= 1e-12, label
            assert stats.keys() == stats0.keys() and {"update_norm"} <= stats.keys()
            for key in stats0:
                assert rel(stats[key], stats0[key]) <= 1e-12, (label, key)
            for name in params0:
                assert rel(params[name], params0[name]) <= 1e-12, (label, name)
            for module, state in moments0.items():
                for key in ("mA", "VA", "mB", "VB"):
                    assert rel(moments[module][key], state[key]) <= 1e-12, (label, module, key)
    # the steps moved the factors (so agreement is not the trivial one of a zero update)
    assert min(rel(whole[-1][2][name], make_params()[name].detach()) for name in whole[-1][2]) > 1e-4


def test_normal_draws_in_chunks_are_the_whole_transform() -> None:
    """``standard_normal``'s transform over chunks of pairs (of any size, the last one short) gives bitwise the
    draws of one pass over all of them: the same integer stream, elementwise arithmetic."""
    from prism import geometry

    def draw(shape: tuple[int, ...], chunk: float) -> torch.Tensor:
        return geometry.standard_normal(shape, torch.Generator().manual_seed(7), torch.float64, torch.device("cpu"),
                                        chunk=chunk)

    shapes = [(1,), (5, 7), (3, 40, 9)]
    whole = [draw(shape, math.inf) for shape in shapes]
    for chunk in (1, 13, 64, geometry.NORMAL_CHUNK):
        for shape, x in zip(shapes, whole):
            assert torch.equal(draw(shape, chunk), x), (chunk, shape)
    assert whole[2].std().item() > 0.5  # real draws, not a constant
