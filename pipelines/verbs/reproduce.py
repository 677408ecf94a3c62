"""Reproduce one paper table: expand its grid, run what is not finished, aggregate.

    python -m pipelines reproduce experiment=tableN [scale=embedded|paper] [launcher=local|slurm] [jobs=K] [overrides...]

``launcher=local``: K worker processes (``OMP_NUM_THREADS=1`` each, :mod:`pipelines.runs.worker`;
without ``jobs=``, K is :func:`pipelines.runs.launch.default_jobs` of the cores and the available memory, printed) that
run the jobs one after another, each job exactly ``python -m pipelines run <job>`` with its output
in ``<results_dir>/logs/tableN/<hash>.log``, the backbone loaded once per worker; a progress bar
over the grid and one line per running job (its last ``metrics.jsonl`` step). SIGTERM or SIGINT
(Ctrl-C) stops every worker: a running job records its run as stopped (``status.json``: stopped,
``interrupted (SIGTERM)``, resumed from its checkpoint by the same command), queued jobs do
not start, one line says so, and the exit code is 128 + the signal number (:func:`pipelines.runs.launch.run_local`).
``launcher=slurm`` (or ``submitit_local``): Hydra multirun through hydra-submitit-launcher
(``python -m pipelines run -m experiment=tableN ...``); the submitting process blocks until the
array ends, so start it under tmux/nohup. SLURM is checked before the grid is validated
(:func:`pipelines.runs.launch.launcher_error`: no ``sbatch``/``squeue``, exit code 2; a controller that does not answer,
exit code 1); a failed ``sbatch`` is reported as ``0 of N submitted: <reason>`` (exit code 1, no
traceback, no table touched); a signal stops the multirun and its local jobs
(:func:`pipelines.runs.launch.run_hydra_multirun`). Finished runs — of
this experiment or of any other whose grid holds the same config (the run store is shared, see
:mod:`pipelines.runs.store`) — are skipped and tagged into this experiment's view; nothing is deleted,
and the aggregator runs at the end when a run was trained. A grid whose seeds include a seed its tuned
rates were chosen on prints one line saying so (:func:`pipelines.config.tuned_rates.seed_overlap_line`).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from pipelines.config import tuned_rates
from pipelines.runs import launch

TABLES = ("table2", "table3", "table4", "table5")


def main(overrides: Sequence[str], *, experiment: str, jobs: int | None = None) -> int:
    """Run the unfinished jobs of ``experiment``'s grid (table2..table5; every job validated first) and
    render the table. ``jobs``: local worker processes (default: what the cores and the memory allow);
    the overrides (``scale=embedded|paper``, ``launcher=local|slurm|submitit_local``, ``seed=42,43,44``,
    any key of ``conf/``) apply to every job. Exit 0, 1 (a run failed or nothing was submitted), 2."""
    launcher = launch.override_value(overrides, "launcher", "local")
    if (code := launch.launcher_error(launcher)) is not None:  # before the grid's validation, which takes a while
        return code
    if experiment not in TABLES:
        raise ValueError(f"experiment={experiment} is not a paper table, use experiment= one of {', '.join(TABLES)}")
    pending, finished = launch.plan(experiment, overrides)
    cfg0 = (pending + finished)[0].cfg  # results_dir and scale are one per grid
    print(f"{experiment}: {len(pending) + len(finished)} runs in the grid, {len(finished)} finished, "
          f"{len(pending)} to run", flush=True)
    if overlap := tuned_rates.seed_overlap_line([job.cfg for job in pending + finished]):
        print(overlap, flush=True)
    submitted, failure = True, ""
    if pending:
        submitted, failure = launch.launch(experiment, launcher, pending, jobs, overrides,
                                           Path(cfg0.results_dir) / "logs" / experiment)
    if submitted:
        launch.aggregate(experiment, str(cfg0.results_dir), str(cfg0.suite.scale))
    if failure:
        print(failure, file=sys.stderr)
        return 1
    return 0
