"""Every grid's jobs with their run hashes, one line ``experiment scale run_hash overrides`` per job.

    PYTHONPATH=$PWD python scripts/grid_hashes.py > hashes.txt

The grids of ``python -m pipelines reproduce`` (table2 to table5), the learning-rate sweep's base grid
(``tune``), the candidates of ``select`` (``table2-accounted``, seeded plans), ``compare`` on the example
task of docs/custom-task.md and ``diagnostics``, at ``scale=embedded`` and ``scale=paper``. The tables, the
sweep and diagnostics are composed and typed as the runner types them (the hash does not depend on the
local data, so paper scale needs none); ``select`` and ``compare`` plan through their own validation, at
``scale=embedded`` only. Two outputs of this script from two trees are equal when no run hash moved.
"""
from __future__ import annotations

import shlex
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from omegaconf import DictConfig

from pipelines.config.compose import compose_config, compose_job, experiment_jobs, job_config
from pipelines.config.identity import run_hash
from pipelines.config.schema import record

REPO = Path(__file__).resolve().parents[1]
SCALES = ("embedded", "paper")
TABLES = ("table2", "table3", "table4", "table5", "tune")
RESULTS = "/tmp/grid-hashes"  # select's plan file would go there (seeded plans: none is written)
TASK = REPO / "examples" / "tweet_sentiment"
COMPARE_KEYS = {"task": str(TASK / "train.jsonl"), "eval": str(TASK / "eval.jsonl"),
                "labels": "positive,negative,neutral"}  # docs/custom-task.md's `make compare`


def lines(experiment: str, scale: str, jobs: Sequence[tuple[Sequence[str], DictConfig]]) -> Iterator[str]:
    for overrides, cfg in jobs:
        yield f"{experiment} {scale} {run_hash(cfg)} {shlex.join(overrides)}"


def composed(experiment: str, overrides: Sequence[str]) -> list[tuple[list[str], DictConfig]]:
    """The distinct jobs of ``experiment``'s grid with their typed configs, as the runner hashes them."""
    distinct: dict[str, tuple[list[str], DictConfig]] = {}
    for job in experiment_jobs(experiment, overrides):
        cfg = record(compose_job(job))
        distinct.setdefault(run_hash(cfg), (job, cfg))
    return list(distinct.values())


def select_jobs(fixed: Sequence[str]) -> list[tuple[list[str], DictConfig]]:
    """The candidates of ``python -m pipelines select`` with its default cells and seed (seeded plans)."""
    from pipelines.config.grids import budgets, comma_list
    from pipelines.verbs import select

    params = compose_config([f"experiment={select.EXPERIMENT}"], with_hydra=True).hydra.sweeper.params
    cfg = record(job_config([f"experiment={select.EXPERIMENT}", *fixed]))
    selections = select.plan(cfg, fixed, comma_list(str(params["method"]), "methods"), budgets({"eps": "6,3"}),
                             comma_list(str(params["suite"]), "suites"), [int(cfg.seed)])
    return [(job.overrides, job.cfg) for s in selections for job in s.jobs]


def compare_jobs(fixed: Sequence[str]) -> list[tuple[list[str], DictConfig]]:
    """The jobs of ``make compare`` on the example task (the task files pinned by their identifiers)."""
    from pipelines.verbs.compare import plan

    return [(job.overrides, job.cfg) for job in plan(dict(COMPARE_KEYS), fixed).jobs]


def main() -> int:
    for scale in SCALES:
        remote = [f"scale={scale}", "launcher=slurm", f"results_dir={RESULTS}"]
        for experiment in TABLES:
            print(*lines(experiment, scale, composed(experiment, remote[:1])), sep="\n")
        if scale == "embedded":
            print(*lines("table2-accounted", scale, select_jobs(remote)), sep="\n")
            print(*lines("compare", scale, compare_jobs(remote)), sep="\n")
        diagnostics = ["experiment=diagnostics", *remote[:1], *(["suite=math10k"] if scale == "paper" else [])]
        print(*lines("diagnostics", scale, [(diagnostics, record(job_config(diagnostics)))]), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
