"""The private selection's accounting (prism/privacy/selection.py, composed by dp_accounting) against
Papernot & Steinke's Thm 2 and 6 written out on this package's RDP curve (tests/oracles.py), the oracle
against the Liu & Talwar closed form and dp_accounting's δ conversion, the published σ of docs/PRIVACY.md,
the candidate count's law, and the count's sensitivity."""
from __future__ import annotations

import math

import numpy as np
import oracles
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

from prism.privacy import selection
from prism.privacy.limits import ORDERS

GLUE8 = dict(sample_rate=64 / 2000, steps=30)   # the embedded budgets (conf/suite_scale/*_embedded.yaml)
MATH = dict(sample_rate=64 / 1000, steps=15)
DELTA = 1e-5


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 2.0, math.inf])
@pytest.mark.parametrize("budget", [GLUE8, MATH], ids=["glue8", "math10k"])
@pytest.mark.parametrize("sigma,mean", [(0.8, 4.0), (1.2, 10.0)])
def test_selection_epsilon_equals_the_theorem_written_out(shape: float, budget: dict, sigma: float,
                                                          mean: float) -> None:
    ours = selection.selection_epsilon(sigma, delta=DELTA, score_sigma=5.0, mean=mean, shape=shape, **budget)
    written_out = oracles.selection_epsilon(sigma, delta=DELTA, score_sigma=5.0, mean=mean, shape=shape, **budget)
    assert ours == pytest.approx(written_out, rel=1e-6)


def test_candidate_event_composes_to_the_candidates_rdp() -> None:
    accountant = rdp_privacy_accountant.RdpAccountant(orders=[float(a) for a in ORDERS])
    accountant.compose(selection.candidate_event(0.9, 0.032, 30, 4.0))
    assert oracles.candidate_rdp(0.9, 0.032, 30, 4.0) == pytest.approx(accountant._rdp, rel=1e-9)


@pytest.mark.parametrize("suite,epsilon,published", [("glue8", 6.0, 0.738), ("glue8", 3.0, 1.032),
                                                     ("math10k", 6.0, 0.828), ("math10k", 3.0, 1.228)])
def test_calibrated_sigma_at_embedded_scale_is_the_documented_one(suite: str, epsilon: float,
                                                                   published: float) -> None:
    """docs/PRIVACY.md, "ε includes tuning": the candidate σ of the default selection (μ = 3, η = 1, σ_s = 5)."""
    budget = GLUE8 if suite == "glue8" else MATH
    sigma = selection.calibrate_candidate_sigma(epsilon, DELTA, score_sigma=5.0, mean=3.0, shape=1.0, **budget)
    assert round(sigma, 3) == published


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("mean", [1.0, 2.5, 10.0, 100.0])
def test_gamma_gives_the_mean(shape: float, mean: float) -> None:
    gamma = selection.tnb_gamma(mean, shape)
    # E[K] by summing the law P(K = k) ∝ C(k + η − 1, k)(1 − γ)^k (∝ (1 − γ)^k / k at η = 0), k ≥ 1
    k = np.arange(1, 200_000, dtype=np.float64)
    if shape == 0:
        log_w = k * math.log1p(-gamma) - np.log(k) if gamma < 1 else np.where(k == 1, 0.0, -np.inf)
    else:
        from scipy.special import gammaln
        log_w = gammaln(k + shape) - gammaln(k + 1) - gammaln(shape) + k * math.log1p(-gamma) if gamma < 1 \
            else np.where(k == 1, 0.0, -np.inf)
    w = np.exp(log_w - log_w.max())
    assert float((k * w).sum() / w.sum()) == pytest.approx(mean, rel=1e-6)


def test_geometric_selection_of_pure_dp_candidates_is_liu_talwar_3_epsilon() -> None:
    """Liu & Talwar (2019), Thm 3.4: with ``K`` geometric, the best of ε-DP candidates is 3ε-DP.

    A pure ε-DP candidate has RDP at most ε at every order. Thm 2 at ``η = 1`` then tends, as the
    orders grow, to ``ε + 2 min_λ̂ [(1 − 1/λ̂) ε + log(μ)/λ̂]``: exactly ``3ε`` when ``log μ > ε`` (the
    minimum is at ``λ̂ → ∞``), below it otherwise; never above ``3ε``.
    """
    eps = 0.7
    orders = np.array([2.0**i for i in range(1, 40)])
    for mean in (1.5, 2.0, 10.0, 1000.0):
        out = oracles.repeat_and_select_rdp(np.full(orders.shape, eps), mean, 1.0, orders)
        assert out[-1] <= 3 * eps + 1e-9
        assert np.all(out >= eps)
        if math.log(mean) > eps:
            assert out[-1] == pytest.approx(3 * eps, rel=1e-6)


def test_calibrated_sigma_meets_the_target_and_no_smaller_sigma_does() -> None:
    kwargs = dict(score_sigma=5.0, mean=4.0, shape=math.inf, **GLUE8)
    sigma = selection.calibrate_candidate_sigma(6.0, DELTA, **kwargs)
    assert oracles.selection_epsilon(sigma, delta=DELTA, **kwargs) <= 6.0 * (1 + 1e-6)
    assert selection.selection_epsilon(sigma * (1 - 1e-4), delta=DELTA, **kwargs) > 6.0


def test_unreachable_target_names_its_floor() -> None:
    with pytest.raises(ValueError, match="out of reach"):
        selection.calibrate_candidate_sigma(0.05, DELTA, score_sigma=1.0, mean=10.0, shape=1.0, **GLUE8)


def test_the_oracles_delta_from_rdp_equals_dp_accounting() -> None:
    rdp = oracles.candidate_rdp(0.9, 0.032, 30, 4.0)
    for eps in (0.5, 2.0, 6.0):
        theirs, _ = rdp_privacy_accountant.compute_delta(list(map(float, ORDERS)), list(rdp), eps)
        assert oracles.delta_from_rdp(rdp, eps) == pytest.approx(theirs, rel=1e-9)


@pytest.mark.parametrize("shape", [0.0, 1.0, 2.0, math.inf])
def test_candidate_count_draws_have_the_mean(shape: float) -> None:
    rng = np.random.default_rng(0)
    draws = np.array([selection.draw_candidate_count(rng, 4.0, shape) for _ in range(4_000)])
    assert draws.mean() == pytest.approx(4.0, abs=4 * draws.std() / math.sqrt(draws.size))
    if shape != math.inf:
        assert draws.min() >= 1


def test_noised_count_moves_by_at_most_one_when_a_row_is_added_or_removed() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        correct = rng.integers(0, 2, size=int(rng.integers(1, 60)))
        removed = np.delete(correct, int(rng.integers(0, correct.size)))
        added = np.append(correct, int(rng.integers(0, 2)))
        base = selection.noised_count(correct, 2.0, np.random.default_rng(9))
        for neighbour in (removed, added):
            # the same noise draw: the counts differ by exactly the moved row's 0 or 1
            assert abs(selection.noised_count(neighbour, 2.0, np.random.default_rng(9)) - base) <= 1.0 + 1e-9


def test_noised_count_refuses_scores_outside_zero_one() -> None:
    with pytest.raises(ValueError, match="0 or 1"):
        selection.noised_count(np.array([0.5, 1.0]), 1.0, np.random.default_rng(0))
