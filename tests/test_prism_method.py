"""PrismMethod (Alg. 1) on tiny random factors: sensitivity, noise law, gauge invariance, resume."""
from __future__ import annotations

import io
import logging

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from prism.mechanism import geometry
from prism.mechanism.lora import lora_pairs, read_pair
from prism.methods import build_method
from prism.methods.base import CLIP_MARGIN, PrivacySpec
from prism.methods.prism import PrismMethod
from tests.oracles import example_norms, release_lifts

F64 = torch.float64
R = 3
SHAPES = ((8, 6), (5, 7))  # (m, n) per module

RELEASED = {"name": "prism", "lr": 0.05, "init": "spectral", "compute_dtype": "float64"}
PLAIN = {**RELEASED, "preconditioner": "none", "horizontalize": "none"}  # eq. 22 without adaptivity


def make_params(seed: int = 0, dtype: torch.dtype = F64) -> dict[str, nn.Parameter]:
    """peft-named LoRA parameters: lora_A [r, n] (= Bᵀ), lora_B [m, r] (= A)."""
    g = torch.Generator().manual_seed(seed)
    params = {}
    for i, (m, n) in enumerate(SHAPES):
        prefix = f"m.layers.{i}.q_proj"
        params[f"{prefix}.lora_A.default.weight"] = nn.Parameter(torch.randn(R, n, generator=g, dtype=F64).to(dtype))
        params[f"{prefix}.lora_B.default.weight"] = nn.Parameter(torch.randn(m, R, generator=g, dtype=F64).to(dtype))
    return params


def method(cfg: dict, params, privacy: PrivacySpec | None) -> PrismMethod:
    built = build_method(OmegaConf.create(cfg), params, privacy)
    assert isinstance(built, PrismMethod)
    return built


def factors(params) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(x.detach().clone() for x in read_pair(params, p)) for p in lora_pairs(params)]


def per_example_grads(params, Gs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-example peft grads of ⟨G_i, ABᵀ⟩: lora_B ← G B [k, m, r], lora_A ← Aᵀ G [k, r, n]."""
    grads = {}
    for pair, G in zip(lora_pairs(params), Gs):
        A, B = (x.detach().to(G.dtype) for x in read_pair(params, pair))
        grads[pair.a_name] = (G @ B).to(params[pair.a_name].dtype)
        grads[pair.b_name] = (A.T @ G).to(params[pair.b_name].dtype)
    return grads


def random_G(k: int, seed: int, scales=None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    Gs = [torch.randn(k, m, n, generator=g, dtype=F64) for m, n in SHAPES]
    if scales is not None:
        Gs = [G * torch.tensor(scales, dtype=F64)[:, None, None] for G in Gs]
    return Gs


def dense_P(A: torch.Tensor, B: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Eq. 13 from explicit pseudo-inverse projectors (independent of prism.mechanism.geometry)."""
    PiA, PiB = A @ torch.linalg.pinv(A), B @ torch.linalg.pinv(B)
    return PiA @ G + G @ PiB - PiA @ G @ PiB


def image(A, B, dA, dB) -> torch.Tensor:
    return dA @ B.T + A @ dB.T


def test_one_huge_example_moves_the_sum_by_exactly_C() -> None:
    """Sensitivity (eq. 16): adding an example with a huge gradient changes Σ α_i ΔZ_i by norm C(1 − CLIP_MARGIN)
    (global), the clip target."""
    C = 0.7
    params = make_params()
    Gs = random_G(3, seed=1, scales=[1e-3, 1e-3, 1e6])
    sums = []
    for k in (2, 3):
        meth = method(PLAIN, params, PrivacySpec(sigma=0.0, clip_norm=C))
        meth.zero_accumulators()
        meth.accumulate(per_example_grads(params, [G[:k] for G in Gs]))
        sums.append(release_lifts(meth, 1.0)[0])
    diff_sq = sum(
        (image(A, B, *sums[1][p.module]) - image(A, B, *sums[0][p.module])).square().sum()
        for p, (A, B) in zip(lora_pairs(params), factors(params))
    )
    assert diff_sq.sqrt().item() == pytest.approx(C * (1 - CLIP_MARGIN), rel=1e-9)
    assert example_norms(meth)[:2].max() < C < example_norms(meth)[2]


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_sigma0_step_equals_dense_clipped_mean_and_truncated_svd(dtype: torch.dtype) -> None:
    """σ = 0, no adaptivity: Z⁺ = Retr_r(Z − η·(1/B)Σ α_i P(G_i)) from a dense reference (eqs. 13, 16, 22)."""
    C, denom, lr = 2.0, 6.0, 0.05
    params = make_params(dtype=dtype)
    before = [(A.to(F64), B.to(F64)) for A, B in factors(params)]
    Gs = random_G(5, seed=2, scales=[0.05, 1.0, 0.1, 2.0, 0.02])
    cfg = {**PLAIN, "compute_dtype": "float32" if dtype == torch.float32 else "float64"}
    meth = method(cfg, params, PrivacySpec(sigma=0.0, clip_norm=C))
    meth.zero_accumulators()
    meth.accumulate(per_example_grads(params, [G[:2] for G in Gs]))  # two micro-batches
    meth.accumulate(per_example_grads(params, [G[2:] for G in Gs]))
    stats = meth.step(denom, None)

    dZ = [torch.stack([dense_P(A, B, G_i) for G_i in G]) for (A, B), G in zip(before, Gs)]
    norms = sum(d.square().sum((1, 2)) for d in dZ).sqrt()
    target = C * (1 - CLIP_MARGIN)
    alpha = (target / norms).clamp(max=1.0)
    assert 0 < (norms > target).sum() < len(norms)  # the test exercises clipped and unclipped examples
    assert stats["clip_fraction"] == pytest.approx((norms > target).double().mean().item())
    assert stats["grad_norm_mean"] == pytest.approx(norms.mean().item(), rel=1e-5)
    upd_sq = 0.0
    for (A, B), d, (A2, B2) in zip(before, dZ, factors(params)):
        target = A @ B.T - lr * torch.einsum("k,kmn->mn", alpha, d) / denom
        U, S, Vh = torch.linalg.svd(target)
        expected = U[:, :R] @ torch.diag(S[:R]) @ Vh[:R]
        torch.testing.assert_close(A2.to(F64) @ B2.to(F64).T, expected, **_tol(dtype))
        upd_sq += (expected - A @ B.T).square().sum().item()
    assert stats["update_norm"] == pytest.approx(upd_sq**0.5, rel=1e-3 if dtype == torch.float32 else 1e-8)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-11}


def test_noise_energy_per_module_matches_eq21() -> None:
    """Zero gradients: E‖τ(Ξ_A Bᵀ + A Ξ_Bᵀ)‖² = τ² r(m+n−r) per module, τ = σC/B (Monte Carlo, 3 SE)."""
    sigma, C, denom, S = 1.3, 0.5, 8.0, 400
    params = make_params()
    meth = method(RELEASED, params, PrivacySpec(sigma=sigma, clip_norm=C))
    tau = sigma * C / denom
    g = torch.Generator().manual_seed(5)
    energies = torch.zeros(S, len(SHAPES), dtype=F64)
    for s in range(S):
        meth.zero_accumulators()
        meth.accumulate(per_example_grads(params, [torch.zeros(2, m, n, dtype=F64) for m, n in SHAPES]))
        lifts, release = release_lifts(meth, denom, g)
        noise_norm = release.noise_sq.sqrt()
        for j, (p, (A, B)) in enumerate(zip(lora_pairs(params), factors(params))):
            energies[s, j] = image(A, B, *lifts[p.module]).square().sum()
        assert noise_norm**2 == pytest.approx(energies[s].sum().item(), rel=1e-9)
    for j, (m, n) in enumerate(SHAPES):
        expected = tau**2 * R * (m + n - R)
        mean, se = energies[:, j].mean().item(), energies[:, j].std().item() / S**0.5
        assert abs(mean - expected) < 3 * se, (mean, expected, se)


def test_clip_coefficients_are_gauge_invariant() -> None:
    """(A R, B R⁻ᵀ), R ∈ GL(r): same per-example norms s_i and the same clipped intrinsic sum."""
    params = make_params()
    gauged = make_params()
    Rg = torch.eye(R, dtype=F64) + 0.5 * torch.randn(R, R, dtype=F64)
    with torch.no_grad():
        for p in lora_pairs(gauged):
            gauged[p.a_name].copy_(gauged[p.a_name] @ Rg)  # A R
            gauged[p.b_name].copy_(torch.linalg.solve(Rg, gauged[p.b_name]))  # (B R⁻ᵀ)ᵀ = R⁻¹ Bᵀ
    Gs = random_G(4, seed=3)
    results = []
    for ps in (params, gauged):
        meth = method(PLAIN, ps, PrivacySpec(sigma=0.0, clip_norm=1.0))
        meth.zero_accumulators()
        meth.accumulate(per_example_grads(ps, Gs))
        lifts = release_lifts(meth, 1.0)[0]
        images = [image(A, B, *lifts[p.module]) for p, (A, B) in zip(lora_pairs(ps), factors(ps))]
        results.append((example_norms(meth), images))
    assert (results[0][0] > 1.0).any()
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-9, atol=0)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(b, a, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("cfg", [RELEASED, {**RELEASED, "preconditioner": "ridge", "floor_mode": "geometry",
                                            "debias": True, "cond_max": None, "horizontalize": "none"}],
                         ids=["prism", "prism_paper"])
def test_nondp_steps_decrease_a_quadratic_loss(cfg: dict) -> None:
    """½‖ABᵀ − Z*‖² (Z* of rank r) decreases over a few non-DP steps (summed micro-batch grads)."""
    params = make_params()
    g = torch.Generator().manual_seed(7)
    targets = [torch.randn(m, R, generator=g, dtype=F64) @ torch.randn(R, n, generator=g, dtype=F64)
               for m, n in SHAPES]

    def loss_and_grads():
        loss, grads = 0.0, {}
        for pair, Zs in zip(lora_pairs(params), targets):
            A, B = read_pair(params, pair)
            G = A @ B.T - Zs
            loss += 0.5 * G.square().sum().item()
            grads[pair.a_name], grads[pair.b_name] = G @ B, A.T @ G
        return loss, grads

    meth = method({**cfg, "lr": 0.1}, params, None)
    losses = []
    for _ in range(15):
        loss, grads = loss_and_grads()
        losses.append(loss)
        meth.zero_accumulators()
        meth.accumulate({k: v.detach() for k, v in grads.items()})
        stats = meth.step(1.0, None)
        assert "noise_norm" not in stats and stats["update_norm"] > 0
    assert losses[-1] < 0.3 * losses[0], losses


def test_dp_steps_with_zero_gradients_keep_factors_full_rank() -> None:
    params = make_params()
    meth = method(RELEASED, params, PrivacySpec(sigma=1.0, clip_norm=1.0))
    g = torch.Generator().manual_seed(11)
    start = factors(params)
    for _ in range(10):
        meth.zero_accumulators()
        meth.accumulate(per_example_grads(params, [torch.zeros(3, m, n, dtype=F64) for m, n in SHAPES]))
        stats = meth.step(4.0, g)
        assert stats["clip_fraction"] == 0.0 and stats["noise_norm"] > 0
    for p, (A, B), (A0, _) in zip(lora_pairs(params), factors(params), start):
        geometry.check_full_rank(A, B, p.module)
        assert not torch.allclose(A, A0)


def _run(meth: PrismMethod, params, steps: int, g: torch.Generator, seed: int) -> None:
    for s in range(steps):
        meth.zero_accumulators()
        meth.accumulate(per_example_grads(params, random_G(2, seed=seed + s)))
        meth.step(4.0, g)


def test_state_dict_round_trip_resumes_bit_identically() -> None:
    privacy = PrivacySpec(sigma=0.8, clip_norm=1.0)
    params = make_params()
    meth = method(RELEASED, params, privacy)
    g = torch.Generator().manual_seed(13)
    _run(meth, params, 3, g, seed=100)
    buf = io.BytesIO()
    torch.save({"method": meth.state_dict(), "params": {k: v.detach().clone() for k, v in params.items()},
                "rng": g.get_state()}, buf)
    _run(meth, params, 3, g, seed=200)
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed_params = {k: nn.Parameter(v) for k, v in ckpt["params"].items()}
    resumed = method(RELEASED, resumed_params, privacy)
    resumed.load_state_dict(ckpt["method"])
    g2 = torch.Generator()
    g2.set_state(ckpt["rng"])
    _run(resumed, resumed_params, 3, g2, seed=200)
    for name in params:
        assert torch.equal(params[name], resumed_params[name]), name


def test_rank_deficient_factor_raises_or_uses_the_logged_floor(caplog: pytest.LogCaptureFixture) -> None:
    params = make_params()
    pair = lora_pairs(params)[1]
    with torch.no_grad():
        params[pair.a_name][:, 0] = params[pair.a_name][:, 1]  # A has rank r − 1
    with pytest.raises(geometry.RankDeficientError, match="m.layers.1.q_proj"):
        method(RELEASED, params, None).zero_accumulators()
    A, B = (x.detach().clone() for x in read_pair(params, pair))
    meth = method({**RELEASED, "rank_fallback": "floor"}, params, None)
    with caplog.at_level(logging.WARNING):
        meth.zero_accumulators()
    assert "m.layers.1.q_proj" in caplog.text
    A2, B2 = read_pair(params, pair)
    geometry.check_full_rank(A2, B2, pair.module)
    S = torch.linalg.svdvals(A @ B.T)
    assert (A2 @ B2.T - A @ B.T).norm() <= 1e-6 * S[0]


def test_bf16_parameters_use_float32_math_and_round_once() -> None:
    """bf16 params: the step equals the same step on float32 params holding the same values, rounded."""
    bf16 = make_params(dtype=torch.bfloat16)
    fp32 = {k: nn.Parameter(v.detach().float()) for k, v in bf16.items()}
    grads = per_example_grads(fp32, random_G(3, seed=4))
    for ps in (bf16, fp32):
        meth = method({**RELEASED, "compute_dtype": "float32"}, ps, PrivacySpec(sigma=1.0, clip_norm=1.0))
        meth.zero_accumulators()
        meth.accumulate(grads)
        meth.step(4.0, torch.Generator().manual_seed(0))
    for name in bf16:
        assert bf16[name].dtype == torch.bfloat16
        assert torch.equal(bf16[name], fp32[name].to(torch.bfloat16)), name


def test_dp_needs_per_example_grads() -> None:
    params = make_params()
    meth = method(RELEASED, params, PrivacySpec(sigma=1.0, clip_norm=1.0))
    meth.zero_accumulators()
    with pytest.raises(ValueError, match="per-example"):
        meth.accumulate({k: v[0] for k, v in per_example_grads(params, random_G(1, seed=0)).items()})


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="beta_1"):
        method({**RELEASED, "beta_1": 0.9}, make_params(), None)
    with pytest.raises(ValueError, match="horizontalize"):
        method({**RELEASED, "horizontalize": "always"}, make_params(), None)
