"""PRISM's moment state is a function of the noised release: its vertical (gauge) block carries noise
like every other linear statistic of the noised tangent vector, and the horizontalised noise has the
second moments of eq. 50."""
from __future__ import annotations

import pytest
import torch
from conftest import F64, M, N, R, conditioned, method_cfg, pair_params

from prism.audit.diagnostics import sample_tangent_noise
from prism.mechanism import geometry
from prism.methods import build_method
from prism.methods.base import PrivacySpec
from tests.oracles import grads_of

PRISM_VARIANTS = {
    "prism": method_cfg("prism"),
    "prism-pre_retract": method_cfg("prism", horizontalize="pre_retract"),
    "prism-none": method_cfg("prism", horizontalize="none"),
    "prism_paper": method_cfg("prism_paper"),
}


@pytest.mark.parametrize("variant", list(PRISM_VARIANTS))
def test_vertical_block_of_the_moments_is_no_sharper_than_the_tangent_noise(variant: str) -> None:
    """The moment state after one step: each entry of its r×r vertical block ``Aᵀ m_A`` must have
    mean shift / noise std ≤ 1/σ between neighbouring batches (true of every linear statistic of
    the noised tangent vector: the canary moves it by ≤ C/B, the isotropic noise has std σC/B).
    The canary lies inside span(A)×span(B), where eq. 14 puts half of it in the vertical block."""
    sigma, C, denom, draws = 2.0, 1.0, 4.0, 150
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(M, R, generator=g, dtype=F64), torch.randn(N, R, generator=g, dtype=F64)
    QA, QB = torch.linalg.qr(A).Q, torch.linalg.qr(B).Q
    base = 0.1 * torch.randn(2, M, N, generator=g, dtype=F64)
    canary = 1e6 * QA @ torch.randn(R, R, generator=g, dtype=F64) @ QB.T
    blocks = {}
    for side, G in (("without", base), ("with", torch.cat([base, canary[None]]))):
        noise = torch.Generator().manual_seed(1)  # the same draws on both sides
        out = []
        for _ in range(draws):
            meth = build_method(PRISM_VARIANTS[variant], pair_params(A, B),
                                PrivacySpec(sigma=sigma, clip_norm=C))
            meth.zero_accumulators()
            meth.accumulate(grads_of(A, B, G, F64))
            meth.step(denom, noise)
            out.append(A.T @ meth.state_dict()["adaptive"]["x"]["mA"].to(F64))
        blocks[side] = torch.stack(out)
    shift = (blocks["with"].mean(0) - blocks["without"].mean(0)).abs()
    std = blocks["without"].std(0)
    assert (shift / std).max() <= 1.35 / sigma, (shift / std).max()


def test_horizontal_noise_moments_match_monte_carlo() -> None:
    """Eq. 50 for the horizontalised noise: the closed form against 20,000 draws of H(Ξ_A, Ξ_B)."""
    from prism.mechanism.adaptive import horizontal_noise_second_moments

    g = torch.Generator().manual_seed(2)
    A, B = conditioned(M, 5.0, g), conditioned(N, 3.0, g)
    fr = geometry.frame(A, B)
    XiA, XiB = sample_tangent_noise(A, B, generator=g, frame=fr, sample_shape=(20000,))
    HA, HB = geometry.horizontalize(A, B, XiA, XiB, frame=fr)
    sigma_A, sigma_B = horizontal_noise_second_moments(fr)
    for H, sig, rows in ((HA, sigma_A, M), (HB, sigma_B, N)):
        samples = H.mT @ H / rows
        se = samples.std(0) / 20000**0.5
        assert ((samples.mean(0) - sig).abs() <= 4 * se + 1e-12).all()
