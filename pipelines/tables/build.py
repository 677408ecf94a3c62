"""Cells of a table from run records: grouping, refusals, intervals, paper numbers, best marks, the
"PRISM − best baseline" row, header facts.

A cell averages *seeds only*: a cell whose finished runs differ in another result-changing field
(:func:`pipelines.runs.identity.result_fields`; in a table of private selections, one besides what each seed's
selection chose, :data:`SELECTED`) is refused and listed, never averaged, and so is a run whose realised
ε does not fit its row's ε.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import subprocess
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipelines.config import identity
from pipelines.config.tuned_rates import lr_source_recorded, recorded_lr_source
from pipelines.runs import store
from pipelines.tables import intervals as iv
from pipelines.tables.records import AggregateError, RunRecord
from pipelines.tables.specs import (
    REFERENCE,
    SUITE_TASKS,
    TableSpec,
    as_float,
    is_reference,
    mean,
    norm_name,
)
from pipelines.tables.statement import PrivacyFacts, collect
from prism.methods import registry
from prism.privacy.limits import CALIBRATED_BELOW
from prism.privacy.protocol import NOT_DP_AS_STATED
from prism.record import FinalRecord

PAPER_DIR = Path(__file__).resolve().parent / "paper"
SCALES = ("embedded", "paper")
PROTOCOLS = ("corrected", "released")  # conf/protocol/*.yaml; a run without the key ran `corrected`
EPS_RTOL = 1e-3  # the accountant's calibration tolerance is far tighter
CELL_PARTS = ("", "_lo", "_hi", "_n", "_ci", "_paper")  # per value column: value, 95 % interval, seeds, method, paper
SELECTED = ("method.lr", "tune.lr_factor", "privacy.selection.candidate")  # what a private selection picks per seed


@dataclass
class TableResult:
    """A built table: ``frame`` holds the keys, per value column the parts of :data:`CELL_PARTS` and
    ``<col>_mark``, then ``eps_spent_<suite>`` and ``n_runs``; ``differences`` the "PRISM − best baseline"
    rows (with ``<col>_vs``, ``<col>_mde``, ``<col>_seeds3pp``); ``header`` the facts per suite."""

    spec: TableSpec
    scale: str
    frame: pd.DataFrame
    missing: list[str]
    ignored: list[str]
    protocol: str = "corrected"
    stand_ins: list[str] = field(default_factory=list)
    header: dict[str, dict[str, str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    columns_seen: dict[str, list[str]] = field(default_factory=dict)
    n_finished: int = 0
    not_dp: int = 0  # private runs whose final.json says their ε is not a valid DP guarantee as stated
    tuned: int = 0  # private runs trained at a rate `make tune` chose on their data (a cost ε does not cover)
    tuning_seeds: list[int] = field(default_factory=list)  # the seeds the rates of its tuned runs were chosen on
    table_seeds: list[int] = field(default_factory=list)  # the seeds of its runs
    differences: pd.DataFrame = field(default_factory=pd.DataFrame)  # the "PRISM − best baseline" rows
    unscored: list[str] = field(default_factory=list)  # stand-in columns the runs trained on but did not score
    audit: pd.DataFrame = field(default_factory=pd.DataFrame)  # spec.candidates: every selection's candidates
    privacy: PrivacyFacts = field(default_factory=PrivacyFacts)  # what its private runs ran under (the statement)
    no_signal: dict[Any, list[str]] = field(default_factory=dict)  # per private block, its gated columns (gates)
    order: str = ""  # the best method's Avg per privacy level and whether Non-DP ≥ ε=6 ≥ ε=3 holds (order_line)
    claims: list[str] = field(default_factory=list)  # a verdict per claim of the paper (claims)


def load_paper(name: str) -> pd.DataFrame:
    """The paper's numbers for one table (``pipelines/tables/paper/<name>.csv``)."""
    return pd.read_csv(PAPER_DIR / f"{name}.csv")


def protocol_of(record: RunRecord) -> str:
    """The protocol a run ran under (``protocol.name``; runs from before the switch ran ``corrected``)."""
    return str(record.get("protocol.name") or "corrected")


def is_private_run(record: RunRecord) -> bool:
    """Whether the run's config targets a finite ε."""
    target = as_float(record.get("privacy.epsilon"))
    return target is not None and math.isfinite(target)


def spent_epsilon(record: RunRecord) -> float | None:
    """A run's realised ε: its private selection's (a published candidate's :class:`~prism.record.SelectionBlock`:
    every candidate and score included), else its accountant's ``epsilon_spent``."""
    block = record.final.selection
    return block.epsilon if block is not None else as_float(record.final.epsilon_spent)


def epsilon_problem(record: RunRecord) -> str:
    """Why a finished run's realised ε or σ does not fit the row of its target ε ('' when it does): a realised
    ε above it; σ = 0 (no noise) beside it; or, for σ calibrated for exactly the run's steps
    (``privacy.calibration=exact``, the ``corrected`` protocol), a realised ε more than
    :data:`~prism.privacy.limits.CALIBRATED_BELOW` below it: calibration puts ε within that of the target
    (docs/DECISIONS.md D1), so a lower one is a run with more noise than its row's. The released protocol's
    ``epochs`` calibration is for more steps than the run takes, so its realised ε lies lower by design."""
    target = as_float(record.get("privacy.epsilon"))
    if target is None or record.final.epsilon_spent is None:
        return ""
    spent = spent_epsilon(record)
    if math.isinf(target):
        return "" if spent is None or math.isinf(spent) else f"non-DP config but realised ε={spent:g}"
    if spent is None or math.isnan(spent) or spent > target * (1 + EPS_RTOL):
        return f"realised ε={spent} exceeds the row's ε={target:g}"
    if as_float(record.final.sigma) == 0:
        return f"σ=0 (no noise) beside the row's ε={target:g}"
    if record.get("privacy.calibration", "exact") == "exact" and spent < target - CALIBRATED_BELOW:
        return (f"realised ε={spent:g} is more than {CALIBRATED_BELOW:g} below the row's ε={target:g}, which a σ "
                "calibrated for its steps spends to within that: the run has more noise than its row's")
    return ""


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, Mapping):
        return {prefix.rstrip("."): node}
    return {k: v for key, value in node.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}


def unseeded_config(record: RunRecord) -> dict[str, Any]:
    """The run's result-changing config minus the seed (equal for the seeds of one cell)."""
    return {k: v for k, v in identity.result_fields(record.config).items() if k != "seed"}


def fixed_config(record: RunRecord, free: Sequence[str] = ()) -> str:
    """The canonical text of :func:`unseeded_config` without the dotted fields ``free``."""
    return identity.canonical({k: v for k, v in _flatten(unseeded_config(record)).items() if k not in free})


def differing_fields(records: Sequence[RunRecord], limit: int = 4) -> str:
    """``field: a | b`` for the config fields (seed excluded) on which ``records`` disagree."""
    flat = [_flatten(unseeded_config(r)) for r in records]
    keys = sorted({k for f in flat for k in f})
    diffs = [f"{k}: {' | '.join(sorted({str(f.get(k)) for f in flat}))}" for k in keys
             if len({identity.canonical(f.get(k)) for f in flat}) > 1]
    more = f" (+{len(diffs) - limit} more)" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more


def expected_rows(paper: pd.DataFrame, keys: Sequence[str], seen: Iterable[tuple]) -> list[tuple]:
    """Rows the table must have: the paper's rows in its order, then any extra rows the runs have."""
    rows = [tuple(r) for r in paper[list(keys)].itertuples(index=False)]
    return rows + [k for k in dict.fromkeys(seen) if k not in rows]


def stand_ins(records: Sequence[RunRecord]) -> list[str]:
    """``paper backbone → backbone actually run`` for runs on an embedded stand-in (Table 3)."""
    pairs = {(r.get("backbone.paper_name"), r.get("backbone.name")) for r in records if r.config}
    return sorted(f"{p} → {n}" for p, n in pairs if p and n and norm_name(p) != norm_name(n))


def unscored_columns(records: Sequence[RunRecord]) -> list[str]:
    """Columns of embedded stand-in tasks that the runs trained on but did not score
    (``suite.embedded.unscored``), in the paper's column order."""
    from prism.data import PAPER_COLUMNS
    from prism.data.embedded import EMBEDDED_TASKS

    out = set()
    for r in records:
        available = EMBEDDED_TASKS.get(str(r.get("suite.name")))
        if r.get("suite.scale") != "embedded" or not available:
            continue
        trained = r.get("suite.embedded.tasks") or available
        out |= {available[t][0] for t in set(r.get("suite.embedded.unscored") or ()) & set(trained) & set(available)}
    return [c for c in PAPER_COLUMNS if c in out]


def fmt_key(spec: TableSpec, key: tuple) -> str:
    """A row key as text (``ε=6 / PRISM``, ``r=8 / AdamW``)."""
    return " / ".join(f"r={k}" if name == "Rank" else str(k) for name, k in zip(spec.keys, key))


# ----------------------------------------------------------------------------------------- header

def _eval_rows(final: FinalRecord) -> str | None:
    rows = final.eval_rows
    if not rows:
        return None
    counts = sorted({int(v) for v in rows.values()})
    per = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    return f"{per} per task ({len(rows)} tasks)"


def _steps(record: RunRecord) -> str:
    bench = record.get("train.benchmark")
    if isinstance(bench, Mapping):
        return f"{bench.get('warmup')}+{bench.get('measure')} (benchmark)"
    return str(record.get("train.steps"))


def _backbone(record: RunRecord) -> str:
    name, paper = record.get("backbone.name"), record.get("backbone.paper_name")
    return f"{name} (for {paper})" if paper and norm_name(paper) != norm_name(name) else str(name)


def _code(record: RunRecord) -> str | None:
    """The commit that trained a run (its :class:`~pipelines.runs.store.RunBlock`'s ``git_commit``, 10 digits;
    ``+dirty`` with local changes)."""
    block = record.run
    if block is None or not block.git_commit:  # a W&B summary carries no run block
        return None
    return str(block.git_commit)[:10] + ("+dirty" if block.git_dirty else "")


REPO = Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=256)
def mechanism_differs(first: str, second: str) -> bool:
    """Whether ``prism/`` differs between two commits (``git diff``); True when git cannot tell (a commit
    unknown to this checkout, no git): a cell whose runs may come from different mechanisms is flagged."""
    try:
        done = subprocess.run(["git", "diff", "--quiet", first, second, "--", "prism/"], cwd=REPO,
                              capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return True
    return done.returncode != 0


def mixed_code(spec: TableSpec, cells: Mapping[tuple, Mapping[str, Sequence[RunRecord]]]) -> list[str]:
    """A warning for each cell averaging runs of different commits (or a dirty tree) whose ``prism/`` differs."""
    out = []
    for key, by_suite in cells.items():
        for suite, rs in by_suite.items():
            codes = sorted({c for c in (_code(r) for r in rs) if c})
            commits = sorted({c.split("+")[0] for c in codes})
            dirty = any(c.endswith("+dirty") for c in codes)
            if len(codes) > 1 and (dirty or any(mechanism_differs(a, b) for a, b in zip(commits, commits[1:]))):
                out.append(f"{fmt_key(spec, key)} / {suite}: MIXED CODE, its {len(rs)} runs come from commits "
                           f"{', '.join(codes)} whose prism/ differs; rerun the cell with force=true")
    return out


FACTS = (  # (header column, config field it comes from or None, value of one run)
    ("backbone", "backbone", _backbone),
    ("steps", "train", _steps),
    ("batch", "train", lambda r: str(r.get("train.batch_size"))),
    ("N (train)", "suite", lambda r: None if r.final.n_train is None else str(r.final.n_train)),
    ("eval rows", "suite", lambda r: _eval_rows(r.final)),
    ("protocol", "protocol", lambda r: None if r.get("protocol.name") is None else str(r.get("protocol.name"))),
    ("code", "code", _code),
)


def header_facts(spec: TableSpec, by_suite: Mapping[str, Sequence[RunRecord]]) -> tuple[dict, list[str]]:
    """Per suite, each fact of its runs (one value, or every value with its run count); and a warning for
    each fact but the code (:func:`mixed_code` warns where its ``prism/`` differs) that differs between
    rows although it is not an axis of the table."""
    header: dict[str, dict[str, str]] = {}
    warnings = []
    for suite, records in by_suite.items():
        facts: dict[str, str] = {"runs": str(len(records))}
        for name, source, get in FACTS:
            counts = Counter(v for v in (get(r) for r in records) if v is not None)
            if len(counts) == 1:
                facts[name] = next(iter(counts))
            elif counts:
                facts[name] = ", ".join(f"{v} ({n} runs)" for v, n in sorted(counts.items()))
                if source not in (*spec.axes, "code"):
                    warnings.append(f"{suite}: runs of different rows differ in {name} ({facts[name]})")
        header[suite] = facts
    return header, warnings


# ----------------------------------------------------------------------------------------- table

def build_table(spec: TableSpec, records: Sequence[RunRecord], scale: str,
                paper: pd.DataFrame | None = None, protocol: str | None = None) -> TableResult:
    """Cells from the records of one scale and one protocol, paper numbers and deltas beside them,
    best marks, the missing list. Runs of another scale or protocol are listed as ignored, never
    averaged into a cell (a protocol changes the mechanism, so it is a table of its own). Without
    ``protocol``: the one most runs have."""
    if protocol is not None and protocol not in PROTOCOLS:
        raise AggregateError(f"protocol={protocol} is not known, use protocol= one of {', '.join(PROTOCOLS)}")
    if scale not in SCALES:
        raise AggregateError(f"scale={scale} is not known, use scale=embedded or scale=paper")
    paper = load_paper(spec.name) if paper is None else paper
    ignored = [f"{r.run_id}: scale {r.get('suite.scale')}" for r in records
               if r.config and r.get("suite.scale") not in (None, scale)]
    records = [r for r in records if not r.config or r.get("suite.scale") in (None, scale)]
    if protocol is None:
        seen = Counter(protocol_of(r) for r in records if r.config)
        protocol = seen.most_common(1)[0][0] if seen else "corrected"
    ignored += [f"{r.run_id}: protocol {protocol_of(r)}" for r in records
                if r.config and protocol_of(r) != protocol]
    records = [r for r in records if not r.config or protocol_of(r) == protocol]
    records = list({r.run_id: r for r in records}.values())  # a run listed twice (seeds=42,42) is one run
    problems = [r for r in records if r.state != "finished"]
    missing: list[str] = []
    finished = []
    first: dict[str, str] = {}  # run hash (its result config with the seed) -> the first run read with it
    for r in (r for r in records if r.state == "finished"):
        same = first.setdefault(store.run_hash(r.config), r.run_id)
        why = epsilon_problem(r) or (f"duplicates run {same} (same config and seed)" if same != r.run_id else "")
        if why:
            missing.append(f"{fmt_key(spec, spec.cell_key(r, paper))} / {r.get('suite.name')}: "
                           f"left out, {why} ({r.run_id})")
        else:
            finished.append(r)
    cells: dict[tuple, dict[str, list[RunRecord]]] = {}
    for r in finished:
        cells.setdefault(spec.cell_key(r, paper), {}).setdefault(str(r.get("suite.name")), []).append(r)
    warnings, free = [], SELECTED if spec.candidates else ()
    for key, by_suite in cells.items():
        for suite, rs in list(by_suite.items()):
            if len({fixed_config(r, free) for r in rs}) > 1:
                warnings.append(f"{fmt_key(spec, key)} / {suite}: REFUSED, {len(rs)} runs differ in more than the "
                                f"seed ({differing_fields(rs)}); not averaged — keep one config per cell")
                del by_suite[suite]
    missing += warnings
    rows = expected = expected_rows(paper, spec.keys, [*cells, *(spec.cell_key(r, paper) for r in problems if r.config)])
    paper_idx = paper.set_index(list(spec.keys)).to_dict("index")
    table, intervals = [], {}
    for key in rows:
        by_suite = cells.get(key, {})
        values = spec.cell_values(spec, by_suite)
        row: dict[str, Any] = dict(zip(spec.keys, key))
        for col in spec.columns:
            ref = as_float(paper_idx.get(key[0] if len(key) == 1 else key, {}).get(col))
            ci = intervals[key, col] = cell_interval(spec, by_suite, col, values[col])
            row.update({col: values[col], f"{col}_lo": ci.lo, f"{col}_hi": ci.hi, f"{col}_n": ci.n,
                        f"{col}_ci": ci.method, f"{col}_paper": math.nan if ref is None else ref})
        row.update(cell_epsilon(by_suite))
        row["n_runs"] = sum(len(v) for v in by_suite.values())
        table.append(row)
        for suite in spec.suites:
            if not by_suite.get(suite):
                why = [f"{r.problem} ({r.run_id})" for r in problems
                       if r.config and spec.cell_key(r, paper) == key and r.get("suite.name") == suite]
                if why or not any(m.startswith(f"{fmt_key(spec, key)} / {suite}:") for m in missing):
                    missing.append(f"{fmt_key(spec, key)} / {suite}: " + ("; ".join(why) or "no run"))
    missing += [f"{fmt_key(spec, k)} / {r.get('suite.name')}: {r.problem} ({r.run_id}); the cell has a finished run"
                for r in problems if r.config and cells.get(k := spec.cell_key(r, paper), {}).get(r.get("suite.name"))]
    missing += [f"{r.problem} ({r.run_id})" for r in problems if not r.config]
    columns = [*spec.keys, *(f"{col}{part}" for col in spec.columns for part in CELL_PARTS),
               *(f"eps_spent_{s}" for s in spec.suites), "n_runs"]
    frame = pd.DataFrame(table, columns=columns)
    order, no_signal = order_line(spec, frame), gates(spec, frame, intervals)
    for key, by_suite in cells.items():  # a gated block's averages without its gated columns
        drop = no_signal.get(key[spec.keys.index(spec.block)] if spec.block else None, [])
        for col in [c for c in spec.averages or {} if drop]:
            ci = intervals[key, col] = cell_interval(spec, by_suite, col, math.nan, drop)
            i = expected.index(key)
            frame.loc[i, [col, f"{col}_lo", f"{col}_hi", f"{col}_n", f"{col}_ci"]] = [ci.value, ci.lo, ci.hi, ci.n, ci.method]
    frame = mark_best(frame, spec, intervals)
    used = {s: [r for by_suite in cells.values() for r in by_suite.get(s, [])] for s in spec.suites}
    trained = {s: [r for r in rs if not is_reference(r)] for s, rs in used.items()}  # the 0-step model has no budget
    header, fact_warnings = header_facts(spec, {s: rs for s, rs in trained.items() if rs})
    seen = {s: sorted({c for r in rs for c in r.final.columns or {}}) for s, rs in used.items()}
    sources = [(r, recorded_lr_source(r.config)) for rs in used.values() for r in rs]  # as recorded at compose
    not_dp = sum(r.final.dp_guarantee == NOT_DP_AS_STATED for r, _ in sources)
    tuned = sum(is_private_run(r) and source is not None for r, source in sources)
    unrecorded = sum(is_private_run(r) and not lr_source_recorded(r.config) for r, _ in sources)
    table_seeds = sorted({_seed_of(r) for r, _ in sources})
    result = TableResult(spec, scale, frame, missing, ignored, protocol, stand_ins(records), header,
                         fact_warnings + mixed_code(spec, cells) + warnings, seen, len(sources), not_dp, tuned=tuned,
                         tuning_seeds=sorted({s for _, source in sources if source for s in source.seeds}),
                         table_seeds=table_seeds, differences=prism_minus_best(spec, frame, intervals, no_signal),
                         unscored=unscored_columns(finished),
                         privacy=collect([r for r, _ in sources if is_private_run(r)], tuned=tuned, unrecorded=unrecorded,
                                         seeds=table_seeds),
                         no_signal=no_signal, order=order, claims=claims(spec, frame, intervals))
    if spec.candidates:
        result.audit = pd.DataFrame([{**dict(zip(spec.keys, key)), "suite": suite, "seed": _seed_of(r), "K": len(drawn),
                                      **c, "published": c["candidate"] == r.get("privacy.selection.candidate")}
                                     for key, by_suite in cells.items() for suite, rs in by_suite.items()
                                     for r in sorted(rs, key=_seed_of) for drawn in [spec.candidates(r)] for c in drawn])
    return result


def cell_epsilon(by_suite: Mapping[str, Sequence[RunRecord]]) -> dict[str, float]:
    """Realised ε per suite (the largest over the cell's runs) as read back from the accountant."""
    return {f"eps_spent_{suite}": max([e for r in rs if (e := spent_epsilon(r)) is not None], default=math.nan)
            for suite, rs in by_suite.items()}


def _seed_of(record: RunRecord) -> int:
    return int(record.get("seed", 0))


def component_columns(spec: TableSpec, by_suite: Mapping[str, Sequence[RunRecord]], col: str,
                      drop: Sequence[str] = ()) -> list[tuple[str, str]]:
    """The (suite, paper column) scores a value column is the unweighted mean of: the column itself
    in the suite that has it, or for an average every paper column its suites' runs scored but ``drop``."""
    if spec.averages and col in spec.averages:
        return [(s, c) for s in spec.averages[col] for c in sorted({c for r in by_suite.get(s, [])
                                                                     for c in r.final.columns or {}} - set(drop))]
    def scored(suite: str) -> set[str]:  # a user task (suite=custom) has the columns its runs scored
        return set(SUITE_TASKS.get(suite, ())) or {c for r in by_suite.get(suite, []) for c in r.final.columns or {}}

    return [(s, col) for s in spec.suites if col in scored(s)]


def cell_interval(spec: TableSpec, by_suite: Mapping[str, Sequence[RunRecord]], col: str, value: float,
                  drop: Sequence[str] = ()) -> iv.Interval:
    """The 95 % interval of one cell (:mod:`pipelines.tables.intervals`): the bootstrap over rows and
    seeds when every run behind it has per-row outcomes, else t over the per-seed values of the cell. With
    ``drop`` (an average's gated columns, :func:`gates`): the average of its other columns, value included."""
    parts = component_columns(spec, by_suite, col, drop)
    if drop:
        value = mean(spec.cell_values(spec, by_suite)[c] for _, c in parts)
    if value is None or math.isnan(value):
        return iv.Interval(math.nan, math.nan, math.nan, 0, "none")
    seeds = sorted({_seed_of(r) for rs in by_suite.values() for r in rs})
    per_seed = {}
    for seed in seeds:
        values = spec.cell_values(spec, {s: [r for r in rs if _seed_of(r) == seed] for s, rs in by_suite.items()})
        per_seed[seed] = mean(values[c] for _, c in parts) if drop else values[col]
    runs = {s: sorted(by_suite.get(s, []), key=_seed_of) for s, _ in parts}
    if parts and all(runs[s] and all(iv.has_rows(r.final, c) for r in runs[s]) for s, c in parts):
        reps = np.mean([iv.column_replicates([r.final for r in runs[s]], [_seed_of(r) for r in runs[s]], c)
                        for s, c in parts], axis=0)
        outcomes = iv.weighted_outcomes([(c, [r.final for r in runs[s]], [_seed_of(r) for r in runs[s]]) for s, c in parts])
        return iv.from_replicates(value, reps, max(len(v) for v in runs.values()), per_seed, outcomes)
    return dataclasses.replace(iv.from_seeds(list(per_seed.values())), value=value, per_seed=per_seed)


def blocks(spec: TableSpec, frame: pd.DataFrame) -> list[tuple[Any, pd.DataFrame]]:
    """(block value, its rows) in table order; one block of all rows for a table without blocks."""
    return list(frame.groupby(spec.block, sort=False)) if spec.block else [(None, frame)]


def mark_best(frame: pd.DataFrame, spec: TableSpec, intervals: Mapping[tuple, iv.Interval]) -> pd.DataFrame:
    """Add ``<col>_mark`` per cell: ``best`` where the column's best value within its block is better
    than the runner-up beyond noise (the 95 % interval of their paired difference excludes 0,
    :func:`pipelines.tables.intervals.clears`), ``tie`` on the best value where it is not; '' else."""
    frame = frame.copy()
    for col in spec.columns:
        marks = pd.Series("", index=frame.index, dtype=object)
        for _, part in blocks(spec, frame):
            vals = pd.to_numeric(part[col], errors="coerce").dropna()
            if len(vals) < 2:
                continue
            order = vals.sort_values(ascending=spec.lower_is_better, kind="stable").index
            best, runner = (intervals[tuple(frame.loc[i, k] for k in spec.keys), col] for i in order[:2])
            marks.loc[order[0]] = "best" if iv.clears(best, runner, spec.lower_is_better) else "tie"
        frame[f"{col}_mark"] = marks
    return frame


NO_SIGNAL = "no privacy signal"


def _best_key(spec: TableSpec, part: pd.DataFrame, col: str) -> tuple | None:
    """The key of the row with the best value of ``col`` in ``part`` (None when no row has one)."""
    vals = pd.to_numeric(part[col], errors="coerce").dropna()
    if vals.empty:
        return None
    i = vals.idxmin() if spec.lower_is_better else vals.idxmax()
    return tuple(part.loc[i, k] for k in spec.keys)


def gates(spec: TableSpec, frame: pd.DataFrame, intervals: Mapping[tuple, iv.Interval]) -> dict[Any, list[str]]:
    """Per privacy block (a finite ε), the task columns with no privacy signal: the block's best method there
    is not above the 0-step model (:data:`~pipelines.tables.specs.REFERENCE`) beyond noise, i.e. the 95 %
    interval of their paired difference does not exclude 0 (:func:`pipelines.tables.intervals.clears`).
    Empty without a 0-step row (docs/comparison.md, "The 0-step model and the gates")."""
    if spec.block != "Setting" or not ((frame["Setting"] == REFERENCE[0]) & (frame["Method"] == REFERENCE[1])).any():
        return {}
    out = {}
    for block, part in blocks(spec, frame):
        if block in (REFERENCE[0], "Non-DP"):
            continue
        tasks = [c for c in spec.columns if c not in (spec.averages or {})]
        gated = [c for c in tasks if (best := _best_key(spec, part, c)) is not None
                 and not math.isnan(intervals[REFERENCE, c].value)
                 and not iv.clears(intervals[best, c], intervals[REFERENCE, c], spec.lower_is_better)]
        if gated:
            out[block] = gated
    return out


def order_line(spec: TableSpec, frame: pd.DataFrame) -> str:
    """The best method's Avg per privacy level (all its columns, point estimates) and whether
    Non-DP ≥ ε=6 ≥ ε=3 (every level at least the next more private one) holds ('' unless at least two of the
    levels have an Avg)."""
    if spec.block != "Setting" or "Avg" not in spec.columns:
        return ""
    best = {}
    for block, part in blocks(spec, frame):
        if block != REFERENCE[0] and (key := _best_key(spec, part, "Avg")) is not None:
            best[block] = (key[1], float(part.loc[part["Method"] == key[1], "Avg"].iloc[0]))
    levels = sorted(best, key=lambda b: -math.inf if b == "Non-DP" else -float(str(b).removeprefix("ε=")))
    if len(levels) < 2:
        return ""
    broken = [f"{a} < {b}" for a, b in zip(levels, levels[1:]) if best[a][1] < best[b][1]]
    return ("Order of the best method's Avg (all columns, point estimates): "
            + " ≥ ".join(f"{b} {best[b][1]:.3f} ({best[b][0]})" for b in levels)
            + (f": does NOT hold ({'; '.join(broken)})." if broken else ": holds."))


DIFF_LABEL = "PRISM − best baseline"


def prism_minus_best(spec: TableSpec, frame: pd.DataFrame, intervals: Mapping[tuple, iv.Interval],
                     no_signal: Mapping[Any, Sequence[str]] | None = None) -> pd.DataFrame:
    """Per block and column, PRISM's cell minus the baseline with the best value there (chosen on the
    point estimates), with the paired bootstrap interval of the difference and its sign-flip p-value
    (``<col>_p``, :func:`pipelines.tables.intervals.sign_flip_p`); ``<col>_vs`` names that baseline and
    ``<col>_mark`` is ``beats`` (``below``) where the interval excludes 0 on PRISM's better (worse) side.
    A column of ``no_signal`` (:func:`gates`) in its block has no difference, its mark :data:`NO_SIGNAL`.
    Empty for tables without a Method key or without a PRISM row."""
    if "Method" not in spec.keys:
        return pd.DataFrame()
    out = []
    for block, part in blocks(spec, frame):
        if (pkey := _prism_key(spec, part)) is None:
            continue
        row: dict[str, Any] = {k: (block if k == spec.block else DIFF_LABEL) for k in spec.keys}
        for col in spec.columns:
            if col in (no_signal or {}).get(block, ()):
                row.update({col: math.nan, f"{col}_lo": math.nan, f"{col}_hi": math.nan, f"{col}_mark": NO_SIGNAL})
                continue
            diff, vs = best_baseline_difference(spec, part, intervals, pkey, col)
            mde, seeds = iv.detectable(diff)
            row.update({col: diff.value, f"{col}_lo": diff.lo, f"{col}_hi": diff.hi, f"{col}_n": diff.n,
                        f"{col}_ci": diff.method, f"{col}_p": diff.p, f"{col}_mark": _side(spec, diff), f"{col}_vs": vs,
                        f"{col}_mde": mde, f"{col}_seeds3pp": seeds})
        if any(not math.isnan(row[col]) for col in spec.columns):
            out.append(row)
    return pd.DataFrame(out)


def _prism_key(spec: TableSpec, part: pd.DataFrame) -> tuple | None:
    """The key of PRISM's row in one block (None without one)."""
    prism = part[part["Method"] == registry.lookup("prism").label]
    return None if prism.empty else tuple(prism.iloc[0][k] for k in spec.keys)


def best_baseline_difference(spec: TableSpec, part: pd.DataFrame, intervals: Mapping[tuple, iv.Interval],
                             pkey: tuple, col: str) -> tuple[iv.Interval, str]:
    """PRISM's cell ``pkey`` minus the cell of the baseline (a method without :attr:`tangent`) with the best
    point estimate of ``col`` in the block ``part``: the paired difference (:func:`pipelines.tables.intervals.difference`)
    and that baseline's label; no interval and ``''`` without a baseline value or a PRISM value."""
    tangent = {registry.lookup(n).label for n in registry.names() if registry.lookup(n).tangent}
    vals = pd.to_numeric(part.loc[~part["Method"].isin(tangent), col], errors="coerce").dropna()
    if vals.empty or math.isnan(intervals[pkey, col].value):
        return iv.Interval(math.nan, math.nan, math.nan, 0, "none"), ""
    i = vals.idxmin() if spec.lower_is_better else vals.idxmax()
    key = tuple(part.loc[i, k] for k in spec.keys)
    return iv.difference(intervals[pkey, col], intervals[key, col]), str(part.loc[i, "Method"])


def _side(spec: TableSpec, diff: iv.Interval) -> str:
    """``beats`` (``below``) where the 95 % interval of a PRISM − baseline difference excludes 0 on PRISM's
    better (worse) side, else ``''``."""
    better = -1 if spec.lower_is_better else 1
    return ("beats" if min(better * diff.lo, better * diff.hi) > 0 else
            "below" if max(better * diff.lo, better * diff.hi) < 0 else "")


CLAIM_COLUMN = "Avg"
CLAIMS = ("PRISM has the best average at ε=6", "PRISM has the best average at ε=3",
          "PRISM's lead at ε=3 is larger than at ε=6", "a baseline is the best without privacy")
"""The paper's four Table 2 claims (Section 5), each judged on :data:`CLAIM_COLUMN` by :func:`claims`."""


def claims(spec: TableSpec, frame: pd.DataFrame, intervals: Mapping[tuple, iv.Interval]) -> list[str]:
    """One verdict line per claim of :data:`CLAIMS` that the table has the blocks for: **confirmed** where the 95 %
    interval of the deciding paired difference excludes 0 on the claim's side, **refuted** where it excludes 0 on
    the other side, **undecided** otherwise (docs/comparison.md, "The claims"). The differences: PRISM − best
    baseline on the average at ε=6 and at ε=3 (a gated column is out of the average, :func:`gates`); their
    difference, ε=3 minus ε=6 (paired: the same seeds and evaluation rows draw alike in every cell); without
    privacy, PRISM − best baseline, whose claim holds where it is below 0."""
    if "Method" not in spec.keys or spec.block != "Setting" or CLAIM_COLUMN not in spec.columns:
        return []
    diffs = {}
    for block, part in blocks(spec, frame):
        if (pkey := _prism_key(spec, part)) is not None:
            diff, vs = best_baseline_difference(spec, part, intervals, pkey, CLAIM_COLUMN)
            if not math.isnan(diff.value):
                diffs[block] = (diff, vs)
    out = []

    def verdict(claim: str, diff: iv.Interval, what: str, sign: int) -> None:
        side = _side(spec, diff)
        word = "undecided" if not side else "confirmed" if (side == "beats") == (sign > 0) else "refuted"
        p = "" if math.isnan(diff.p) else f", p={diff.p:.2g}"
        ci = "no interval" if math.isnan(diff.lo) else f"[{diff.lo:+.3f}, {diff.hi:+.3f}]"
        out.append(f"{claim}: **{word}** ({what} {diff.value:+.3f} {ci}{p}).")

    for claim, block in zip(CLAIMS[:2], ("ε=6", "ε=3")):
        if block in diffs:
            verdict(claim, diffs[block][0], f"PRISM − {diffs[block][1]} on {CLAIM_COLUMN}", +1)
    if "ε=6" in diffs and "ε=3" in diffs:
        verdict(CLAIMS[2], iv.difference(diffs["ε=3"][0], diffs["ε=6"][0]),
                f"(PRISM − best baseline) at ε=3 minus at ε=6 on {CLAIM_COLUMN}", +1)
    if "Non-DP" in diffs:
        verdict(CLAIMS[3], diffs["Non-DP"][0], f"PRISM − {diffs['Non-DP'][1]} on {CLAIM_COLUMN}", -1)
    return out
