"""The second privacy review's defects, each against an independent expectation.

1–2. The PRISM clip norm bounds the exact norm of the lift's image from above for every factor pair the
     rank check admits, gauge-dominated ones included, in both compute dtypes: each released clipped
     contribution has exact (rational-arithmetic) intrinsic norm ≤ C(1 + 1e-6).
3.   ``privacy.noise_source: os`` draws from ``os.urandom`` (no seed), as the sum of four inverse-CDF normals.
4.   With ``os`` noise every step is checkpointed before its line is logged (no replayed, logged release).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch
from omegaconf import OmegaConf

from pipelines.audit import balanced_factors
from prism import train as T
from prism.mechanism import geometry
from prism.methods import build_method
from prism.methods.base import PrivacySpec
from prism.privacy import PoissonSampler
from prism.privacy import noise as noise_mod
from tests.oracles import release_lifts
from tests.test_clip_bound import (
    M,
    N,
    R,
    _fake_setup,
    _tiny_params,
    conditioned,
    exact_sqnorm,
    grads_of,
    method_cfg,
    pair_params,
)

F64 = torch.float64
LIMITS = {"float32": 2890.0, "float64": 9.9e3}  # just inside each DP rank check (κ ≤ 2,896 and 1e4)


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
                A, B, W = _balanced(kappa, g)
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


def _balanced(kappa: float, g: torch.Generator):
    """:func:`pipelines.audit.balanced_factors` at this file's shapes (AᵀA = BᵀB)."""
    QA, _ = torch.linalg.qr(torch.randn(M, R, generator=g, dtype=F64))
    QB, _ = torch.linalg.qr(torch.randn(N, R, generator=g, dtype=F64))
    W, _ = torch.linalg.qr(torch.randn(R, R, generator=g, dtype=F64))
    S = torch.diag(torch.logspace(0.0, -math.log10(kappa), R, dtype=F64))
    return QA @ S @ W, QB @ S @ W, W


def test_the_audit_case_factors_are_balanced_and_its_gauge_commutes() -> None:
    A, B, W = balanced_factors(2890.0, torch.Generator().manual_seed(0))
    torch.testing.assert_close(A.T @ A, B.T @ B, rtol=1e-12, atol=1e-15)
    Omega = W.T @ torch.diag(torch.tensor([1.0, -2.0], dtype=F64)) @ W
    torch.testing.assert_close(A.T @ A @ Omega, Omega @ (B.T @ B), rtol=1e-12, atol=1e-15)
    sq, err, _ = geometry.lifted_norm_terms(geometry.frame(A, B), A @ Omega, -B @ Omega.T)
    assert float(sq.sqrt()) < 1e-12 * float((A @ Omega).norm()) + float(err)  # the pure gauge has no image


@pytest.mark.parametrize("compute_dtype", ["float32", "float64"])
def test_autograd_gradients_are_clipped_to_exactly_C_at_the_limit(compute_dtype: str) -> None:
    """The clip norm equals the image norm for gradients (GB, GᵀA): a huge one is clipped to C within 1e-6."""
    g = torch.Generator().manual_seed(3)
    dtype = getattr(torch, compute_dtype)  # measured at the factors as the snapshot rounds them
    A, B = (conditioned(rows, LIMITS[compute_dtype], g).to(dtype).double() for rows in (M, N))
    meth = build_method(method_cfg("prism", compute_dtype=compute_dtype), pair_params(A, B), PrivacySpec(0.0, 1.0))
    for G in (1e3 * torch.randn(1, M, N, generator=g, dtype=F64), 1e3 * torch.ones(1, M, N, dtype=F64)):
        meth.zero_accumulators()
        meth.accumulate(grads_of(A, B, G, getattr(torch, compute_dtype)))
        dA, dB = release_lifts(meth, 1.0)[0]["x"]
        assert abs(float(exact_sqnorm(A, B, dA, dB)) ** 0.5 - 1.0) <= 1e-6


def test_dp_admits_no_factor_beyond_kappa_1e4_in_float64() -> None:
    """Defect 2: at κ = 6.5e7 the float64 lift rounds at eps·κ² ≈ 0.5, so under DP the rank check refuses
    κ > 1e4 (√eps64 stays the non-private limit)."""
    g = torch.Generator().manual_seed(4)
    A, B = conditioned(M, 2e4, g), conditioned(N, 2e4, g)
    cfg = method_cfg("prism", compute_dtype="float64")
    with pytest.raises(geometry.RankDeficientError, match="rank-deficient"):
        build_method(cfg, pair_params(A, B), PrivacySpec(1.0, 1.0)).zero_accumulators()
    build_method(cfg, pair_params(A, B), None).zero_accumulators()


# ------------------------------------------------------------------------------ defect 3
def test_os_noise_is_the_sum_of_four_inverse_cdf_normals_of_urandom_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``os.urandom`` replaced by known bytes: uniforms (b + ½)·2⁻⁵³ of the top 53 bits, normals
    Σ ndtri(u)/2 over four draws (scipy's ndtri as the reference); no torch generator is read."""
    data = np.random.default_rng(0).bytes(8 * 4 * 6)
    monkeypatch.setattr(noise_mod.os, "urandom", lambda n: data[:n])
    torch.manual_seed(0)
    draws = noise_mod.SecureNoise().normal((2, 3), torch.device("cpu"))
    bits = np.frombuffer(data, dtype=np.uint64) >> np.uint64(12)  # the top 52 bits of each 8 bytes
    u = (bits.astype(np.float64) + 0.5) * 2.0**-52
    expected = scipy.special.ndtri(u).reshape(4, 6).sum(0) / 2.0
    np.testing.assert_allclose(draws.numpy().reshape(-1), expected, rtol=1e-14, atol=1e-15)
    torch.manual_seed(1)  # the global RNG plays no part
    assert torch.equal(noise_mod.SecureNoise().normal((2, 3), torch.device("cpu")), draws)


@pytest.mark.parametrize("fill", [b"\xff", b"\x00"])
def test_os_noise_is_finite_for_the_extreme_urandom_bytes(monkeypatch: pytest.MonkeyPatch, fill: bytes) -> None:
    """All-ones bytes give the largest uniform, all-zeros the smallest: both lie strictly inside (0, 1),
    so every draw is finite, and the two extremes are mirror images (the uniform grid is symmetric)."""
    monkeypatch.setattr(noise_mod.os, "urandom", lambda n: fill * n)
    u = noise_mod.os_uniform(5).numpy()
    assert np.all((u > 0.0) & (u < 1.0))
    assert u[0] == (1.0 - 2.0**-53 if fill == b"\xff" else 2.0**-53)
    draws = noise_mod.SecureNoise().normal((5,), torch.device("cpu"))
    assert torch.isfinite(draws).all()
    monkeypatch.setattr(noise_mod.os, "urandom", lambda n: (b"\x00" if fill == b"\xff" else b"\xff") * n)
    assert torch.equal(noise_mod.SecureNoise().normal((5,), torch.device("cpu")), -draws)
    # the exact value: four copies of the normal quantile of the extreme uniform, summed and halved
    expected = 4 * scipy.special.ndtri(u[0]) / 2.0
    np.testing.assert_allclose(draws.numpy(), expected, rtol=1e-14)


def test_os_uniform_grid_is_symmetric_and_exact() -> None:
    """Every grid point (b + ½)·2⁻⁵² is exact in float64 and its mirror 1 − u is on the grid."""
    b = np.array([0, 1, 2**51, 2**52 - 2, 2**52 - 1], dtype=np.uint64)
    u = (b.astype(np.float64) + 0.5) * 2.0**-52
    mirror = ((np.uint64(2**52 - 1) - b).astype(np.float64) + 0.5) * 2.0**-52
    assert np.array_equal(1.0 - u, mirror)
    assert np.array_equal(np.floor(u * 2.0**52).astype(np.uint64), b)


def test_an_infinite_noise_draw_on_an_empty_batch_stops_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty Poisson batch still releases noise; a non-finite draw must stop the step before any
    checkpoint, as on a non-empty batch."""
    s = _fake_setup(_tiny_params(5))
    s.sampler.sample = lambda: torch.zeros(0, dtype=torch.long)

    class InfiniteNoise:
        def normal(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
            return torch.full(shape, math.inf, dtype=torch.float64, device=device)

    s.noise = InfiniteNoise()
    cfg = OmegaConf.create({"train": {"batch_size": 4, "micro_batch_size": 2}, "privacy": {}})
    with pytest.raises(T.TrainingDivergedError):
        T.train_step(s, cfg)


def test_os_noise_has_the_standard_normal_law_and_never_repeats() -> None:
    x = noise_mod.SecureNoise().normal((100_000,), torch.device("cpu")).numpy()
    assert scipy.stats.kstest(x, "norm").pvalue > 1e-3
    assert not np.array_equal(x[:100], noise_mod.SecureNoise().normal((100,), torch.device("cpu")).numpy())


def test_os_sampler_draws_its_coins_from_urandom_and_has_no_state(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = noise_mod.os.urandom
    monkeypatch.setattr(noise_mod.os, "urandom", lambda n: calls.append(n) or real(n))
    sampler = PoissonSampler(1000, 100, generator_seed=None, secure=True)
    sizes = [len(sampler.sample()) for _ in range(200)]
    assert calls == [8 * 1000] * 200
    assert abs(np.mean(sizes) - 100) < 4 * math.sqrt(100 * 0.9 / 200)
    assert "generator" not in sampler.state_dict()


def test_seeded_torch_streams_collide_past_32_bits() -> None:
    """Why the OS source: torch's CPU generator keeps 32 bits of a 63-bit seed, so a seeded stream can be
    enumerated (2³² candidates), whatever the seed's width."""
    s = (12345 << 32) | 678
    a = torch.randn(5, generator=torch.Generator().manual_seed(s), dtype=F64)
    b = torch.randn(5, generator=torch.Generator().manual_seed(s & 0xFFFFFFFF), dtype=F64)
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------ defect 4
@pytest.mark.parametrize("source", ["seeded", "os"])
def test_os_noise_checkpoints_every_step_before_logging_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           source: str) -> None:
    """Order of checkpoint writes and logged lines: os noise writes step t's checkpoint before its line
    (so a kill never replays a logged step with fresh noise); seeded logs first (a replay is bitwise the
    same) and checkpoints every ``checkpoint_every`` steps."""
    secure = source == "os"
    setup = _fake_setup(_tiny_params(6), secure=secure)
    setup.suite.eval, setup.model, setup.tokenizer = {}, None, None
    monkeypatch.setattr(T, "build", lambda cfg, **_: setup)
    monkeypatch.setattr(T, "_micro_batch", lambda s, indices, *_: indices)
    events: list[tuple[str, int]] = []
    monkeypatch.setattr(T, "save_checkpoint", lambda path, state: events.append(("ckpt", state["step"])))
    monkeypatch.setattr(T, "evaluate_suite", lambda *a, **k: {})
    monkeypatch.setattr(T, "export_adapter", lambda *a, **k: None)
    cfg = OmegaConf.create({
        "train": {"batch_size": 4, "micro_batch_size": 2, "steps": 4, "checkpoint_every": 3, "eval_batch_size": 2},
        "privacy": {"epsilon": 6.0, "delta": 1e-5, "noise_source": source},
        "method": {"name": "prism"}, "suite": {"decoding": {}},
    })
    T.train_and_evaluate(cfg, tmp_path, lambda record: events.append(("log", record["step"])))
    if secure:
        assert events == [e for t in range(1, 5) for e in (("ckpt", t), ("log", t))]
    else:
        assert events == [("log", 1), ("log", 2), ("log", 3), ("ckpt", 3), ("log", 4), ("ckpt", 4)]


# ------------------------------------------------------------------------------ defect 6
def test_wandb_summary_keeps_the_not_dp_flag() -> None:
    """The W&B summary gets the DP status strings of final.json (numbers-only summaries dropped them)."""
    from types import SimpleNamespace

    from pipelines.wandb_log import WandbRun

    final = {"columns": {"SST-2": 0.5}, "epsilon_spent": 6.0,
             "protocol": {"name": "released", "dp_guarantee": "not a valid DP guarantee as stated",
                          "dp_caveats": ["denominator=realised: …", "noise_damping=1e-08: …"]}}
    written: dict = {}
    run = WandbRun.__new__(WandbRun)
    run.run, run.deferred = SimpleNamespace(summary=SimpleNamespace(update=written.update), finish=lambda exit_code: None), False
    run.finish(final)
    assert written["protocol/dp_guarantee"] == "not a valid DP guarantee as stated"
    assert "denominator=realised" in written["protocol/dp_caveats"] and written["epsilon_spent"] == 6.0
