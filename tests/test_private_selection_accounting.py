"""The private selection's accounting (prism/privacy/selection.py) against dp_accounting's own
repeat-and-select composition, the Liu & Talwar closed form, and the count's sensitivity."""
from __future__ import annotations

import math

import numpy as np
import pytest

from prism.privacy import selection
from prism.privacy.limits import ORDERS

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting import dp_event  # noqa: E402
from dp_accounting.rdp import rdp_privacy_accountant  # noqa: E402

GLUE8 = dict(sample_rate=64 / 2000, steps=30)   # the embedded budgets (conf/suite_scale/*_embedded.yaml)
MATH = dict(sample_rate=64 / 1000, steps=15)
DELTA = 1e-5


def _their_epsilon(sigma: float, sample_rate: float, steps: int, score_sigma: float, mean: float,
                   shape: float) -> float:
    """The same selection, composed and converted by dp_accounting's RDP accountant."""
    candidate = dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(sample_rate, dp_event.GaussianDpEvent(sigma)), steps),
        dp_event.GaussianDpEvent(score_sigma),
    ])
    accountant = rdp_privacy_accountant.RdpAccountant(orders=[float(a) for a in ORDERS])
    accountant.compose(dp_event.RepeatAndSelectDpEvent(candidate, mean, shape))
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 2.0, math.inf])
@pytest.mark.parametrize("budget", [GLUE8, MATH], ids=["glue8", "math10k"])
@pytest.mark.parametrize("sigma,mean", [(0.8, 4.0), (1.2, 10.0)])
def test_selection_epsilon_equals_dp_accounting(shape: float, budget: dict, sigma: float, mean: float) -> None:
    ours = selection.selection_epsilon(sigma, delta=DELTA, score_sigma=5.0, mean=mean, shape=shape, **budget)
    theirs = _their_epsilon(sigma, score_sigma=5.0, mean=mean, shape=shape, **budget)
    assert ours == pytest.approx(theirs, rel=1e-6)


def test_candidate_rdp_equals_dp_accounting_composition() -> None:
    accountant = rdp_privacy_accountant.RdpAccountant(orders=[float(a) for a in ORDERS])
    accountant.compose(dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.032, dp_event.GaussianDpEvent(0.9)), 30),
        dp_event.GaussianDpEvent(4.0),
    ]))
    assert selection.candidate_rdp(0.9, 0.032, 30, 4.0) == pytest.approx(accountant._rdp, rel=1e-9)


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
        out = selection.repeat_and_select_rdp(np.full(orders.shape, eps), mean, 1.0, orders)
        assert out[-1] <= 3 * eps + 1e-9
        assert np.all(out >= eps)
        if math.log(mean) > eps:
            assert out[-1] == pytest.approx(3 * eps, rel=1e-6)


def test_calibrated_sigma_meets_the_target_and_no_smaller_sigma_does() -> None:
    kwargs = dict(score_sigma=5.0, mean=4.0, shape=math.inf, **GLUE8)
    sigma = selection.calibrate_candidate_sigma(6.0, DELTA, **kwargs)
    assert _their_epsilon(sigma, score_sigma=5.0, mean=4.0, shape=math.inf, **GLUE8) <= 6.0 * (1 + 1e-6)
    assert selection.selection_epsilon(sigma * (1 - 1e-4), delta=DELTA, **kwargs) > 6.0


def test_unreachable_target_names_its_floor() -> None:
    with pytest.raises(ValueError, match="out of reach"):
        selection.calibrate_candidate_sigma(0.05, DELTA, score_sigma=1.0, mean=10.0, shape=1.0, **GLUE8)


def test_delta_from_rdp_equals_dp_accounting() -> None:
    rdp = selection.candidate_rdp(0.9, 0.032, 30, 4.0)
    for eps in (0.5, 2.0, 6.0):
        theirs, _ = rdp_privacy_accountant.compute_delta(list(map(float, ORDERS)), list(rdp), eps)
        assert selection.delta_from_rdp(rdp, eps) == pytest.approx(theirs, rel=1e-9)


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
