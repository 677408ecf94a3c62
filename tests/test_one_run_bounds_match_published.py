"""One-run bounds (prism.audit.one_run) against published numbers.

Independent expectations, all computed by other people:

* the golden values of the jax_privacy library's (Google DeepMind, 2025) test of its one-run
  auditor (``CanaryScoreAuditor.epsilon_one_run`` and ``epsilon_one_run_fdp``): the Steinke, Nasr &
  Jagielski (2023) ε bound and the Mahloujifar, Melis & Chaudhuri (2025) f-DP ε bound for 10,000
  "in" and 10,000 "out" scores, published to a relative tolerance of 1e-5 and reproduced here to it;
* Mahloujifar, Melis & Chaudhuri (2025, ICML), Table 1: the idealised Gaussian game, whose
  "theoretical ε" column is reproduced exactly and whose two empirical columns are reproduced only
  partly (see :func:`test_mahloujifar_table1_empirical_columns` for what differs and why).

Only the project's functions compute bounds here; the tests supply the set-up (scores, guess counts,
the search over the number of guesses) and the published numbers.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from scipy import optimize, special, stats

from prism.audit.one_run import (
    epsilon_lower_bound,
    fdp_lower_bound,
    fdp_rejects,
    gaussian_curve,
    p_value,
)
from prism.audit.step import gdp_epsilon

Counts = tuple[int, int]  # (guesses, correct guesses)


def _best_over_guesses(candidates: Sequence[Counts], rejects: Callable[[int, int, float], bool],
                       bound: Callable[[int, int], float]) -> tuple[float, Counts]:
    """The largest ``bound(r, v)`` over ``candidates`` and its ``(r, v)``.

    Each bound is the right end of the interval ``[0, bound]`` of rejected parameters, so a candidate
    that does not reject the best parameter found so far cannot beat it and is skipped after one test;
    the maximum is exact, only cheaper than evaluating every candidate in full.
    """
    best, arg = 0.0, (0, 0)
    for r, v in candidates:
        if rejects(r, v, best):
            value = bound(r, v)
            if value > best:
                best, arg = value, (r, v)
    return best, arg


# --- jax_privacy golden values ---------------------------------------------------------------------

JAX_N = 10_000
JAX_SIGNIFICANCE = 0.05
JAX_DELTA = 1e-6
# shift: (Steinke et al. ε bound, f-DP ε bound), relative tolerance 1e-5 in jax_privacy's test
JAX_GOLDEN = {0.0: (0.0, 0.0), 1.0: (1.13346, 2.164749), 2.0: (2.311945, 4.7218075), 4.0: (4.395568, 9.133752)}


def _deterministic_normal(mean: float, n: int) -> np.ndarray:
    """The ``n`` mid-quantiles ``Φ⁻¹((i + ½)/n) + mean``: scores "deterministically" distributed as N(mean, 1)."""
    return stats.norm.ppf((np.arange(n) + 0.5) / n) + mean


def _roc_hull(in_scores: np.ndarray, out_scores: np.ndarray) -> list[Counts]:
    """``(guesses, correct)`` of the threshold tests "score ≥ t ⇒ in" on the vertices of the ROC's upper
    concave hull, ``t`` over every distinct score and +∞ (collinear and dominated thresholds dropped)."""
    thresholds = np.concatenate([[np.inf], np.unique(np.concatenate([in_scores, out_scores]))[::-1]])
    tp = len(in_scores) - np.searchsorted(np.sort(in_scores), thresholds, side="left")
    fp = len(out_scores) - np.searchsorted(np.sort(out_scores), thresholds, side="left")
    hull: list[tuple[int, int]] = []  # (fp, tp), fp non-decreasing
    for point in zip(fp.tolist(), tp.tolist()):
        while len(hull) >= 2:
            (x0, y0), (x1, y1) = hull[-2], hull[-1]
            if (x1 - x0) * (point[1] - y0) - (y1 - y0) * (point[0] - x0) < 0:
                break
            hull.pop()
        hull.append(point)
    return [(f + t, t) for f, t in hull]


@pytest.fixture(scope="module", params=sorted(JAX_GOLDEN))
def jax_setting(request: pytest.FixtureRequest) -> tuple[float, list[Counts], float]:
    """A shift, its candidate ``(guesses, correct)`` (hull vertices better than chance) and the
    Bonferroni-split significance."""
    shift = request.param
    hull = _roc_hull(_deterministic_normal(shift, JAX_N), _deterministic_normal(0.0, JAX_N))
    return shift, [(r, v) for r, v in hull if r > 0 and 2 * v > r], JAX_SIGNIFICANCE / len(hull)


def test_jax_privacy_golden_steinke_bound(jax_setting: tuple[float, list[Counts], float]) -> None:
    """jax_privacy's golden Steinke et al. (2023) bounds, reproduced to their tolerance (rel 1e-5).

    Set-up of that test, rebuilt here: "in" and "out" scores are the 10,000 mid-quantiles of
    N(shift, 1) and N(0, 1); m = 20,000 canaries; guesses are "in" only, for every score ≥ a threshold
    (k⁻ = 0); thresholds run over every distinct score, restricted to the vertices of the ROC's upper
    concave hull, and the significance 0.05 is Bonferroni-split over those vertices (the library's
    default threshold strategy); the reported bound is the maximum over the vertices at δ = 1e-6.
    """
    shift, candidates, beta = jax_setting
    m = 2 * JAX_N
    eps, _ = _best_over_guesses(
        candidates,
        lambda r, v, e: p_value(m, r, v, e, JAX_DELTA) <= beta,
        lambda r, v: epsilon_lower_bound(m, r, v, JAX_DELTA, 1.0 - beta, tol=1e-8),
    )
    assert eps == pytest.approx(JAX_GOLDEN[shift][0], rel=1e-5, abs=1e-9)


def test_jax_privacy_golden_fdp_bound(jax_setting: tuple[float, list[Counts], float]) -> None:
    """jax_privacy's golden f-DP bounds (Mahloujifar, Melis & Chaudhuri 2025), reproduced to rel 1e-5.

    Same set-up as the Steinke test. The library's f-DP "ε" is the ε whose Gaussian mechanism (the
    σ with (ε, δ) on its exact curve) has a rejected trade-off curve, maximised over thresholds; that
    is ``gdp_epsilon(μ*, δ)`` of the project's largest rejected μ, ``μ* = fdp_lower_bound(...)``
    (μ ↦ ε at fixed δ is increasing), so the two quantities are the same.
    """
    shift, candidates, beta = jax_setting
    m = 2 * JAX_N
    mu, _ = _best_over_guesses(
        candidates,
        lambda r, v, mu: fdp_rejects(m, r, v, gaussian_curve(mu), beta),
        lambda r, v: fdp_lower_bound(m, r, v, gaussian_curve, 1.0 - beta, tol=1e-9),
    )
    eps = gdp_epsilon(mu, JAX_DELTA) if mu > 0 else 0.0
    assert eps == pytest.approx(JAX_GOLDEN[shift][1], rel=1e-5, abs=1e-9)


# --- Mahloujifar, Melis & Chaudhuri (2025), Table 1 --------------------------------------------------

TABLE1_DELTA = 1e-5
TABLE1_CONFIDENCE = 0.95
# σ: (m, theoretical ε, Steinke et al. bound, f-DP bound), as printed (2 decimals, truncated: see below)
TABLE1 = {0.5: (100_000, 9.99, 4.99, 8.16), 1.0: (100_000, 4.37, 2.61, 3.61), 2.0: (100_000, 1.99, 1.33, 1.59),
          4.0: (1_000_000, 0.92, 0.61, 0.82)}


def _gaussian_mechanism_epsilon(sigma: float, delta: float) -> float:
    """Exact ε at δ of the Gaussian mechanism with sensitivity 1 and noise σ (Balle & Wang 2018, Thm 8):
    the root of ``Φ(1/(2σ) − εσ) − e^ε Φ(−1/(2σ) − εσ) = δ``."""
    def excess(eps: float) -> float:
        return float(stats.norm.cdf(0.5 / sigma - eps * sigma)
                      - math.exp(eps) * stats.norm.cdf(-0.5 / sigma - eps * sigma)) - delta
    return float(optimize.brentq(excess, 0.0, 100.0, xtol=1e-12))


@pytest.mark.parametrize("sigma", sorted(TABLE1))
def test_mahloujifar_table1_theoretical_epsilon(sigma: float) -> None:
    """The "theoretical ε" column: the printed figures are the exact values truncated to 2 decimals
    (9.997 → 9.99, 4.377 → 4.37, 0.926 → 0.92; rounding would print 10.00, 4.38, 0.93), and the
    project's GDP conversion (μ = 1/σ) is the same curve."""
    eps = _gaussian_mechanism_epsilon(sigma, TABLE1_DELTA)
    assert math.floor(100 * eps) / 100 == pytest.approx(TABLE1[sigma][1], abs=1e-9)
    assert gdp_epsilon(1 / sigma, TABLE1_DELTA) == pytest.approx(eps, rel=1e-8)


def _expected_counts(m: int, sigma: float, k: int) -> Counts:
    """Expected guesses and correct guesses (rounded) of the idealised game with ``k`` guesses per side.

    m canaries, coins ½-½; canary i's coordinate is its coin (0/1) plus N(0, σ²). The ``k`` highest
    coordinates are guessed "in", the ``k`` lowest "out"; as m → ∞ they are those beyond the thresholds
    ``±t + ½ ± ½`` that k/m of the coordinates exceed. Expected correct "in" guesses:
    ``(m/2) Φ̄((t − 1)/σ)``; by the symmetry of the game the "out" side has the same count.
    """
    t = optimize.brentq(lambda x: 0.5 * m * (special.ndtr((1 - x) / sigma) + special.ndtr(-x / sigma)) - k, -60, 60)
    return 2 * k, 2 * round(0.5 * m * float(special.ndtr((1 - t) / sigma)))


def _steinke_bound_any_m(m: int, r: int, v: int) -> float:
    """The Steinke et al. (2023) bound by bisection on the project's :func:`p_value`.

    :func:`epsilon_lower_bound` refuses 2mδ > 1 (here 2) because its proof that the p-value is monotone
    in ε needs 2mδ ≤ 1; the theorem itself holds for any δ. The inversion is checked to be well defined
    for these counts: the p-value is non-decreasing on a grid over [0, 2·bound].
    """
    beta = 1.0 - TABLE1_CONFIDENCE
    lo, hi = 0.0, 16.0
    if p_value(m, r, v, lo, TABLE1_DELTA) > beta:
        return 0.0
    while hi - lo > 1e-6:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if p_value(m, r, v, mid, TABLE1_DELTA) <= beta else (lo, mid)
    curve = [p_value(m, r, v, e, TABLE1_DELTA) for e in np.linspace(0.0, 2.0 * lo, 101)]
    assert np.all(np.diff(curve) >= -1e-12)
    return lo


def _table1_row(sigma: float) -> tuple[float, float, float]:
    """Our (Steinke et al. bound, f-DP ε bound with guesses on both sides, f-DP ε bound with "in" guesses
    only), each maximised over k = 60 geometrically spaced guess counts per side from 30 to 10,000."""
    m = TABLE1[sigma][0]
    beta = 1.0 - TABLE1_CONFIDENCE
    grid = sorted({int(k) for k in np.geomspace(30, 10_000, 60).round()})
    two_sided = [_expected_counts(m, sigma, k) for k in grid]
    one_sided = [(r // 2, v // 2) for r, v in two_sided]
    steinke, (r, v) = _best_over_guesses(two_sided, lambda r, v, e: p_value(m, r, v, e, TABLE1_DELTA) <= beta,
                                         lambda r, v: _steinke_bound_any_m(m, r, v))
    assert grid[0] < r // 2 < grid[-1]  # an interior optimum: the grid brackets it

    def rejects(r: int, v: int, mu: float) -> bool:
        return fdp_rejects(m, r, v, gaussian_curve(mu), beta)

    def mu_bound(r: int, v: int) -> float:
        return fdp_lower_bound(m, r, v, gaussian_curve, TABLE1_CONFIDENCE, tol=1e-6)

    mu_two, _ = _best_over_guesses(two_sided, rejects, mu_bound)
    mu_one, _ = _best_over_guesses(one_sided, rejects, mu_bound)
    return steinke, gdp_epsilon(mu_two, TABLE1_DELTA), gdp_epsilon(mu_one, TABLE1_DELTA)


@pytest.mark.parametrize("sigma", [1.0, 2.0])
def test_mahloujifar_table1_empirical_columns(sigma: float) -> None:
    """Table 1's σ = 1 and σ = 2 rows (m = 100,000, δ = 1e-5, 95 %), expected counts in closed form.

    Reproduced only partly, at the tolerances asserted below (not the 2-decimal rounding):

    * Steinke et al. column: our best over k⁺ = k⁻ = k is 2.67 (σ = 1; printed 2.61) and 1.29 (σ = 2;
      printed 1.33), a gap of ≤ 0.06 in opposite directions. No single variation of the set-up found
      closes both: "in"-only guesses (2.47, 1.19), the δ term with mδ instead of 2mδ (2.82, 1.35), and a
      coarser k grid can only lower a row. The bound function is not in question (it matches
      jax_privacy's golden values above); the game's exact parameters behind the table are.
    * f-DP column: the project's recursion gives 3.38 (σ = 1; printed 3.61) and 1.50 (σ = 2; printed
      1.59) with guesses on both sides, 3.10 and 1.38 with "in" guesses only (the only form the
      project's :func:`audit` uses). The recursion is the one that reproduces jax_privacy's golden f-DP
      values to 1e-6, so the table's column comes from a tighter computation than that published
      implementation; what is asserted is the comparable part: ours is not above the printed value
      (a weaker bound on the same game), above the Steinke bound on the same game, and below the
      true ε.

    What is compared is one quantity on both sides: the f-DP column is an ε, the ε at δ of the
    Gaussian mechanism whose trade-off curve is rejected, i.e. ``gdp_epsilon(μ*, δ)`` of the project's
    largest rejected μ (μ ↦ ε is increasing at fixed δ). The both-sided figure feeds guesses of both
    signs to the recursion, as in the game of Steinke et al. (the Gaussian curve is symmetric: an "out"
    guess on a low score is an "in" guess with the roles of the two coin values exchanged); the
    project's :func:`audit` uses "in" guesses only, hence both figures.
    """
    _, _, printed_steinke, printed_fdp = TABLE1[sigma]
    steinke, fdp_two, fdp_one = _table1_row(sigma)
    assert steinke == pytest.approx(printed_steinke, abs=0.06)
    assert fdp_one < fdp_two <= printed_fdp + 0.01
    assert steinke < fdp_two < _gaussian_mechanism_epsilon(sigma, TABLE1_DELTA)
