"""PRISM's clip norm bounds every clipped contribution: for every factor pair the rank check admits
under DP, gauge-dominated ones included, in both compute dtypes, each released clipped contribution has
exact (rational-arithmetic) intrinsic norm ≤ C(1 + 1e-6) (docs/DECISIONS.md D70); gradients are clipped to
exactly C; beyond the admission limit the rank check refuses the factors."""
from __future__ import annotations

import pytest
import torch
from conftest import F64, M, N, R, conditioned, method_cfg, pair_params

from pipelines.verbs import audit
from prism.mechanism import geometry
from prism.methods import build_method
from prism.methods.base import CLIP_MARGIN, PrivacySpec
from tests.oracles import exact_sqnorm, grads_of, release_lifts

LIMITS = {"float32": 2890.0, "float64": 9.9e3}  # just inside each DP rank check (κ ≤ 2,896 and 1e4)


@pytest.mark.parametrize(("compute_dtype", "kappa"), [("float32", 2800.0), ("float64", 9.9e3)])
def test_clipped_contribution_norm_at_the_admission_limit(compute_dtype: str, kappa: float) -> None:
    """Factors with κ just inside the rank check (σ_min/σ_max > √eps); gradients of size up to 1e12
    along the worst-conditioned directions: each example's clipped contribution, as summed,
    has exact intrinsic norm ≤ C(1 + 1e-6)."""
    dtype = getattr(torch, compute_dtype)
    C, worst = 1.0, 0.0
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        A, B = conditioned(M, kappa, g).to(dtype), conditioned(N, kappa, g).to(dtype)
        geometry.check_full_rank(A, B, "x")
        meth = build_method(method_cfg("prism", compute_dtype=compute_dtype), pair_params(A, B),
                            PrivacySpec(sigma=0.0, clip_norm=C))
        UA = torch.linalg.svd(A.to(F64), full_matrices=True).U
        UB = torch.linalg.svd(B.to(F64), full_matrices=True).U
        directions = [torch.outer(UA[:, i], UB[:, j]) for i, j in ((R - 1, R - 1), (R - 1, 0), (R, R - 1), (R - 1, R))]
        directions.append(torch.randn(M, N, generator=g, dtype=F64))
        for G in directions:
            for scale in (1.0, 1e6, 1e12):
                meth.zero_accumulators()
                meth.accumulate(grads_of(A, B, scale * G[None], dtype))
                summed = release_lifts(meth, 1.0)[0]["x"]  # σ = 0: the clipped sum itself
                worst = max(worst, float(exact_sqnorm(A.to(F64), B.to(F64), *summed)) ** 0.5 / C)
    assert worst <= 1.0 + 1e-6, worst


def _pairs(A: torch.Tensor, B: torch.Tensor, g: torch.Generator, balanced_W: torch.Tensor | None):
    """Adversarial factor pairs (g_A [1, m, r], g_B [1, n, r]): gauge (commuting on balanced factors or
    generic), the same with an outside-span(A) part of relative size 1e-3 … 1e-12, and autograd-shaped
    ones along the weakest singular directions; each at scales 1 and 1e8."""
    QA = torch.linalg.qr(A).Q
    Omegas = [torch.randn(R, R, generator=g, dtype=F64)]
    if balanced_W is not None:
        Omegas.append(balanced_W.T @ torch.diag(torch.randn(R, generator=g, dtype=F64)) @ balanced_W)
    Y = torch.randn(M, R, generator=g, dtype=F64)
    outside = Y - QA @ (QA.T @ Y)
    UA, UB = torch.linalg.svd(A, full_matrices=True).U, torch.linalg.svd(B, full_matrices=True).U
    for Omega in Omegas:
        gauge = (A @ Omega, -B @ Omega.T)
        size = float(gauge[0].norm())
        yield gauge
        for rel_size in (1e-3, 1e-6, 1e-9, 1e-12):
            yield gauge[0] + outside * (rel_size * size / float(outside.norm())), gauge[1]
    for i, j in ((R - 1, R - 1), (R - 1, 0), (R, R - 1)):
        G = torch.outer(UA[:, i], UB[:, j])
        yield G @ B, G.T @ A


@pytest.mark.parametrize("compute_dtype", ["float32", "float64"])
@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "generic"])
def test_clipped_contribution_is_at_most_C_for_every_factor_pair(compute_dtype: str, balanced: bool) -> None:
    """Adversarial search over non-gradient factor pairs at each admission limit (and κ = 30): the
    released lift of one clipped example (σ = 0, so the release is the clipped sum itself) has exact
    intrinsic norm ≤ C(1 + 1e-6). The difference-of-squares norm gave up to 100 C here (D70)."""
    dtype = getattr(torch, compute_dtype)
    C, worst = 1.0, 0.0
    for kappa in (30.0, LIMITS[compute_dtype]):
        for seed in range(2):
            g = torch.Generator().manual_seed(seed)
            if balanced:
                A, B, W = audit.balanced_factors(kappa, g, (M, N, R))
            else:
                A, B, W = conditioned(M, kappa, g), conditioned(N, kappa, g), None
            A, B = A.to(dtype), B.to(dtype)
            geometry.check_full_rank(A, B, "x")
            meth = build_method(method_cfg("prism", compute_dtype=compute_dtype), pair_params(A, B),
                                PrivacySpec(sigma=0.0, clip_norm=C))
            for gA, gB in _pairs(A.to(F64), B.to(F64), g, W):
                for scale in (1.0, 1e8):
                    meth.zero_accumulators()
                    meth.accumulate({"x.lora_B.default.weight": (scale * gA)[None].to(dtype),
                                     "x.lora_A.default.weight": (scale * gB).T[None].to(dtype)})
                    dA, dB = release_lifts(meth, 1.0)[0]["x"]
                    worst = max(worst, float(exact_sqnorm(A.to(F64), B.to(F64), dA, dB)) ** 0.5 / C)
    assert worst <= 1.0 + 1e-6, worst


@pytest.mark.parametrize("shape", [(M, N, R), (audit.M, audit.N, audit.R)], ids=["this_file", "audit"])
def test_the_audit_case_factors_are_balanced_and_its_gauge_commutes(shape: tuple[int, int, int]) -> None:
    """``AᵀA = BᵀB``, singular values 1 … 1/κ log-spaced, and a gauge ``Ω`` commuting with ``AᵀA`` has no image."""
    kappa = 2890.0
    A, B, W = audit.balanced_factors(kappa, torch.Generator().manual_seed(0), shape)
    torch.testing.assert_close(A.T @ A, B.T @ B, rtol=1e-12, atol=1e-15)
    r = A.shape[1]
    for factor in (A, B):
        sv = torch.linalg.svdvals(factor)
        torch.testing.assert_close(sv, kappa ** (-torch.arange(r, dtype=F64) / (r - 1)), rtol=1e-12, atol=0.0)
    Omega = W.T @ torch.diag(torch.linspace(1.0, -2.0, r, dtype=F64)) @ W
    torch.testing.assert_close(A.T @ A @ Omega, Omega @ (B.T @ B), rtol=1e-12, atol=1e-15)
    sq, err, _ = geometry.lifted_norm_terms(geometry.frame(A, B), A @ Omega, -B @ Omega.T)
    assert float(sq.sqrt()) < 1e-12 * float((A @ Omega).norm()) + float(err)  # the pure gauge has no image


@pytest.mark.parametrize("compute_dtype", ["float32", "float64"])
def test_autograd_gradients_are_clipped_to_exactly_the_clip_target_at_the_limit(compute_dtype: str) -> None:
    """The clip norm equals the image norm for gradients (GB, GᵀA): a huge one is clipped to the clip target
    C(1 − CLIP_MARGIN) within 1e-6."""
    g = torch.Generator().manual_seed(3)
    dtype = getattr(torch, compute_dtype)  # measured at the factors as the snapshot rounds them
    A, B = (conditioned(rows, LIMITS[compute_dtype], g).to(dtype).double() for rows in (M, N))
    meth = build_method(method_cfg("prism", compute_dtype=compute_dtype), pair_params(A, B), PrivacySpec(0.0, 1.0))
    for G in (1e3 * torch.randn(1, M, N, generator=g, dtype=F64), 1e3 * torch.ones(1, M, N, dtype=F64)):
        meth.zero_accumulators()
        meth.accumulate(grads_of(A, B, G, getattr(torch, compute_dtype)))
        dA, dB = release_lifts(meth, 1.0)[0]["x"]
        assert abs(float(exact_sqnorm(A, B, dA, dB)) ** 0.5 - (1.0 - CLIP_MARGIN)) <= 1e-6


def test_dp_admits_no_factor_beyond_kappa_1e4_in_float64() -> None:
    """At κ = 6.5e7 the float64 lift rounds at eps·κ² ≈ 0.5, so under DP the rank check refuses
    κ > 1e4 (√eps64 stays the non-private limit)."""
    g = torch.Generator().manual_seed(4)
    A, B = conditioned(M, 2e4, g), conditioned(N, 2e4, g)
    cfg = method_cfg("prism", compute_dtype="float64")
    with pytest.raises(geometry.RankDeficientError, match="rank-deficient"):
        build_method(cfg, pair_params(A, B), PrivacySpec(1.0, 1.0)).zero_accumulators()
    build_method(cfg, pair_params(A, B), None).zero_accumulators()
