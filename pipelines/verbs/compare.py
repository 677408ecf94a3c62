"""Compare PRISM and the baselines on your own task (and model) in one command.

    python -m pipelines compare task=TASK.jsonl [model=DIR] [methods=..] [eps=inf,6,3] [seed=42,43] ...
    make compare TASK=TASK.jsonl [MODEL=DIR] [SEEDS=..] [EPS=..] [METHODS=..] [TYPE=..] [LABELS=..]

The grid is methods × privacy settings (non-DP, ε = 6, ε = 3 by default; ``eps=`` gives the list,
``inf`` for non-DP) × seeds, every job ``suite=custom`` on the task file (its identifier pinned in the
config, so an edited file is a new run: :func:`prism.data.custom.file_id`, a keyed hash, never the file's
sha256, docs/custom-task.md) and ``backbone=local`` when ``model=`` is given. Every job is
validated before anything runs (a bad file is one line, exit code 2). The runs are ordinary
:mod:`pipelines.runs.runner` jobs in the shared run store (tagged into the ``compare`` view): finished ones
are skipped, interrupted ones resume, ``launcher=slurm`` submits them through Hydra's submitit
launcher, ``logging=`` sends them to W&B as any run. Budgets and rates come from the scale
(``scale=embedded`` by default: its steps, batch and 10× Table 8 learning rates); any override
(``train.steps=60``, ``method.lr=...``, ``lora=r8``) applies to every job.

The table is built by :mod:`pipelines.tables` (Table 2's layout: Setting × Method, one column per
metric of the task, the privacy–utility figure), under a header naming the file and its identifier, the
model, N, the steps and the rates; it goes to ``<results_dir>/tables/compare-<file>-<id8>.<scale>.*``
(``<id8>``: the identifier's first 8 hex digits).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from pipelines.config import grids, tuned_rates
from pipelines.config.grids import (
    EXPERIMENT,
    INTEGERS,
    absolute,
    budgets,
    comma_list,
    default_methods,
    privacy_overrides,
    task_overrides,
)
from pipelines.config.validate import load_experiment
from pipelines.runs import launch
from pipelines.tables.build import TableResult, build_table
from pipelines.tables.records import RunRecord, read_run_folder
from pipelines.tables.render import plot_privacy_utility, to_markdown, write_outputs
from pipelines.tables.specs import TableSpec, method_label, setting_label, suite_columns
from prism.data.custom import file_id

KEY_OVERRIDES = grids.KEY_OVERRIDES  # the overrides of this command's keys (pipelines.__main__.as_typed)


@dataclasses.dataclass
class Plan:
    """The comparison: per privacy setting the overrides of its grid (``experiment=compare``'s sweep, expanded as
    every verb expands one: :func:`pipelines.config.validate.load_experiment`) and its jobs, methods × seeds."""

    task: Path
    file_id: str
    settings: list[list[str]]
    methods: list[str]
    seeds: list[int]
    sweeps: list[list[str]]
    grids: list[list[launch.Job]]

    @property
    def jobs(self) -> list[launch.Job]:
        """Every job, one per setting × method × seed in that order."""
        return [job for grid in self.grids for job in grid]

    @property
    def configs(self) -> list[Any]:
        """The jobs' validated configs."""
        return [job.cfg for job in self.jobs]


def plan(keys: dict[str, Any], overrides: Sequence[str]) -> Plan:
    """Every job of the comparison, validated; ``ValueError`` / :class:`ConfigError` on one line.
    ``keys``: ``task`` and the other task keys of ``make compare``, ``seed`` (comma-separated)."""
    task_fixed = task_overrides(keys, overrides)
    task = absolute(keys["task"], "task")
    identifier = file_id(task)
    methods = comma_list(keys["methods"], "methods") if "methods" in keys else default_methods()
    settings = [privacy_overrides(e) for e in budgets(keys)]
    seeds = comma_list(keys["seed"], "seed", INTEGERS) if "seed" in keys else []
    sweeps = [[*setting, f"method={','.join(methods)}", *([f"seed={','.join(map(str, seeds))}"] if seeds else []),
               *task_fixed, *overrides] for setting in settings]  # what tells the jobs apart first (progress lines)
    grids_ = [[launch.Job.of(job, cfg) for job, cfg in load_experiment(EXPERIMENT, sweep, here=True)]
              for sweep in sweeps]
    return Plan(task, identifier, settings, methods, seeds, sweeps, grids_)


# ------------------------------------------------------------------------------------------ table
def table_spec(p: Plan) -> TableSpec:
    """Table 2's layout for this task: Setting × Method, one column per metric of the task."""
    from prism.data.custom import task_rule

    columns = task_rule(p.configs[0].suite.custom).columns

    def values(spec: TableSpec, by_suite: dict[str, Sequence[RunRecord]]) -> dict[str, float]:
        means = suite_columns(by_suite.get("custom", []))
        return {c: means.get(c, math.nan) for c in spec.columns}

    return TableSpec(f"{EXPERIMENT}-{p.task.stem}-{p.file_id[:8]}", f"PRISM and the baselines on {p.task.name}",
                     ("Setting", "Method"), "Setting", ("custom",), columns,
                     lambda record, paper: (setting_label(record), method_label(record)), values,
                     axes=("method", "privacy", "seed"))


def header(p: Plan, result: TableResult) -> list[str]:
    """What the table was computed from: the file and its identifier, the model, N, steps and rates."""
    cfg = p.configs[0]
    custom, backbone = cfg.suite.custom, cfg.backbone
    model = f"{backbone.path} (backbone=local)" if backbone.name == "local" else backbone.name
    records = [read_run_folder(j.folder) for j in p.jobs]
    finished = [r for r in records if r.state == "finished"]
    n_train = next((r.final.n_train for r in finished), None)
    n_eval = next((sum((r.final.eval_rows or {}).values()) for r in finished), None)
    q = next((r.final.sample_rate for r in finished), None)
    sigmas = {setting_label(r): r.final.sigma for r in finished}
    rates: dict[str, dict[str, float]] = {}
    for c in p.configs:
        record = RunRecord("", "", config=dict(c))
        rates.setdefault(setting_label(record), {})[method_label(record)] = c.method.lr
    stored = [r.config if r.state == "finished" else c for r, c in zip(records, p.configs)]  # as recorded at compose
    tuned = {s.file for c in stored if (s := tuned_rates.recorded_lr_source(c)) is not None}
    unrecorded = sum(not tuned_rates.lr_source_recorded(c) for c in stored)
    told = [f"tuned on validation rows by `make tune` ({', '.join(sorted(tuned))}; ε covers one training run per "
            "cell, not this tuning: one DP run per candidate rate on the same training rows, picked by un-noised "
            "validation scores)"] if tuned else []
    told += [f"whether `make tune` chose the rates of {unrecorded} of the {len(stored)} runs is not recorded "
             "(stored without train.lr_source)"] if unrecorded else []
    source = "; ".join(told) or "the scale's defaults (Table 8 × train.lr_multiplier); `make tune TASK=...` tunes them"
    lines = [f"# {result.spec.title}", "",
             f"- Task: `{p.task}` (identifier `{p.file_id}`, a keyed hash: docs/custom-task.md), type {custom.type}"
             + (f", labels {list(custom.labels)}" if custom.type == "classification" else "")
             + (f", tolerance {custom.tolerance:g}" if custom.type == "number" else ""),
             "- Evaluation rows: " + (custom.eval or f"held out of the file, each row by its own draw with chance "
                                      f"{custom.eval_fraction:g}")
             + (f", {n_eval} rows" if n_eval is not None else ""),
             f"- Model: {model}, {backbone.dtype}, LoRA r={cfg.lora.r} on {list(cfg.lora.targets)}"
             + (f", last {backbone.lora_layers} layer(s)" if backbone.lora_layers else ", every layer"),
             f"- N (train) = {n_train if n_train is not None else '?'}, steps {cfg.train.steps}, batch B = "
             f"{cfg.train.batch_size}" + (f", sampling rate q = {q:.4g}" if q else "")
             + f", δ = {cfg.privacy.delta:g}, clip C = {cfg.privacy.clip_norm:g}, scale {cfg.suite.scale}",
             f"- Learning rates, {source}: " + "; ".join(
                 f"{setting} " + ", ".join(f"{m} {lr:.3g}" for m, lr in by_method.items())
                 for setting, by_method in rates.items()),
             "- Noise multiplier σ: " + (", ".join(f"{s} {v:.4g}" for s, v in sigmas.items() if v) or "no private run yet"),
             f"- Seeds: {', '.join(map(str, p.seeds)) if p.seeds else cfg.seed}; a cell is the mean over its seeds", ""]
    return lines


def render(p: Plan) -> list[Path]:
    """Build the table from the plan's runs and write it (Markdown with the header, CSV, LaTeX, the
    missing list and the privacy–utility figure); returns the paths."""
    records = [read_run_folder(job.folder) for job in p.jobs]
    spec = table_spec(p)
    paper = pd.DataFrame(columns=[*spec.keys, *spec.columns])  # no reference numbers for a user task
    result = build_table(spec, records, str(p.configs[0].suite.scale), paper=paper)
    out_dir = Path(str(p.configs[0].results_dir)) / "tables"
    paths = write_outputs(result, out_dir)
    if not paths:
        return []
    body = to_markdown(result).splitlines()[1:]  # the aggregator's table below this task's own title
    body = [line for line in body if not line.startswith("Scale:")]  # the aggregator's bold / tie rule is kept
    paths[0].write_text("\n".join([*header(p, result), *body]) + "\n")
    paths.append(plot_privacy_utility(result, paths[0].with_name(paths[0].name.replace(".md", "_privacy_utility.png"))))
    return paths


def main(overrides: Sequence[str], *, task: str, model: str | None = None, eval: str | None = None,
         type: str | None = None, labels: str | None = None, methods: str | None = None, eps: str | None = None,
         seed: str | None = None, jobs: int | None = None) -> int:
    """Train ``methods`` (default all six) × the privacy budgets of ``eps`` (default inf,6,3; inf: non-DP)
    × ``seed`` (a comma-separated list) on the task file ``task`` (.jsonl/.csv of prompt/target rows;
    ``eval``: its evaluation file, ``type``: classification|number|exact, ``labels``: the classes,
    ``model``: a local model folder), then render the table. ``jobs``: local worker processes; the
    overrides (``scale=``, ``launcher=``, ``train.steps=60``, ...) apply to every job. Every job is
    validated first. Exit 0, 1 (a run failed) or 2 (bad input)."""
    keys = {k: v for k, v in locals().items() if k not in ("overrides", "jobs") and v is not None}
    launcher = launch.override_value(overrides, "launcher", "local")
    if (code := launch.launcher_error(launcher)) is not None:  # before every job is validated
        return code
    p = plan(keys, overrides)
    pending, finished = launch.split_finished(EXPERIMENT, p.jobs)
    print(f"compare {p.task.name} (identifier {p.file_id[:12]}): {len(p.methods)} methods x {len(p.settings)} privacy "
          f"settings x {max(1, len(p.seeds))} seed(s) = {len(p.jobs)} runs, {len(finished)} finished, "
          f"{len(pending)} to run", flush=True)
    failure = ""
    log_dir = Path(str(p.configs[0].results_dir)) / "logs" / EXPERIMENT
    if pending and launcher == "local":
        _, failure = launch.launch(EXPERIMENT, "local", pending, jobs, [], log_dir)
    elif pending:  # one Hydra multirun per privacy setting, sweeping methods and seeds
        waiting = {id(job) for job in pending}
        for sweep, grid in zip(p.sweeps, p.grids, strict=True):
            todo = [job for job in grid if id(job) in waiting]
            if todo:
                submitted, failure = launch.launch(EXPERIMENT, launcher, todo, jobs, sweep, log_dir)
                if failure and not submitted:
                    break
    paths = render(p)
    for path in paths:
        print("wrote", path)
    if paths:
        print(paths[0].read_text())
    if failure:
        print(failure, file=sys.stderr)
        return 1
    return 0

