"""The privacy audit: its statistics against independent references, a reduced vertical-block audit,
and adversarial sensitivity trials of every method (the largest change one example makes to the
summed clipped contribution never exceeds C(1 + 1e-6))."""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from pipelines.__main__ import main as cli
from pipelines.verbs import audit as AU
from prism.audit.step import (
    clopper_pearson,
    dp_epsilon_lower_bound,
    gdp_delta,
    gdp_epsilon,
    gdp_mu_lower_bound,
    threshold_audit,
)
from prism.methods import build_method, registry
from prism.methods.base import CLIP_MARGIN, PrivacySpec
from tests.oracles import release_lifts

F64 = torch.float64


@pytest.mark.parametrize(("k", "n"), [(0, 50), (1, 50), (17, 40), (40, 40), (990, 1000)])
def test_clopper_pearson_matches_scipy_binomtest(k: int, n: int) -> None:
    ref = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    assert clopper_pearson(k, n, 0.95) == pytest.approx((ref.low, ref.high), abs=1e-10)


@pytest.mark.parametrize("mu", [0.5, 1.667, 3.0])
def test_gdp_delta_is_the_privacy_loss_integral_and_epsilon_inverts_it(mu: float) -> None:
    """δ(ε) = E[(1 − e^{ε−L})₊] for the Gaussian privacy loss L ~ N(μ²/2, μ²), by quadrature."""
    loss = stats.norm(mu**2 / 2, mu)
    for eps in (0.0, 0.5, 2.0):
        ref, _ = integrate.quad(lambda x, e=eps: (1 - math.exp(e - x)) * loss.pdf(x), eps, eps + 40 * mu)
        assert gdp_delta(mu, eps) == pytest.approx(ref, rel=1e-7, abs=1e-12)
    eps = gdp_epsilon(mu, 1e-5)
    assert gdp_delta(mu, eps) == pytest.approx(1e-5, rel=1e-6)


def test_bounds_follow_the_tradeoff_inequalities() -> None:
    tpr, fpr = 0.9, 0.05
    assert gdp_mu_lower_bound(tpr, fpr) == pytest.approx(stats.norm.ppf(0.9) - stats.norm.ppf(0.05))
    eps = dp_epsilon_lower_bound(tpr, fpr, 1e-5)
    assert eps == pytest.approx(max(math.log((0.9 - 1e-5) / 0.05), math.log((0.95 - 1e-5) / 0.1)))
    assert gdp_mu_lower_bound(0.3, 0.5) == 0.0 and dp_epsilon_lower_bound(0.5, 0.5, 1e-5) == 0.0


def test_threshold_audit_is_sound_and_sharp_on_gaussian_shifts() -> None:
    """N(0,1) vs N(μ,1) is exactly μ-GDP: the bound stays below μ yet comes close; a noise-free
    shift (a leak) is caught."""
    rng = np.random.default_rng(0)
    mu = 1.5
    res = threshold_audit(rng.standard_normal(4000), mu + rng.standard_normal(4000), 1e-5)
    assert mu - 0.6 < res.mu_lower <= mu
    leak = threshold_audit(np.zeros(400), np.ones(400), 1e-5)
    assert leak.mu_lower > 3.0 and leak.tpr == 1.0 and leak.fpr == 0.0


def test_reduced_vertical_block_audit_of_prism_paper() -> None:
    """The paper's eqs. 25–26 variant with the canary in the vertical block: no μ lower bound above
    1/σ and the privatised direction's SNR at 1/σ (Algorithm 1 as printed gave a μ bound ≈ 4.8)."""
    sigma = 0.6
    row = AU.audit_one("prism_paper", "vertical", draws=300, sigma=sigma, confidence=0.95)
    assert row.result.mu_lower <= 1.0 / sigma
    assert row.snr <= 1.35 / sigma


@pytest.mark.parametrize("case", ["balanced_gauge", "balanced_gauge_outside"])
def test_reduced_balanced_gauge_audit_of_prism(case: str) -> None:
    """Balanced factors with a commuting gauge canary (± a 1e-6 outside part): a norm taken as a
    difference of squares clipped it to 6.9 C (SNR ≈ 11.5, μ bound 3.5); now no μ bound above 1/σ."""
    sigma = 0.6
    row = AU.audit_one("prism", case, draws=300, sigma=sigma, confidence=0.95)
    assert row.result.mu_lower <= 1.0 / sigma
    assert math.isnan(row.snr) if case == "balanced_gauge" else row.snr <= 1.35 / sigma


def exact_image_norm(A: torch.Tensor, B: torch.Tensor, dA: torch.Tensor, dB: torch.Tensor) -> float:
    """‖ΔA Bᵀ + A ΔBᵀ‖_F of the stored floats in exact rational arithmetic."""
    A, B, dA, dB = ([[Fraction(float(v)) for v in row] for row in t.tolist()] for t in (A, B, dA, dB))
    total = Fraction(0)
    for i in range(len(A)):
        for j in range(len(B)):
            entry = sum(dA[i][k] * B[j][k] + A[i][k] * dB[j][k] for k in range(len(A[0])))
            total += entry * entry
    return float(total) ** 0.5


def _clipped_sum(name: str, case: AU.Case, gA: torch.Tensor, gB: torch.Tensor, C: float) -> list[torch.Tensor]:
    """The method's clipped sum (σ = 0 release, denominator 1): PRISM its lift (A, B factors), the
    baselines their flat factor gradients."""
    params = AU._params(case)
    method = build_method(AU.method_config(name), params, PrivacySpec(sigma=0.0, clip_norm=C))
    method.zero_accumulators()
    method.accumulate(AU._peft_grads(gA, gB))
    if name.startswith("prism"):
        return [x.to(F64) for x in release_lifts(method, 1.0)[0]["x"]]
    return [g.to(F64) for g in method.privatize(1.0, None)[0].values()]


@pytest.mark.parametrize("name", registry.names())
def test_one_example_moves_the_clipped_sum_by_at_most_C(name: str) -> None:
    """Adversarial canaries (random, vertical block, gauge, κ = 2,500 with 1e12 gradients) on top of
    three ordinary examples, gradient norms 10 … 1e12: ‖Σ with − Σ without‖ ≤ C(1 + 1e-6), in the method's
    own norm (intrinsic for PRISM, exact rational; flat factor norm for the baselines)."""
    C, worst = 0.7, 0.0
    for case_name in AU.CASES:
        case = AU.make_case(case_name)
        A, B = (x.float().to(F64) for x in (case.A, case.B))  # the float32 parameters' values
        without = _clipped_sum(name, case, *case.base, C)
        size = math.sqrt(sum(float(c.square().sum()) for c in case.canary))
        for target in (10.0, 1e6, 1e12):  # the canary's factor-gradient norm
            gA, gB = (torch.cat([b, (target / size) * c]) for b, c in zip(case.base, case.canary))
            with_ = _clipped_sum(name, case, gA, gB, C)
            diff = [w - wo for w, wo in zip(with_, without)]
            change = exact_image_norm(A, B, *diff) if name.startswith("prism") else math.sqrt(
                sum(float(d.square().sum()) for d in diff))
            worst = max(worst, change / C)
    assert worst <= 1.0 + 1e-6, worst
    assert worst >= (1 - CLIP_MARGIN) * (1 - 1e-9)  # the canaries are clipped at exactly C(1 − margin): tight


def test_audit_cli_fails_on_a_leak_and_rejects_bad_input(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A release whose canary shift is 5 noise stds (μ = 5 > 1/σ) makes `make audit` exit 1."""
    def leaky(method_name: str, case: AU.Case, with_canary: bool, draws: int, sigma: float, seed: int) -> dict:
        rng = np.random.default_rng(seed)
        return {"privatised": rng.standard_normal(draws) + (5.0 if with_canary else 0.0)}

    monkeypatch.setattr(AU, "release", leaky)
    assert cli(["audit", "draws=400", "methods=adamw", "cases=random", "workers=1"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert cli(["audit", "methods=sgd"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: methods=") and "\n" not in err
