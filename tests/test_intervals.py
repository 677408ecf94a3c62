"""pipelines.tables.intervals against closed forms, scipy and brute-force references."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats
from sklearn.metrics import matthews_corrcoef

from pipelines.tables import intervals as iv
from prism.evaluation.metrics import glue_score, row_outcomes, score_outputs
from prism.record import FinalRecord, Outcome


def two_way_variance(x: np.ndarray) -> float:
    """Closed form of the variance of the mean of an S×n matrix under independent resampling of its
    rows (seeds) and columns (evaluation rows): mean(α²)/S + mean(β²)/n + mean(γ²)/(S·n)."""
    s, n = x.shape
    mu = x.mean()
    alpha = x.mean(axis=1) - mu
    beta = x.mean(axis=0) - mu
    gamma = x - mu - alpha[:, None] - beta[None, :]
    return float((alpha ** 2).mean() / s + (beta ** 2).mean() / n + (gamma ** 2).mean() / (s * n))


def _finals(x: np.ndarray, rows: str = "rows-a", column: str = "SST-2") -> list[FinalRecord]:
    return [FinalRecord.from_json({"columns": {column: float(r.mean())}, "per_example": {
        "t": {"column": column, "correct": r.astype(int).tolist(), "rows": rows}}}) for r in x]


def test_bootstrap_over_rows_and_seeds_matches_the_closed_form_variance() -> None:
    rng = np.random.default_rng(0)
    seed_effect = np.array([0.55, 0.7, 0.62])[:, None]
    row_effect = rng.normal(0, 0.25, 300)[None, :]
    x = (rng.random((3, 300)) < np.clip(seed_effect + row_effect, 0, 1)).astype(float)
    reps = iv.column_replicates(_finals(x), [42, 43, 44], "SST-2", b=4000)
    assert reps.mean() == pytest.approx(x.mean(), abs=0.003)
    assert reps.std() == pytest.approx(math.sqrt(two_way_variance(x)), rel=0.06)


def test_one_seed_interval_matches_scipy_bootstrap_and_the_binomial_normal_interval() -> None:
    x = (np.random.default_rng(1).random((1, 400)) < 0.7).astype(float)
    lo, hi = iv.percentile(iv.column_replicates(_finals(x), [42], "SST-2", b=4000))
    ref = stats.bootstrap((x[0],), np.mean, n_resamples=4000, method="percentile", random_state=2).confidence_interval
    assert (lo, hi) == (pytest.approx(ref.low, abs=0.01), pytest.approx(ref.high, abs=0.01))
    p = x.mean()
    half = stats.norm.ppf(0.975) * math.sqrt(p * (1 - p) / x.shape[1])
    assert (lo, hi) == (pytest.approx(p - half, abs=0.01), pytest.approx(p + half, abs=0.01))


def test_paired_difference_is_the_bootstrap_of_the_row_by_row_difference() -> None:
    """Same seeds and rows → same draws: the difference's spread is the closed form of the difference
    matrix, much narrower than the two cells' spreads combined as independent (rows shared)."""
    rng = np.random.default_rng(4)
    easy = rng.random(500) < 0.6  # rows both methods tend to get right
    a = (easy[None, :] | (rng.random((3, 500)) < 0.25)).astype(float)
    b = (easy[None, :] & (rng.random((3, 500)) < 0.9)).astype(float)
    ra = iv.column_replicates(_finals(a), [42, 43, 44], "SST-2", b=4000)
    rb = iv.column_replicates(_finals(b), [42, 43, 44], "SST-2", b=4000)
    cell_a = iv.from_replicates(a.mean(), ra, 3)
    cell_b = iv.from_replicates(b.mean(), rb, 3)
    diff = iv.difference(cell_a, cell_b)
    assert diff.value == pytest.approx(a.mean() - b.mean()) and diff.method == "bootstrap"
    assert (ra - rb).std() == pytest.approx(math.sqrt(two_way_variance(a - b)), rel=0.06)
    assert (ra - rb).std() < 0.6 * math.hypot(ra.std(), rb.std())
    assert diff.lo < diff.value < diff.hi


def test_draws_are_a_function_of_what_is_resampled() -> None:
    assert np.array_equal(iv.seed_draws([42, 43, 44], 50), iv.seed_draws([42, 43, 44], 50))
    assert not np.array_equal(iv.seed_draws([42, 43, 44], 50), iv.seed_draws([1, 2, 3], 50))
    def rows(name: str, n: int, b: int) -> np.ndarray:
        return np.concatenate(list(iv.row_draws(name, n, b)))

    assert np.array_equal(rows("abc", 10, 50), rows("abc", 10, 50))
    assert not np.array_equal(rows("abc", 10, 50), rows("abd", 10, 50))
    big = list(iv.row_draws("qqp", 40_000, 300))  # chunked: never 300 × 40k indices at once
    assert len(big) > 1 and max(c.size for c in big) <= iv.CHUNK and sum(len(c) for c in big) == 300


def test_statistic_columns_are_recomputed_on_each_draw() -> None:
    """CoLA (MCC): the replicate is the metric of the drawn rows, as a brute-force loop with sklearn."""
    rng = np.random.default_rng(5)
    gold = rng.integers(0, 2, 120)
    pred = np.where(rng.random(120) < 0.75, gold, 1 - gold)
    draws = np.concatenate(list(iv.row_draws("cola", 120, 200)))
    reps = iv.task_replicates("CoLA", Outcome(pred=pred.tolist(), gold=gold.tolist()), draws)
    ref = [matthews_corrcoef(gold[d], pred[d]) for d in draws]
    assert reps == pytest.approx(ref)


def test_row_outcomes_reproduce_the_task_score() -> None:
    texts = ["positive", "negative", "yes", "nonsense", "positive", "negative"]
    golds = [1, 1, 1, 0, 0, 0]
    out = row_outcomes("SST-2", texts, golds)
    assert np.mean(out["correct"]) == pytest.approx(score_outputs("SST-2", texts, golds)[0])
    cola = row_outcomes("CoLA", ["acceptable", "unacceptable", "acceptable", "unacceptable"], [1, 0, 0, 0])
    assert glue_score("cola", cola["pred"], cola["gold"]) == pytest.approx(
        score_outputs("CoLA", ["acceptable", "unacceptable", "acceptable", "unacceptable"], [1, 0, 0, 0])[0])
    math_rows = row_outcomes("MAWPS", ["4 - 1 = 3.", "7.", "none"], [3.0, 8.0, 1.0])
    assert math_rows["correct"] == [1, 0, 0]


def test_t_fallback_is_scipys_t_interval() -> None:
    values = [0.61, 0.55, 0.67]
    ref = stats.t.interval(0.95, 2, loc=np.mean(values), scale=stats.sem(values))
    cell = iv.from_seeds(values)
    assert (cell.lo, cell.hi) == (pytest.approx(ref[0]), pytest.approx(ref[1])) and cell.method == "t over seeds"
    single = iv.from_seeds([0.5])
    assert math.isnan(single.lo) and single.method == "none"


def test_tie_rule_needs_the_difference_interval_to_exclude_zero() -> None:
    def cell(value: float, spread: float, seed: int) -> iv.Interval:
        reps = value + np.random.default_rng(seed).normal(0, spread, 2000)
        return iv.from_replicates(value, reps, 3)

    assert iv.clears(cell(0.8, 0.01, 0), cell(0.5, 0.01, 1))
    assert not iv.clears(cell(0.52, 0.03, 0), cell(0.50, 0.03, 1))
    assert iv.clears(cell(1.0, 0.01, 0), cell(2.0, 0.01, 1), lower_is_better=True)
    no_interval = iv.Interval(0.9, math.nan, math.nan, 1, "none")
    assert not iv.clears(no_interval, iv.Interval(0.1, math.nan, math.nan, 1, "none"))  # no interval: a tie
    # without replicates: the two intervals combined as independent normals
    wide = iv.difference(iv.Interval(0.7, 0.6, 0.8, 2, "t over seeds"), iv.Interval(0.5, 0.4, 0.6, 2, "t over seeds"))
    assert (wide.lo, wide.hi) == (pytest.approx(0.2 - math.hypot(0.1, 0.1)), pytest.approx(0.2 + math.hypot(0.1, 0.1)))


def test_sign_flip_p_is_the_brute_force_enumeration_and_scipys_paired_permutation_test() -> None:
    import itertools

    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 2, (2, 6)), rng.integers(0, 2, (2, 6))  # 2 seeds × 6 rows of 0/1 outcomes
    a[0, :3], b[0, :3] = 1, 0  # a leads on some rows
    d, w = (a - b).ravel().astype(float), np.full(12, 1 / 12)
    brute = np.mean([abs(np.dot(np.array(s) * d, w)) >= abs(np.dot(d, w)) - 1e-15
                     for s in itertools.product([1, -1], repeat=12)])
    assert iv.sign_flip_p(d, w) == pytest.approx(brute, abs=1e-12)
    scipy_p = stats.permutation_test((a.ravel().astype(float), b.ravel().astype(float)),
                                     lambda x, y: np.mean(x) - np.mean(y), permutation_type="samples",
                                     n_resamples=np.inf, alternative="two-sided").pvalue
    assert iv.sign_flip_p(d, w) == pytest.approx(scipy_p, abs=1e-12)


def test_sign_flip_p_by_random_patterns_is_the_binomial_closed_form() -> None:
    """Equal weights and m differences of ±1: T*/w = Σ sᵢdᵢ = 2X − m with X ~ Bin(m, ½), so
    p = P(|2X − m| ≥ |Σ dᵢ|) exactly; the random patterns must reach it within their Monte Carlo error."""
    d = np.random.default_rng(5).permutation(np.r_[np.ones(330), -np.ones(300), np.zeros(570)])  # 3 seeds × 400 rows
    w = np.full(len(d), 1 / len(d))
    m, t = 630, 30
    closed = float(stats.binom.cdf((m - t) // 2, m, 0.5) + stats.binom.sf((m + t) // 2 - 1, m, 0.5))
    assert 0.1 < closed < 0.5
    assert iv.sign_flip_p(d, w) == pytest.approx(closed, abs=0.01)  # 20,000 patterns: Monte Carlo SE ≈ 0.003


def test_paired_p_pairs_the_same_seed_and_row_of_two_cells() -> None:
    rng = np.random.default_rng(7)
    x = (rng.random((3, 8)) < 0.7).astype(float)
    y = (rng.random((3, 8)) < 0.4).astype(float)
    cells = [iv.from_replicates(m.mean(), iv.column_replicates(_finals(m), [1, 2, 3], "SST-2"), 3,
                                outcomes=iv.weighted_outcomes([("SST-2", _finals(m), [1, 2, 3])])) for m in (x, y)]
    diff = iv.difference(*cells)
    assert diff.value == pytest.approx(float(np.sum((x - y) * cells[0].outcomes[("SST-2", 1, "t", "rows-a")][1])))
    assert diff.p == pytest.approx(iv.sign_flip_p((x - y).ravel(), np.full(24, 1 / 24)))
    other = iv.from_replicates(y.mean(), cells[1].replicates, 3,
                               outcomes=iv.weighted_outcomes([("SST-2", _finals(y, rows="rows-b"), [1, 2, 3])]))
    assert math.isnan(iv.difference(cells[0], other).p)  # other rows: nothing to pair
