"""Learning-rate selection as an experiment: sweep the Table 2 grid over a log grid of rates.

    python -m pipelines tune [scale=embedded|smoke] [launcher=local|slurm|submitit_local] [jobs=K] [overrides]
    make tune SCALE=embedded JOBS=2

Every cell of the Table 2 grid (method × privacy level × suite) runs at ``tune.lr_factor`` × its
default rate (Table 8 × ``train.lr_multiplier``) for each factor of ``conf/experiment/tune.yaml``
(5 half-decades, 0.1–10: a 100× span around the default), for each tuning seed (``seed`` of
``conf/experiment/tune.yaml``, default 1; ``make tune SEEDS=1,2`` sweeps ``seed=1,2``: seeds kept
apart from the tables' 42, 43, 44 so that no table seed is the one its rates were chosen on), and is
scored on the suite's **validation** rows (``suite.eval_split=validation``: drawn from the training
pool, disjoint from the run's training rows and from the fixed evaluation rows, :func:`prism.data.validation_split`;
the evaluation rows are never scored). The rule is the same for every method, PRISM included
(:data:`RULE`, :func:`choose`: the one-standard-error rule of docs/comparison.md); a chosen rate at an
edge of the cell's grid adds rates past that edge (:func:`extension`).

Each tuning run is an ordinary job of :mod:`pipelines.runs.runner` in the shared store (experiment view
``tune``), launched like a table's (:func:`pipelines.runs.launch.launch`: local pool, SLURM or
submitit, W&B as configured); rerunning the command skips finished runs and resumes killed ones.

Outputs: ``<results_dir>/tables/tune.<scale>.{md,csv}`` (validation score per rate per cell, the
chosen one marked), ``tune.<scale>.png`` (score vs rate, a panel per suite × privacy level, a line
per method) and, when every cell has a score, ``conf/tuned/<scale>.yaml``: the chosen rates with the
commit and command that produced them, read by every grid of that budget
(:mod:`pipelines.config.tuned_rates`). Choosing a rate on private validation data spends privacy that ε
does not cover (docs/comparison.md, "What tuning costs in privacy").

A user's task (``make tune TASK=file.jsonl``)::

    python -m pipelines tune task=TASK.jsonl [eval=..] [type=..] [labels=..] [model=DIR]
                            [methods=prism,adamw] [eps=inf,6,3] [jobs=K] [overrides]

sweeps the cells of ``make compare`` on that task (the same keys, the same model and budget) with the
training rows whose own draw falls below ``suite.custom.validation_fraction`` held out as the validation
split (:mod:`prism.data.custom`; never its evaluation rows). Its outputs are
``tables/tune-<file>-<id8>.<scale>.*`` and ``<results_dir>/tuned/custom-<file>-<id8>.<scale>.yaml``
(``<id8>``: the first 8 hex digits of the file's identifier, a keyed hash, docs/custom-task.md), which
``make compare`` on the same file (same identifier), model and budget then reads.
"""
from __future__ import annotations

import math
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser

from pipelines.config import grids
from pipelines.config.compose import compose_config, job_config
from pipelines.config.grids import Cell
from pipelines.config.tuned_rates import COVERS, cell_fields, tuned_dir, user_tuned_dir
from pipelines.runs import launch, store
from pipelines.tables import intervals
from prism.fileio import write_text_atomic
from prism.record import FinalRecord, RecordError

EXPERIMENT = "tune"
MAX_EXTEND = 2  # extra rates past an edge, per side
KEY_OVERRIDES = grids.KEY_OVERRIDES  # a user's task sweeps make compare's cells, from the same keys
CELL_KEYS = ("method", "privacy", "suite")  # group choices that name a cell
RULE = ("per cell, among the rates whose validation score (the suite's average over its columns, mean over the "
        "tuning seeds) is within one standard error (bootstrap over validation rows and seeds) of the best score, "
        "the rate nearest the default (in log-rate), then the lower rate")


@dataclass
class Point:
    """One tuning run: its cell, rate factor and rate, seed, store job, ``final.json`` (None until finished)."""

    cell: Cell
    factor: float
    lr: float
    default_lr: float
    seed: int
    job: launch.Job
    fields: dict
    final: FinalRecord | None = None

    @classmethod
    def of(cls, job: launch.Job) -> Point:
        """The point of a planned job: its cell, factor, rate and seed as its config gives them."""
        cfg = job.cfg
        factor, lr = float(cfg.tune.lr_factor), float(cfg.method.lr)
        return cls(Cell(str(cfg.suite.name), str(cfg.privacy.name), str(cfg.method.name)), factor, lr, lr / factor,
                   int(cfg.seed), job, cell_fields(cfg))

    @property
    def score(self) -> float:
        """The run's validation score (its suite average), NaN when it has none."""
        value = self.final.average if self.final is not None else None
        return float(value) if value is not None else math.nan


@dataclass(frozen=True)
class Score:
    """A rate's validation score in one cell: the mean over its tuning seeds and its standard error."""

    mean: float
    se: float


def score_of(finals: Sequence[FinalRecord], seeds: Sequence[int], b: int = intervals.B) -> Score:
    """The :class:`Score` of one rate from its runs' ``final.json`` (one per seed, in ``seeds`` order):
    the mean of their suite averages, and the standard deviation of the bootstrap replicates of that mean
    (:func:`pipelines.tables.intervals.column_replicates`: the validation rows and the seeds redrawn,
    the columns averaged as the suite average averages them). A run without per-row outcomes gives
    standard error 0 (the rule then takes the best score); NaN mean when a seed lacks a score."""
    averages = [f.average for f in finals]
    if not finals or not all(a is not None and not math.isnan(a) for a in averages):
        return Score(math.nan, math.nan)
    mean = float(np.mean(averages))
    per = [f.per_example or {} for f in finals]
    columns = sorted({str(p[t].column) for f, p in zip(finals, per) for t in (p if f.scores is None else f.scores)
                      if t in p})
    if not columns or not all(intervals.has_rows(f, c) for f in finals for c in columns):
        return Score(mean, 0.0)
    reps = np.mean([intervals.column_replicates(finals, seeds, c, b) for c in columns], axis=0)
    return Score(mean, float(np.std(reps, ddof=1)))


def choose(scores: Mapping[float, Score]) -> float | None:
    """The factor of :data:`RULE` among ``scores`` (factor → :class:`Score`); None if none is finite:
    the factors whose mean is at least the best mean minus the best's standard error, then the one
    nearest factor 1 in log factor, then the lower."""
    finite = {f: s for f, s in scores.items() if not math.isnan(s.mean)}
    if not finite:
        return None
    best = max(finite.values(), key=lambda s: s.mean)
    floor = best.mean - (0.0 if math.isnan(best.se) else best.se)
    return min((f for f, s in finite.items() if s.mean >= floor), key=lambda f: (abs(math.log(f)), f))


def extension(scores: Mapping[float, Score], base: Sequence[float]) -> float | None:
    """The factor to run next for a cell whose chosen factor sits at an edge of its grid: one step
    of the base grid past that edge (the outermost step of ``base``), at most :data:`MAX_EXTEND`
    past either end of ``base``; None when the choice is interior or the limit is reached."""
    chosen = choose(scores)
    grid = sorted(scores)
    if chosen is None or len(grid) < 2 or grid[0] < chosen < grid[-1]:
        return None
    base = sorted(base)
    if chosen == grid[-1]:
        step = base[-1] / base[-2]
        nxt, beyond = chosen * step, sum(f > base[-1] for f in grid)
    else:
        step = base[1] / base[0]
        nxt, beyond = chosen / step, sum(f < base[0] for f in grid)
    return None if beyond >= MAX_EXTEND else float(f"{nxt:.6g}")


def task_sweep(keys: dict[str, str], overrides: Sequence[str]) -> list[str]:
    """The overrides that sweep ``make compare``'s cells on a user's task: its task and model
    (:func:`pipelines.config.grids.task_overrides`), the model ``make compare`` would use, the methods and
    the privacy groups of ``eps=`` (∞, 6 and 3: the shipped groups); ``ValueError`` names a bad key."""
    if "task" not in keys:
        raise ValueError(f"{next(iter(keys))}= describes a task of your own; give task=FILE.jsonl with it")
    fixed = grids.task_overrides(keys, overrides)
    if not keys.get("model") and not any(o.startswith("backbone=") for o in overrides):
        choice = compose_config([f"experiment={grids.EXPERIMENT}", *fixed], with_hydra=True).hydra.runtime.choices
        fixed.append(f"backbone={choice['backbone']}")  # make compare's model, not Table 2's
    methods = grids.comma_list(keys["methods"], "methods") if "methods" in keys else grids.default_methods()
    groups = []
    for epsilon in grids.budgets(keys):
        if epsilon not in grids.PRIVACY_GROUPS:
            raise ValueError(f"eps={keys['eps']}: the sweep takes budgets among inf, 6 and 3 (the shipped privacy "
                             "groups); tune another ε with privacy=eps6 privacy.epsilon=X privacy.name=epsX")
        groups.append(grids.PRIVACY_GROUPS[epsilon])
    return [*fixed, f"method={','.join(methods)}", f"privacy={','.join(groups)}"]


def sweep_overrides(keys: dict[str, str], overrides: Sequence[str]) -> list[str]:
    """The sweep's overrides: the user's, each ``tune.lr_factor`` a float literal, behind
    :func:`task_sweep`'s when ``keys`` (``task=`` and ``make compare``'s keys) describe a user's task;
    ``ValueError`` naming the bad argument."""
    out = []
    parser = OverridesParser.create()
    for arg in overrides:
        override = parser.parse_override(arg)
        if override.get_key_element() == "experiment":
            raise ValueError(f"{arg}: the sweep is experiment=tune (conf/experiment/tune.yaml); leave experiment= out")
        if override.get_key_element() == "tune.lr_factor":  # floats, as the runner's validation makes them,
            values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [  # so the
                override.get_value_element_as_str()]  # planned run hash is the trained one
            arg = f"tune.lr_factor={','.join(_float_text(v) for v in values)}"
        out.append(arg)
    if keys:
        if any(o.split("=", 1)[0] in ("suite", "method", "privacy") for o in out):
            raise ValueError("task= sets suite=custom; choose methods with methods= and budgets with eps=")
        out = [*task_sweep(keys, out), *out]
    return out


def _float_text(value: str | float) -> str:
    """A factor as a float literal (``1`` → ``1.0``); ``ValueError`` names a non-number."""
    try:
        return repr(float(value))
    except ValueError:
        raise ValueError(f"tune.lr_factor={value}: give positive numbers, e.g. tune.lr_factor=0.1,1,10") from None


def _fixed(overrides: Sequence[str]) -> list[str]:
    """The user's overrides without the cell and factor axes (they are set per extension job)."""
    parser = OverridesParser.create()
    return [o for o in overrides if parser.parse_override(o).get_key_element() not in (*CELL_KEYS, "tune.lr_factor")]


def launch_round(launcher: str, groups: Sequence[tuple[list[str], list[launch.Job]]], workers: int | None,
                 log_dir: Path) -> list[str]:
    """Train the jobs of each (overrides, jobs) group, all at once on the local pool; returns the failure lines."""
    if launcher == "local":
        groups = [([], [job for _, jobs in groups for job in jobs])]
    failures = []
    for overrides, jobs in groups:
        if jobs:
            _, failure = launch.launch(EXPERIMENT, launcher, jobs, workers, overrides, log_dir)
            failures += [failure] if failure else []
    return failures


def sweep(overrides: Sequence[str], launcher: str, workers: int | None, log_dir: Path) -> tuple[list[Point], list[str]]:
    """Run the base grid, then the edge extensions round by round; every point with its score."""
    points: dict[tuple[Cell, float, int], Point] = {}
    groups = [list(overrides)]
    base: list[float] = []
    failures: list[str] = []
    for round_ in range(1 + MAX_EXTEND):
        planned = [(g, *launch.plan(EXPERIMENT, g)) for g in groups]  # finished runs tagged into the view
        new = [Point.of(job) for _, pending, finished in planned for job in (*pending, *finished)]
        n_pending = sum(len(pending) for _, pending, _ in planned)
        label = "base grid" if round_ == 0 else f"edge extension {round_}"
        print(f"tune, {label}: {len(new)} runs, {len(new) - n_pending} finished, {n_pending} to run", flush=True)
        failures += launch_round(launcher, [(g, pending) for g, pending, _ in planned], workers, log_dir)
        for p in new:
            folder = p.job.folder
            p.final = _record(folder) if store.inspect_run(folder).state == "finished" else None
            points[p.cell, p.factor, p.seed] = p
        if round_ == 0:
            base = sorted({p.factor for p in new})
        by_cell = scores_by_cell(points.values())
        groups = [[*_fixed(overrides), *cell.overrides(), f"tune.lr_factor={_float_text(nxt)}"]
                  for cell, scores in sorted(by_cell.items()) if (nxt := extension(scores, base)) is not None
                  and not any(key[:2] == (cell, nxt) for key in points)]
        if not groups:
            break
    return sorted(points.values(), key=lambda p: (p.cell, p.factor, p.seed)), failures


def _record(folder: Path) -> FinalRecord | None:
    """A finished tuning run's record; None (no score) when it does not parse into the core's type."""
    try:
        return store.read_record(folder)
    except RecordError:
        return None


def by_rate(points: Iterable[Point]) -> dict[Cell, dict[float, list[Point]]]:
    """Cell → {factor: its runs, one per tuning seed, in seed order}."""
    out: dict[Cell, dict[float, list[Point]]] = {}
    for p in sorted(points, key=lambda p: p.seed):
        out.setdefault(p.cell, {}).setdefault(p.factor, []).append(p)
    return out


def scores_by_cell(points: Iterable[Point]) -> dict[Cell, dict[float, Score]]:
    """Cell → {factor: :class:`Score` over its seeds (NaN while a seed's run lacks a score)}."""
    return {cell: {f: score_of([p.final or FinalRecord() for p in ps], [p.seed for p in ps]) for f, ps in rates.items()}
            for cell, rates in by_rate(points).items()}


def seed_picks(points: Iterable[Point]) -> dict[Cell, dict[int, float | None]]:
    """Cell → {tuning seed: the factor :data:`RULE` picks from that seed's runs alone} (None: no score)."""
    out: dict[Cell, dict[int, float | None]] = {}
    for cell, rates in by_rate(points).items():
        seeds = sorted({p.seed for ps in rates.values() for p in ps})
        out[cell] = {s: choose({f: score_of([p.final or FinalRecord()], [s]) for f, ps in rates.items() for p in ps if p.seed == s})
                     for s in seeds}
    return out


def pick_changes(points: Sequence[Point]) -> dict[str, list[int]] | None:
    """How far :data:`RULE`'s pick moves with the tuning seed: per privacy kind (``private``: finite ε,
    ``non_private``) ``[cells whose seeds pick different rates, cells]``, and ``steps``: the count of
    those cells by the largest move between two seeds, in steps of the base grid (a factor of √10),
    index 0 for one step; None with fewer than two tuning seeds."""
    picks = seed_picks(points)
    if not picks or max(len(by_seed) for by_seed in picks.values()) < 2:
        return None
    private = {p.cell: math.isfinite(float(p.fields["epsilon"])) for p in points}
    out: dict[str, list[int]] = {"private": [0, 0], "non_private": [0, 0], "steps": []}
    for cell, by_seed in picks.items():
        kind = out["private" if private[cell] else "non_private"]
        kind[1] += 1
        chosen = [f for f in by_seed.values() if f is not None]
        if len(set(chosen)) > 1:
            kind[0] += 1
            steps = max(1, round(math.log(max(chosen) / min(chosen)) / math.log(math.sqrt(10))))
            out["steps"] += [0] * (steps - len(out["steps"]))
            out["steps"][steps - 1] += 1
    return out


def pick_changes_line(changes: Mapping[str, list[int]] | None, seeds: Sequence[int]) -> str:
    """One sentence of :func:`pick_changes` ('' with one tuning seed)."""
    if changes is None:
        return ""
    (moved_p, cells_p), (moved_n, cells_n) = changes["private"], changes["non_private"]
    by_steps = ", ".join(f"{n} by {k + 1} grid step{'s' if k else ''}" for k, n in enumerate(changes["steps"]) if n)
    return (f"Picked from each tuning seed alone ({', '.join(map(str, seeds))}), the rule's rate differs between seeds "
            f"in {moved_p} of {cells_p} private cells and {moved_n} of {cells_n} non-private cells"
            + (f" ({by_steps})" if by_steps else "") + "; the chosen rates use the mean over the seeds.")


# ------------------------------------------------------------------------------------------- outputs

def frame(points: Sequence[Point]) -> pd.DataFrame:
    """One row per cell and rate: cell, ε, factor, rate, default rate, score (mean over the tuning seeds)
    and its standard error, chosen, the seeds and run hashes, the runs without a score."""
    rows, all_scores = [], scores_by_cell(points)
    for cell, rates in by_rate(points).items():
        scores = all_scores[cell]
        chosen = choose(scores)
        for f, ps in sorted(rates.items()):
            p = ps[0]
            rows.append({"suite": cell.suite, "privacy": cell.privacy, "epsilon": p.fields["epsilon"],
                         "method": cell.method, "factor": f, "lr": p.lr, "default_lr": p.default_lr,
                         "validation_score": scores[f].mean, "validation_se": scores[f].se, "chosen": chosen == f,
                         "seeds": " ".join(str(q.seed) for q in ps), "run_hashes": " ".join(q.job.run_hash for q in ps),
                         "unscored": " ".join(q.job.run_hash for q in ps if math.isnan(q.score))})
    return pd.DataFrame(rows)


def to_markdown(df: pd.DataFrame, scale: str, header: Mapping[str, object], title: str = "") -> str:
    """The tuning table: a row per cell, a column per rate factor (the score; the chosen one in bold)."""
    factors = sorted(df["factor"].unique())
    lines = [f"# Learning-rate sweep, {title or f'{scale} scale'} (validation split)", "",
             f"Rule (the same for every method): {RULE}. Tuning seeds: {header['seeds']}; validation rows: "
             f"{header['validation']}. Columns: the rate as a multiple of the default rate (Table 8 × train.lr_multiplier); "
             "cells: validation score, the chosen rate's in **bold** (± its standard error in the last column); an edge "
             "optimum adds a rate past the edge.",
             *(["", pick_changes_line(header["pick_changes"], header["seeds"])] if "pick_changes" in header else []),
             "", "Choosing a rate on private validation data is not covered by ε.", "",
             "| suite | privacy | method | default lr | " + " | ".join(f"×{f:.3g}" for f in factors)
             + " | chosen lr | validation score |", "|" + "---|" * (6 + len(factors))]
    for (suite, privacy, method), part in df.groupby(["suite", "privacy", "method"], sort=False):
        by_factor = part.set_index("factor")
        cells = []
        for f in factors:
            if f not in by_factor.index:
                cells.append("")
                continue
            score = by_factor.loc[f, "validation_score"]
            text = "—" if pd.isna(score) else f"{score:.3f}"
            cells.append(f"**{text}**" if by_factor.loc[f, "chosen"] else text)
        pick = part[part["chosen"]]
        chosen = "—" if pick.empty else f"{pick['lr'].iloc[0]:.3g}"
        score = "—" if pick.empty else f"{pick['validation_score'].iloc[0]:.3f} ± {pick['validation_se'].iloc[0]:.3f}"
        lines.append(f"| {suite} | {privacy} | {method} | {part['default_lr'].iloc[0]:.3g} | " + " | ".join(cells)
                     + f" | {chosen} | {score} |")
    missing = df[df["unscored"] != ""]
    lines += ["", "Runs without a score: " + (", ".join(f"{r.suite}/{r.privacy}/{r.method} ×{r.factor:g} ({r.unscored})"
                                                       for r in missing.itertuples()) or "none")]
    return "\n".join(lines) + "\n"


def plot(df: pd.DataFrame, path: Path, title: str) -> Path:
    """Validation score vs rate: a panel per suite × privacy level, a line per method, chosen rates starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites, privacies = list(dict.fromkeys(df["suite"])), list(dict.fromkeys(df["privacy"]))
    methods = list(dict.fromkeys(df["method"]))
    fig, axes = plt.subplots(len(suites), len(privacies), figsize=(3.8 * len(privacies), 3.0 * len(suites)),
                             squeeze=False)
    for r, suite in enumerate(suites):
        for c, privacy in enumerate(privacies):
            ax = axes[r][c]
            for i, method in enumerate(methods):
                part = df[(df["suite"] == suite) & (df["privacy"] == privacy) & (df["method"] == method)]
                part = part.sort_values("lr")
                if part.empty:
                    continue
                ax.plot(part["lr"], part["validation_score"], "o-", color=f"C{i % 10}", label=method, ms=3)
                pick = part[part["chosen"]]
                ax.plot(pick["lr"], pick["validation_score"], "*", color=f"C{i % 10}", ms=11)
            ax.set_xscale("log")
            ax.set_title(f"{suite}, {privacy}", fontsize=9)
            ax.tick_params(labelsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"Learning-rate sweep, {title}: validation score vs rate (★ chosen)", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def tuned_yaml(points: Sequence[Point], df: pd.DataFrame, header: Mapping[str, object]) -> str:
    """``conf/tuned/<scale>.yaml``: the header and one entry per cell (its match fields and chosen rate;
    ``df`` is :func:`frame` of ``points``)."""
    fields = {(p.cell.suite, p.cell.privacy, p.cell.method): p.fields for p in points}
    rates = []
    for key, part in df.groupby(["suite", "privacy", "method"], sort=False):
        r = part[part["chosen"]].iloc[0]
        rates.append({**fields[key], "lr": float(r["lr"]), "factor": float(r["factor"]),
                      "default_lr": float(r["default_lr"]), "validation_score": round(float(r["validation_score"]), 6),
                      "validation_se": round(float(r["validation_se"]), 6),
                      "at_edge": r["factor"] in (part["factor"].min(), part["factor"].max())})
    note = ("# Generated by pipelines/verbs/tune.py (`make tune`); do not edit: rerun the command in `generated` to\n"
            "# regenerate. Read by pipelines/config/tuned_rates.py for runs whose fields match an entry.\n")
    return note + yaml.safe_dump({"generated": dict(header), "rates": rates}, sort_keys=False, width=120)


def main(overrides: Sequence[str], *, jobs: int | None = None, task: str | None = None, eval: str | None = None,
         type: str | None = None, labels: str | None = None, model: str | None = None, methods: str | None = None,
         eps: str | None = None) -> int:
    """Sweep the learning rate of every cell (each tuning seed: ``seed=1,2``) on validation rows, write the table,
    the figure and the chosen rates; exit 0, or 1 when a cell lacks a score. ``jobs``: local worker
    processes. ``task=FILE.jsonl`` and ``make compare``'s keys (``eval``, ``type``, ``labels``, ``model``,
    ``methods``, ``eps``) sweep the cells of ``python -m pipelines compare`` on that task instead."""
    given = {k: v for k, v in locals().items() if k not in ("overrides", "jobs") and v is not None}
    command = ["python", "-m", "pipelines", "tune", *overrides, *(f"{k}={v}" for k, v in given.items()),
               *([f"jobs={jobs}"] if jobs else [])]
    launcher = launch.override_value(overrides, "launcher", "local")
    if (code := launch.launcher_error(launcher)) is not None:  # before the sweep's validation
        return code
    overrides = sweep_overrides(given, overrides)
    cfg0 = job_config([f"experiment={EXPERIMENT}", *(o for o in overrides if "," not in o)])
    scale, results = launch.override_value(overrides, "scale", "embedded"), Path(str(cfg0.results_dir))
    points, failures = sweep(overrides, launcher, jobs, results / "logs" / EXPERIMENT)
    from pipelines.runs.runner import git_state

    commit, dirty = git_state()
    n_validation = int(cfg0.suite.validation_per_task)
    header = {"command": shlex.join(command), "commit": commit, "dirty": dirty,
              "date": store.utc_stamp(), "seeds": sorted({p.seed for p in points}),
              "validation_per_task": n_validation,
              "validation": f"{n_validation} per scored task from the training pool, disjoint from the training and "
                            "evaluation rows",
              "rule": RULE, "grid": sorted({p.factor for p in points}),
              **{key: list(dict.fromkeys(p.fields[field] for p in points)) for key, field in COVERS.items()}}
    name, title, target = "tune", "", tuned_dir() / f"{scale}.yaml"
    if cfg0.suite.name == "custom":  # a user's task: its own table and rates, beside its runs
        task = f"{Path(str(cfg0.suite.custom.train)).stem}-{str(cfg0.suite.custom.train_sha256)[:8]}"
        name, title = f"tune-{task}", f"{Path(str(cfg0.suite.custom.train)).name}, {scale} scale"
        target = user_tuned_dir(results) / f"custom-{task}.{scale}.yaml"
        del header["validation_per_task"]  # a user's task holds a fraction out, each row by its own draw
        fraction = float(cfg0.suite.custom.validation_fraction)
        header.update(task=str(cfg0.suite.custom.train), task_sha256=str(cfg0.suite.custom.train_sha256),
                      validation_fraction=fraction,
                      validation=f"held out of the training rows, each row by its own draw with chance {fraction:g}, "
                                 "never the evaluation rows")
    if (changes := pick_changes(points)) is not None:  # two or more tuning seeds: how much the pick moves
        header["pick_changes"] = changes
    df = frame(points)
    out = results / "tables"
    out.mkdir(parents=True, exist_ok=True)
    md = to_markdown(df, scale, header, title)
    write_text_atomic(out / f"{name}.{scale}.md", md)
    df.to_csv(out / f"{name}.{scale}.csv", index=False, float_format="%.6g")
    plot(df, out / f"{name}.{scale}.png", title or f"{scale} scale")
    print(md)
    print(f"wrote {out / f'{name}.{scale}.md'}, {out / f'{name}.{scale}.csv'}, {out / f'{name}.{scale}.png'}")
    for failure in failures:
        print(failure, file=sys.stderr)
    unscored = {p.cell for p in points if math.isnan(p.score)}
    if unscored or not points:
        print(f"{len(unscored)} cell(s) lack a score; {target} not written (rerun the same "
              "command: finished runs are kept)", file=sys.stderr)
        return 1
    target.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(target, tuned_yaml(points, df, header))
    print(f"wrote {target}: the chosen rate of {len({p.cell for p in points})} cells (read by every run of this "
          "budget" + (", task and model" if cfg0.suite.name == "custom" else "") + ")")
    return 0

