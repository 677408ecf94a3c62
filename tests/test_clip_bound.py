"""The DP mechanism's defects found by audit, each checked against an independent expectation.

1. The vertical (gauge) block of the privatised lift carries noise like every other linear
   statistic of the noised tangent vector (it was an exact function of the clipped sum).
2. Every clipped per-example contribution has intrinsic norm ≤ C(1 + 1e-6), measured in exact
   rational arithmetic, for factors at the rank check's admission limit.
3. An empty Poisson batch releases the noise-only step of the method (it was skipped).
4. ``privacy.log_private_stats: false`` keeps the statistics of un-noised data out of the logs.
5. ``privacy.noise_source: os`` draws the sampler's coins and the noise from the OS CSPRNG and keeps no
   RNG state in checkpoints.
"""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from prism import train as T
from prism.audit.diagnostics import sample_tangent_noise
from prism.mechanism import geometry
from prism.mechanism.lora import lora_pairs, read_pair
from prism.methods import METHODS, build_method
from prism.methods.base import PrivacySpec
from prism.privacy import Accountant
from prism.privacy.noise import SecureNoise, SeededNoise
from tests.oracles import release_lifts

F64 = torch.float64
M, N, R = 7, 6, 3

CONF = Path(__file__).resolve().parents[1] / "conf" / "method"


def method_cfg(name: str, **overrides) -> DictConfig:
    """``conf/method/<name>.yaml`` with a fixed float lr (the yaml's lr interpolates the suite)."""
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    cfg.lr = 0.05
    return OmegaConf.merge(cfg, overrides)


PRISM_VARIANTS = {
    "prism": method_cfg("prism"),
    "prism-pre_retract": method_cfg("prism", horizontalize="pre_retract"),
    "prism-none": method_cfg("prism", horizontalize="none"),
    "prism_paper": method_cfg("prism_paper"),
}


def pair_params(A: torch.Tensor, B: torch.Tensor) -> dict[str, nn.Parameter]:
    """peft names for one module: lora_B = A [m, r], lora_A = Bᵀ [r, n]."""
    return {"x.lora_A.default.weight": nn.Parameter(B.T.clone()),
            "x.lora_B.default.weight": nn.Parameter(A.clone())}


def grads_of(A: torch.Tensor, B: torch.Tensor, G: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Per-example factor grads of ⟨G_i, ABᵀ⟩ for G [k, m, n]: g_A = G B, g_Bᵀ = Aᵀ G."""
    A, B = A.to(F64), B.to(F64)
    return {"x.lora_B.default.weight": (G @ B).to(dtype), "x.lora_A.default.weight": (A.T @ G).to(dtype)}


def conditioned(rows: int, kappa: float, g: torch.Generator) -> torch.Tensor:
    """A random [rows, R] matrix with singular values log-spaced from 1 down to 1/kappa."""
    Q, _ = torch.linalg.qr(torch.randn(rows, R, generator=g, dtype=F64))
    P, _ = torch.linalg.qr(torch.randn(R, R, generator=g, dtype=F64))
    return (Q * torch.logspace(0.0, -torch.log10(torch.tensor(kappa)).item(), R, dtype=F64)) @ P.T


# ------------------------------------------------------------------------------ defect 1
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
    from prism.mechanism.adaptive import horizontal_noise_second_moments  # new with this fix

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


# ------------------------------------------------------------------------------ defect 2
def exact_sqnorm(A: torch.Tensor, B: torch.Tensor, dA: torch.Tensor, dB: torch.Tensor) -> Fraction:
    """‖ΔA Bᵀ + A ΔBᵀ‖²_F of the stored floats, in exact rational arithmetic."""
    A, B, dA, dB = ([[Fraction(float(v)) for v in row] for row in t.tolist()] for t in (A, B, dA, dB))
    total = Fraction(0)
    for i in range(len(A)):
        for j in range(len(B)):
            entry = sum(dA[i][k] * B[j][k] + A[i][k] * dB[j][k] for k in range(R))
            total += entry * entry
    return total


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


# ------------------------------------------------------------------------------ defect 3
def _tiny_params(seed: int) -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return pair_params(torch.randn(M, R, generator=g), torch.randn(N, R, generator=g))


@pytest.mark.parametrize("name", METHODS)
def test_empty_poisson_batch_releases_the_noise_only_step(name: str) -> None:
    """train_step on an empty DP batch = the method's step with nothing accumulated, noise σC/B."""
    B, sigma = 4, 1.5
    privacy = PrivacySpec(sigma=sigma, clip_norm=1.0)
    cfg = OmegaConf.create({"train": {"batch_size": B, "micro_batch_size": 2}})
    params = _tiny_params(3)
    setup = SimpleNamespace(
        sampler=SimpleNamespace(sample=lambda: torch.zeros(0, dtype=torch.long), sample_rate=0.5),
        method=build_method(method_cfg(name), params, privacy),
        accountant=Accountant(), sigma=sigma, params=params,
        noise=torch.Generator().manual_seed(5),
    )
    record = T.train_step(setup, cfg)

    twin_params = _tiny_params(3)
    twin = build_method(method_cfg(name), twin_params, privacy)
    twin.zero_accumulators()
    twin.step(float(B), torch.Generator().manual_seed(5))
    assert record["batch_size"] == 0
    assert any(not torch.equal(p, _tiny_params(3)[n]) for n, p in params.items())  # the noise moved it
    for n, p in params.items():
        torch.testing.assert_close(p, twin_params[n], rtol=0, atol=0)


def test_empty_non_dp_batch_changes_nothing() -> None:
    params = _tiny_params(4)
    before = {n: p.detach().clone() for n, p in params.items()}
    setup = SimpleNamespace(
        sampler=SimpleNamespace(sample=lambda: torch.zeros(0, dtype=torch.long), sample_rate=0.5),
        method=build_method(method_cfg("prism"), params, None), accountant=Accountant(), sigma=0.0,
        params=params, noise=torch.Generator().manual_seed(5),
    )
    assert T.train_step(setup, OmegaConf.create({"train": {"batch_size": 4, "micro_batch_size": 2}})) == {"batch_size": 0}
    assert all(torch.equal(p, before[n]) for n, p in params.items())


# ------------------------------------------------------------------------------ defects 4 and 5
def _fake_setup(params: dict[str, nn.Parameter], secure: bool = False) -> SimpleNamespace:
    """What train_step / train_and_evaluate read from a Setup, around a real method, sampler and
    accountant; per-example gradients of ⟨G_i, ABᵀ⟩ for random G_i stand in for the model."""
    from prism.privacy import PoissonSampler

    g = torch.Generator().manual_seed(9)
    A, B = (x.detach() for x in read_pair(params, lora_pairs(params)[0]))

    def gradients(indices: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        G = torch.randn(len(indices), M, N, generator=g, dtype=F64)
        return G.square().mean((1, 2)), grads_of(A, B, G, torch.float32)

    return SimpleNamespace(
        sampler=PoissonSampler(16, 4, generator_seed=1, secure=secure), accountant=Accountant(), sigma=1.0, params=params,
        method=build_method(method_cfg("prism"), params, PrivacySpec(sigma=1.0, clip_norm=1.0)),
        noise=SecureNoise() if secure else SeededNoise(torch.Generator().manual_seed(2)), gradients=gradients,
        device=torch.device("cpu"), prefix=None, suite=SimpleNamespace(train=list(range(16))), secure=secure,
    )


@pytest.mark.parametrize("log_private_stats", [True, False])
def test_log_private_stats_false_drops_unnoised_statistics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_private_stats: bool
) -> None:
    """Every record handed to the metrics/W&B writer, and final.json, lack the private statistics."""
    monkeypatch.setattr(T, "build", lambda cfg, **_: _fake_setup(_tiny_params(6)))
    monkeypatch.setattr(T, "_micro_batch", lambda s, indices, *_: indices)
    cfg = OmegaConf.create({
        "train": {"batch_size": 4, "micro_batch_size": 2, "steps": 4, "benchmark": {"warmup": 0, "measure": 4}},
        "privacy": {"epsilon": 6.0, "delta": 1e-5, "log_private_stats": log_private_stats},
        "method": {"name": "prism"},
    })
    records: list[dict] = []
    final = T.train_and_evaluate(cfg, tmp_path, records.append)
    logged = {key for record in records for key in record}
    assert len(records) == 4 and {"step", "sigma", "epsilon_spent", "update_norm"} <= logged
    private = {"loss", "clip_fraction", "grad_norm_mean", "noise_norm", "batch_size", "step_time_s"}
    if log_private_stats:
        # a benchmark run has no evaluation, hence no evaluation seconds
        assert private <= logged and set(T.PRIVATE_FINAL) - {"step_time_s", "seconds"} <= set(final)
    else:
        assert not private & logged and not set(T.PRIVATE_FINAL) & set(final)


def test_os_noise_keeps_rng_states_out_of_checkpoints() -> None:
    for is_secure in (False, True):
        s = _fake_setup(_tiny_params(7), secure=is_secure)
        state = T._state(s, 3)
        assert ("noise_rng" in state and "sampler" in state) is not is_secure
        resumed = _fake_setup(_tiny_params(7), secure=is_secure)
        T._restore(resumed, state)
        if not is_secure:  # seeded: the noise stream continues where it stopped
            assert torch.equal(resumed.noise.generator.get_state(), s.noise.generator.get_state())
