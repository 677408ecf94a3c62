"""One-run ε lower bound (prism.audit.one_run) against scipy, exact arithmetic and simulated mechanisms.

Independent expectations: scipy's binomial law and exact rational sums for the tails; the theorem's
bound written out term by term from its statement (Steinke, Nasr & Jagielski 2023, main theorem:
max over i = 1..m) for the δ term; the closed form of the perfect-guess bound (δ = 0, v = r:
``p_ε^r = β``); and simulations of mechanisms whose privacy is known exactly (ε-DP randomised response,
where the bound is nearly tight, and the Gaussian mechanism, ε from its GDP curve).
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import optimize, stats

from prism.audit.one_run import (
    _upper_tail,
    audit,
    dpsgd_canary_scores,
    epsilon_lower_bound,
    fdp_lower_bound,
    fdp_rejects,
    gaussian_curve,
    p_value,
    pure_dp_curve,
    split_audit,
    top_bottom_guesses,
)
from prism.audit.step import gdp_epsilon


def binomial_upper_tail(r: int, p: float, v: int) -> float:
    """``P[Bin(r, p) ≥ v]`` for ``0 < p < 1`` by the bound's own log-space tail."""
    return _upper_tail(r, v, math.log(p), math.log1p(-p))


@pytest.mark.parametrize("r,p", [(1, 0.5), (17, 0.3), (100, 0.73), (1000, 0.999), (1000, 1e-3)])
def test_upper_tail_matches_scipy(r, p):
    for v in sorted({0, 1, r // 3, r // 2, r - 1, r, r + 1}):
        assert binomial_upper_tail(r, p, v) == pytest.approx(float(stats.binom.sf(v - 1, r, p)), rel=1e-9, abs=1e-300)


def test_upper_tail_matches_exact_rationals():
    p = Fraction(5, 7)
    for r in (1, 6, 13):
        for v in range(r + 2):
            exact = sum(math.comb(r, k) * p**k * (1 - p) ** (r - k) for k in range(v, r + 1))
            assert binomial_upper_tail(r, 5 / 7, v) == pytest.approx(float(exact), rel=1e-12)


def _theorem_bound(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """The main theorem's right-hand side from its statement, with scipy: f(v) + 2mδ max_{1≤i≤m} (f(v−i) − f(v))/i."""
    p = math.exp(eps) / (1 + math.exp(eps))
    f = lambda x: float(stats.binom.sf(x - 1, r, p))  # noqa: E731  P[Bin(r, p) ≥ x]
    return min(1.0, f(v) + 2 * m * delta * max((f(v - i) - f(v)) / i for i in range(1, m + 1)))


@pytest.mark.parametrize("m,r,v,eps,delta", [(50, 20, 15, 1.0, 1e-3), (200, 200, 150, 0.5, 1e-4),
                                             (1000, 100, 90, 2.0, 1e-5), (30, 30, 30, 4.0, 1e-2), (40, 10, 0, 1.0, 1e-3)])
def test_p_value_is_the_theorem_bound(m, r, v, eps, delta):
    assert p_value(m, r, v, eps, delta) == pytest.approx(_theorem_bound(m, r, v, eps, delta), rel=1e-9)


@pytest.mark.parametrize("r", [5, 50, 500])
def test_perfect_guesses_closed_form(r):
    beta = 0.05
    p = beta ** (1 / r)  # the smallest p_ε with P[Bin(r, p) ≥ r] = p^r > β
    assert epsilon_lower_bound(r, r, r, delta=0.0, confidence=1 - beta) == pytest.approx(math.log(p / (1 - p)), abs=1e-5)


def test_bound_is_the_boundary_of_the_rejected_set():
    m, r, v, delta = 1000, 300, 230, 1e-5
    eps = epsilon_lower_bound(m, r, v, delta)
    assert p_value(m, r, v, eps, delta) <= 0.05 < p_value(m, r, v, eps + 1e-5, delta)
    grid = np.linspace(0, 5, 400)  # monotone in ε (module docstring: 2mδ ≤ 1)
    assert np.all(np.diff([p_value(m, r, v, e, delta) for e in grid]) >= -1e-12)
    assert epsilon_lower_bound(m, r, r // 2, delta) == 0.0  # chance accuracy proves nothing


def test_refuses_a_non_monotone_delta_term():
    with pytest.raises(ValueError, match="2·m·δ"):
        epsilon_lower_bound(100_000, 10, 10, delta=1e-5)
    with pytest.raises(ValueError, match="correct"):
        epsilon_lower_bound(10, 5, 6)


def test_randomised_response_coverage_is_tight():
    """ε-DP randomised response, every canary guessed by its response: W ~ Bin(m, p_ε) exactly, the
    theorem's worst case. The bound may exceed ε with probability ≤ β = 5 %, and at m = 1,000 it comes
    close to that rate (a needlessly conservative bound would not)."""
    rng = np.random.default_rng(0)
    m, eps, trials = 1000, 1.0, 600
    p = math.exp(eps) / (1 + math.exp(eps))
    values, counts = np.unique(rng.binomial(m, p, size=trials), return_counts=True)
    over = sum(c for v, c in zip(values, counts) if epsilon_lower_bound(m, m, int(v), delta=0.0) > eps) / trials
    assert 0.02 < over <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    # the same guesses from a mechanism 0.4 above its claim: caught most of the time
    p_bad = math.exp(eps + 0.4) / (1 + math.exp(eps + 0.4))
    caught = np.mean([epsilon_lower_bound(m, m, int(v), delta=0.0) > eps for v in rng.binomial(m, p_bad, size=20)])
    assert caught > 0.9


def _gaussian_trial(rng, m, sigma, k):
    included = rng.random(m) < 0.5
    scores = included + sigma * rng.standard_normal(m)  # one Gaussian mechanism per canary, sensitivity 1
    return audit(scores, included, k, k)


def _top_k_precision(sigma: float, share: float) -> float:
    """P(in | score > t) for m → ∞, with ``t`` exceeded by ``share`` of the ½-½ mixture of N(1, σ²), N(0, σ²)."""
    above = lambda t: 0.5 * (stats.norm.sf((t - 1) / sigma) + stats.norm.sf(t / sigma)) - share  # noqa: E731
    t = optimize.brentq(above, -10, 10)
    return stats.norm.sf((t - 1) / sigma) / (stats.norm.sf((t - 1) / sigma) + stats.norm.sf(t / sigma))


def test_idealised_gaussian_mechanisms_never_exceed_true_epsilon():
    """The idealised setting of Steinke, Nasr & Jagielski (2023, §7): m independent Gaussian mechanisms,
    each canary in with probability ½, guesses on the k⁺ = k⁻ = k extreme scores. The mechanism is
    (ε, 1e-5)-DP with ε from its GDP curve (μ = 1/σ). Over repeated trials the bound never exceeds ε
    more often than β allows, and the number of correct guesses and the average bound match those of
    the closed-form precision of the top-k test, ``Φ̄((t − 1)/σ) / (Φ̄((t − 1)/σ) + Φ̄(t/σ))`` with the
    threshold ``t`` that k/m of the scores exceed (m → ∞)."""
    rng = np.random.default_rng(1)
    m, k, trials = 1000, 50, 60
    for sigma in (0.5, 1.0):
        eps_true = gdp_epsilon(1 / sigma, 1e-5)
        results = [_gaussian_trial(rng, m, sigma, k) for _ in range(trials)]
        assert np.mean([r.epsilon_lower > eps_true for r in results]) <= 0.05
        precision = _top_k_precision(sigma, k / m)
        expected = epsilon_lower_bound(m, 2 * k, round(2 * k * precision))
        assert np.mean([r.correct for r in results]) == pytest.approx(2 * k * precision, rel=0.05)
        assert np.mean([r.epsilon_lower for r in results]) == pytest.approx(expected, abs=0.35)
        assert expected < eps_true


def test_top_bottom_guesses_against_sorting():
    rng = np.random.default_rng(2)
    scores = rng.integers(0, 5, size=40).astype(float)  # many ties
    g = top_bottom_guesses(scores, 7, 5)
    assert (g == 1).sum() == 7 and (g == -1).sum() == 5
    assert scores[g == 1].min() >= np.sort(scores)[-7] and scores[g == -1].max() <= np.sort(scores)[4]
    assert scores[g == 1].min() >= scores[g == 0].max() >= scores[g == 0].min() >= scores[g == -1].max()
    with pytest.raises(ValueError):
        top_bottom_guesses(scores, 30, 11)


def test_split_audit_never_sees_the_second_half():
    rng = np.random.default_rng(3)
    m = 400
    included = rng.random(m) < 0.5
    scores = included + 0.4 * rng.standard_normal(m)
    candidates = [(k, k) for k in (5, 20, 80)]
    result = split_audit(scores, included, candidates)
    flipped = included.copy()
    flipped[m // 2:] = ~flipped[m // 2:]  # the second half's coins change the count, never the choice
    assert (split_audit(scores, flipped, candidates).k_pos, result.k_pos) == (result.k_pos, result.k_pos)
    best = max(candidates, key=lambda k: audit(scores[: m // 2], included[: m // 2], *k).epsilon_lower)
    assert result == audit(scores[m // 2:], included[m // 2:], *best)
    assert result.canaries == m - m // 2 and result.epsilon_lower > 1.0  # σ = 0.4: a strong signal


def test_dpsgd_scores_moments():
    """Mean qT and variance qT(1−q) + σ²T for included canaries; mean 0, variance σ²T otherwise."""
    rng = np.random.default_rng(4)
    included = np.arange(200_000) % 2 == 0
    q, T, sigma = 0.05, 30, 0.8
    s = dpsgd_canary_scores(included, q, T, sigma, rng)
    assert s[included].mean() == pytest.approx(q * T, abs=0.02)
    assert s[included].var() == pytest.approx(q * T * (1 - q) + sigma**2 * T, rel=0.02)
    assert s[~included].mean() == pytest.approx(0.0, abs=0.03)
    assert s[~included].var() == pytest.approx(sigma**2 * T, rel=0.02)


def test_fdp_recursion_with_the_pure_dp_curve_is_the_binomial_bound():
    """Mahloujifar, Melis & Chaudhuri (2025) generalise Steinke, Nasr & Jagielski (2023): with the ε-DP
    trade-off curve their recursion must give (up to its discretisation) the δ = 0 binomial bound."""
    for m, k, v in [(1000, 100, 100), (1000, 100, 90), (1000, 1000, 700), (200, 50, 45), (1000, 300, 230)]:
        fdp = fdp_lower_bound(m, k, v, pure_dp_curve, tol=1e-5)
        binomial = epsilon_lower_bound(m, k, v, delta=0.0)
        assert fdp == pytest.approx(binomial, abs=0.03) and fdp <= binomial + 1e-4


def test_fdp_coverage_on_randomised_response():
    """The pure-DP curve on its worst case (randomised response, W ~ Bin(k, p_ε)): rejection of the true ε
    at most β = 5 % of the time, and close to it."""
    rng = np.random.default_rng(6)
    m, eps, trials = 1000, 1.0, 400
    p = math.exp(eps) / (1 + math.exp(eps))
    values, counts = np.unique(rng.binomial(m, p, size=trials), return_counts=True)
    over = sum(c for v, c in zip(values, counts) if fdp_lower_bound(m, m, int(v), pure_dp_curve, tol=1e-4) > eps)
    assert 0.015 < over / trials <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)


def test_gdp_bound_on_gaussian_mechanisms():
    """Idealised Gaussian mechanisms (μ = 1/σ exactly, their trade-off curve is f_μ): the μ bound never
    exceeds μ more often than β, is monotone in μ, and its ε (GDP curve at δ) is above the binomial
    bound on the same guesses on average (the tighter bound Mahloujifar et al. report)."""
    rng = np.random.default_rng(7)
    m, k = 1000, 100
    for sigma in (0.5, 1.0):
        results = []
        for _ in range(20):
            included = rng.random(m) < 0.5
            results.append(audit(included + sigma * rng.standard_normal(m), included, k, 0))
        mus = np.array([r.mu_lower for r in results])
        assert np.mean(mus > 1 / sigma) <= 0.05
        gdp_eps = np.mean([gdp_epsilon(mu, 1e-5) if mu > 0 else 0.0 for mu in mus])
        assert gdp_eps > np.mean([r.epsilon_lower for r in results])
    rejected = [fdp_rejects(m, k, 80, gaussian_curve(mu), 0.05) for mu in np.linspace(0.01, 3, 300)]
    assert rejected == sorted(rejected, reverse=True)  # True up to the bound, then False


def test_filtered_scores_see_hits_through_drift_and_unequal_blocks():
    """Per-step scores with a slow drift per canary, ten times larger on one block than the other, and
    one-step hits of size 1: the summed scores mistake the drift for hits, the filtered ones find the hits."""
    from prism.audit.one_run import filtered_scores

    rng = np.random.default_rng(0)
    m, steps = 4000, 30
    block = np.arange(m) % 2
    included = rng.random(m) < 0.5
    hits = (rng.random((steps, m)) < 0.05) * included
    drift = np.linspace(0, 1, steps)[:, None] * rng.standard_normal(m) * np.where(block == 1, 10.0, 1.0)
    trace = hits + drift + 0.05 * rng.standard_normal((steps, m))
    top = np.argsort(-filtered_scores(trace, block))[:400]
    assert included[top].all()
    assert not included[np.argsort(-trace.sum(0))[:400]].all()
