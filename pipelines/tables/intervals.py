"""95 % intervals of table cells: a percentile bootstrap over evaluation rows and seeds together.

One replicate redraws the cell's seeds and every task's evaluation rows (``final.json`` ``per_example``)
with replacement and recomputes the seed-mean score on them. The draws are a function of what is drawn
(the seed list, the rows' hash), so two cells on the same seeds and rows draw alike and the difference of
their replicates is a paired bootstrap. A cell without per-row data falls back to Student's t over its
seeds (n ≥ 2) or has no interval (n = 1). docs/comparison.md explains the intervals and their closed form.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from prism.evaluation.metrics import COLUMN_RULES, glue_score, macro_f1
from prism.record import FinalRecord, Outcome

B = 2000  # bootstrap replicates per cell
CHUNK = 4_000_000  # row indices drawn at once
LEVEL = 0.95
METHOD_TEXT = (f"95 % intervals: percentile bootstrap ({B} replicates) over evaluation rows and seeds together "
               "(each replicate redraws the cell's seeds and every task's evaluation rows with replacement); "
               "differences are paired (the same seed and row draws for both cells)")


@dataclass(frozen=True)
class Interval:
    """A cell's point estimate, its interval (NaN when there is none), the seeds behind it, how the
    interval was made (``bootstrap`` | ``t over seeds`` | ``none``), its bootstrap replicates, its
    value per seed (seed → value; empty when unknown) and, for a cell of 0/1 outcomes, its weighted
    outcomes (:func:`weighted_outcomes`; None otherwise); a difference carries the p-value of
    :func:`sign_flip_p` (NaN where it has none)."""

    value: float
    lo: float
    hi: float
    n: int
    method: str
    replicates: np.ndarray | None = None
    per_seed: Mapping[int, float] = field(default_factory=dict)
    outcomes: Mapping[tuple, tuple[np.ndarray, float]] | None = None
    p: float = math.nan


def _rng(*parts: object) -> np.random.Generator:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def seed_draws(seeds: Sequence[int], b: int = B) -> np.ndarray:
    """``[b, S]`` indices into ``seeds``, a function of the seed list (so equal lists draw alike)."""
    return _rng("seeds", tuple(seeds), b).integers(0, len(seeds), size=(b, len(seeds)))


def row_draws(rows: str, n: int, b: int = B) -> Iterator[np.ndarray]:
    """``b`` draws of ``n`` row indices in ``[m, n]`` chunks of at most :data:`CHUNK` indices (a
    paper-scale task has 40k rows), a function of the rows' hash and count (equal rows draw alike)."""
    rng = _rng("rows", rows, n, b)
    per = max(1, CHUNK // max(n, 1))
    for start in range(0, b, per):
        yield rng.integers(0, n, size=(min(per, b - start), n))


def task_replicates(column: str, outcome: Outcome, draws: np.ndarray) -> np.ndarray:
    """The task score of one run on each of ``draws`` (``[b, n]`` row indices) → ``[b]``."""
    if outcome.correct is not None:
        return np.asarray(outcome.correct, dtype=float)[draws].mean(axis=1)
    pred, gold = np.asarray(outcome.pred), np.asarray(outcome.gold)
    if column == "Macro-F1":  # a user's classification task
        return macro_f1(pred[draws], gold[draws], int(outcome.labels))
    rule = COLUMN_RULES[column]
    return np.array([glue_score(rule, pred[idx], gold[idx]) for idx in draws])


def has_rows(final: FinalRecord, column: str) -> bool:
    """Whether a run's ``final.json`` has the per-row outcomes of every task it scores in ``column``."""
    if final.per_example is None or column not in (final.columns or {}):
        return False
    return any(o.column == column for o in final.per_example.values())


def column_replicates(finals: Sequence[FinalRecord], seeds: Sequence[int], column: str, b: int = B) -> np.ndarray:
    """Replicates of the seed-mean score of ``column`` over runs ``finals`` (one per seed, in ``seeds``
    order): per run and task, the score on the task's row draws; per run, the mean of its tasks (MNLI:
    matched and mismatched); then the mean over each replicate's drawn seeds → ``[b]``."""
    per_run = []
    for final in finals:
        reps = []
        for outcome in (o for o in final.per_example.values() if o.column == column):
            n = len(outcome.correct if outcome.correct is not None else outcome.pred or ())
            reps.append(np.concatenate([task_replicates(column, outcome, draws)
                                        for draws in row_draws(str(outcome.rows), n, b)]))
        per_run.append(np.mean(reps, axis=0))
    scores = np.stack(per_run)  # [S, b]
    return scores[seed_draws(seeds, b), np.arange(b)[:, None]].mean(axis=1)


def weighted_outcomes(parts: Sequence[tuple[str, Sequence[FinalRecord], Sequence[int]]]) -> dict | None:
    """The 0/1 outcomes behind a cell that is the mean over ``parts`` ((column, finals, seeds), one per scored
    suite column) of the seed mean of the task mean of row correctness: (column, seed, task, rows hash) →
    (outcomes, weight), the weight of each row in the cell's value (Σ weight·outcome = the value). None where
    a task has no ``correct`` outcomes (a statistic column: MCC, F1, Pearson)."""
    out = {}
    for column, finals, seeds in parts:
        for final, seed in zip(finals, seeds):
            tasks = [(t, o) for t, o in final.per_example.items() if o.column == column]
            for task, outcome in tasks:
                if outcome.correct is None:
                    return None
                x = np.asarray(outcome.correct, dtype=float)
                out[column, seed, task, str(outcome.rows)] = (x, 1 / (len(parts) * len(seeds) * len(tasks) * len(x)))
    return out


def sign_flip_p(d: np.ndarray, w: np.ndarray, b: int = 20_000) -> float:
    """Two-sided p-value of the paired statistic T = Σ wᵢdᵢ under the sign-flip permutation null: each
    pair's difference dᵢ (a seed and an evaluation row: one method's outcome minus the other's) keeps or
    flips its sign with probability ½, p = P(|T*| ≥ |T|). Exact (every sign pattern) when the pairs with
    dᵢ ≠ 0 are at most 16, else ``b`` random patterns, p = (1 + hits) / (1 + b) (a function of the data)."""
    keep = np.asarray(d, dtype=float) != 0
    x = (np.asarray(d, dtype=float) * np.asarray(w, dtype=float))[keep]
    observed = abs(float(x.sum())) * (1 - 1e-12)
    if len(x) <= 16:
        signs = 1 - 2 * ((np.arange(2 ** len(x))[:, None] >> np.arange(len(x))) & 1)
        return float(np.mean(np.abs(signs @ x) >= observed))
    rng = _rng("flips", x.tobytes(), b)
    hits = sum(int(np.sum(np.abs((1 - 2 * rng.integers(0, 2, size=(m, len(x)))) @ x) >= observed))
               for m in [min(1000, b - i) for i in range(0, b, 1000)])
    return (1 + hits) / (1 + b)


def paired_p(a: Interval, b: Interval) -> float:
    """:func:`sign_flip_p` of ``a − b`` over their common seeds and evaluation rows; NaN unless both cells
    have 0/1 outcomes on the same seeds, tasks and rows (the pairing needs the same row in both)."""
    if a.outcomes is None or b.outcomes is None or a.outcomes.keys() != b.outcomes.keys():
        return math.nan
    d = np.concatenate([a.outcomes[k][0] - b.outcomes[k][0] for k in a.outcomes])
    w = np.concatenate([np.full(len(a.outcomes[k][0]), a.outcomes[k][1]) for k in a.outcomes])
    return sign_flip_p(d, w)


def percentile(replicates: np.ndarray) -> tuple[float, float]:
    """The central ``LEVEL`` percentile interval of bootstrap replicates."""
    lo, hi = np.quantile(replicates, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return float(lo), float(hi)


def from_replicates(value: float, replicates: np.ndarray, n: int, per_seed: Mapping[int, float] | None = None,
                    outcomes: Mapping[tuple, tuple[np.ndarray, float]] | None = None, p: float = math.nan) -> Interval:
    """An :class:`Interval` of a bootstrapped cell (``per_seed``: its value per seed; ``outcomes``: its 0/1
    outcomes, :func:`weighted_outcomes`; ``p``: a difference's p-value)."""
    lo, hi = percentile(replicates)
    return Interval(value, lo, hi, n, "bootstrap", replicates, dict(per_seed or {}), outcomes, p)


def from_seeds(values: Sequence[float]) -> Interval:
    """The fallback :class:`Interval` of a cell without per-row data: Student's t over its seeds' values."""
    from scipy import stats

    x = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    if len(x) < 2:
        return Interval(float(x.mean()) if len(x) else math.nan, math.nan, math.nan, len(x), "none")
    half = stats.t.ppf((1 + LEVEL) / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    return Interval(float(x.mean()), float(x.mean() - half), float(x.mean() + half), len(x), "t over seeds")


def difference(a: Interval, b: Interval) -> Interval:
    """``a − b``: the bootstrap replicates subtracted (paired where both cells drew alike); for cells
    without replicates the two intervals are combined as independent normals (half-width
    ``hypot(ha, hb)``, method ``normal from cell intervals``), and none when either has no interval."""
    value = a.value - b.value
    per_seed = {s: a.per_seed[s] - b.per_seed[s] for s in sorted(set(a.per_seed) & set(b.per_seed))}
    if a.replicates is not None and b.replicates is not None:
        return from_replicates(value, a.replicates - b.replicates, min(a.n, b.n), per_seed, p=paired_p(a, b))
    if any(math.isnan(x) for x in (a.lo, a.hi, b.lo, b.hi)):
        return Interval(value, math.nan, math.nan, min(a.n, b.n), "none", None, per_seed)
    half = math.hypot((a.hi - a.lo) / 2, (b.hi - b.lo) / 2)
    return Interval(value, value - half, value + half, min(a.n, b.n), "normal from cell intervals", None, per_seed)


Z_LEVEL, Z_POWER = 1.959964, 0.841621  # z_0.975 (the 95 % interval), z_0.8 (80 % power)
TARGET = 0.03  # the difference the seed count is sized for: 3 points on the 0–1 score scale


def detectable(diff: Interval) -> tuple[float, float]:
    """(minimum detectable difference, seeds to detect :data:`TARGET`) of a paired difference ``diff``:
    MDE = (z_0.975 + z_0.8)·SE and the smallest S' with (z_0.975 + z_0.8)·√(A/S' + R) ≤ TARGET, as
    docs/comparison.md ("What the table can detect") derives them; NaN for what is unknown."""
    if math.isnan(diff.lo) or math.isnan(diff.hi):
        return math.nan, math.nan
    z = Z_LEVEL + Z_POWER
    se2 = ((diff.hi - diff.lo) / 2 / Z_LEVEL) ** 2
    values = list(diff.per_seed.values())
    if len(values) < 2:
        return z * math.sqrt(se2), math.nan
    seed_var = float(np.var(values, ddof=1))
    room = (TARGET / z) ** 2 - max(se2 - seed_var / len(values), 0.0)
    return z * math.sqrt(se2), math.inf if room <= 0 else float(max(1, math.ceil(seed_var / room - 1e-9)))


def clears(best: Interval, runner_up: Interval, lower_is_better: bool = False) -> bool:
    """Whether ``best`` is better than ``runner_up`` beyond noise: the 95 % interval of their
    difference excludes 0 on the better side (a tie otherwise, and always when it has no interval)."""
    diff = difference(runner_up, best) if lower_is_better else difference(best, runner_up)
    return not math.isnan(diff.lo) and diff.lo > 0
