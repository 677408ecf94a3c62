"""Reproduce one paper table: expand its grid, run what is not finished, aggregate.

    python -m pipelines.reproduce N [scale=embedded|paper] [launcher=local|slurm] [jobs=K] [overrides...]
    python -m pipelines.reproduce tune [...]     # the learning-rate sweep, :mod:`pipelines.tune`
    python -m pipelines.reproduce custom TASK.jsonl [model=DIR] ...   # your own task: pipelines.compare

``launcher=local``: K worker processes (``OMP_NUM_THREADS=1`` each, :mod:`pipelines.worker`;
without ``jobs=``, K is :func:`pipelines.launch.default_jobs` of the cores and the available memory, printed) that
run the jobs one after another, each job exactly ``python -m pipelines.run <job>`` with its output
in ``<results_dir>/logs/tableN/<hash>.log``, the backbone loaded once per worker; a progress bar
over the grid and one line per running job (its last ``metrics.jsonl`` step). SIGTERM or SIGINT
(Ctrl-C) stops every worker: a running job records its run as stopped (``status.json``: stopped,
``interrupted (SIGTERM)``, resumed from its checkpoint by the same command), queued jobs do
not start, one line says so, and the exit code is 128 + the signal number (:func:`pipelines.launch.run_local`).
``launcher=slurm`` (or ``submitit_local``): Hydra multirun through hydra-submitit-launcher
(``python -m pipelines.run -m experiment=tableN ...``); the submitting process blocks until the
array ends, so start it under tmux/nohup. SLURM is checked before the grid is validated
(:func:`pipelines.launch.launcher_error`: no ``sbatch``/``squeue``, exit code 2; a controller that does not answer,
exit code 1); a failed ``sbatch`` is reported as ``0 of N submitted: <reason>`` (exit code 1, no
traceback, no table touched); a signal stops the multirun and its local jobs
(:func:`pipelines.launch.run_hydra_multirun`). Finished runs — of
this experiment or of any other whose grid holds the same config (the run store is shared, see
:mod:`pipelines.store`) — are skipped and tagged into this experiment's view; nothing is deleted,
and the aggregator runs at the end when a run was trained.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from pipelines import launch
from pipelines.compose import COMPOSE_ERRORS, error_line
from pipelines.validate import ConfigError


def parse_args(argv: Sequence[str]) -> tuple[str, int | None, list[str]]:
    """``N [jobs=K] [overrides]`` → (experiment, K or None when not given, overrides); ``ValueError``
    naming the bad argument."""
    if not argv or not argv[0].removeprefix("table").isdigit():
        raise ValueError("the first argument is the table number, usage: python -m pipelines.reproduce N "
                         "[scale=..] [launcher=local|slurm] [jobs=K] [overrides]")
    experiment = f"table{argv[0].removeprefix('table')}"
    jobs, overrides = None, []
    for arg in argv[1:]:
        if arg.startswith("jobs="):
            jobs = launch.parse_jobs(arg.split("=", 1)[1])
        elif arg.startswith("-"):
            raise ValueError(f"unknown option {arg}, usage: python -m pipelines.reproduce N [scale=..] "
                             "[launcher=local|slurm] [jobs=K] [key=value overrides] (--help for more)")
        else:
            overrides.append(arg)
    return experiment, jobs, overrides


def main(argv: Sequence[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print("usage:", __doc__.split("\n\n")[1].strip(), "\n")
        print(__doc__.split("\n\n")[2].strip())
        print("Quote a value with spaces or non-ASCII characters for Hydra inside one shell word, e.g.\n"
              "  'results_dir=\"/tmp/my runs\"'  (make: ARGS=\"'results_dir=\\\"/tmp/my runs\\\"'\")")
        return 0
    if argv and argv[0] == "tune":  # the learning-rate sweep: its own rounds and outputs (pipelines/tune.py)
        from pipelines.tune import main as tune_main

        return tune_main(argv[1:])
    if argv and argv[0] == "custom":  # your own task: methods x privacy settings (pipelines/compare.py)
        from pipelines.compare import main as compare

        return compare(argv[1:])
    try:
        experiment, workers, overrides = parse_args(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    launcher = next((o.split("=", 1)[1] for o in overrides if o.startswith("launcher=")), "local")
    if (code := launch.launcher_error(launcher)) is not None:  # before the grid's validation, which takes a while
        return code
    try:
        pending, finished = launch.plan(experiment, overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except COMPOSE_ERRORS as err:
        print(f"error: {error_line(err)}", file=sys.stderr)
        return 2
    cfg0 = (pending + finished)[0].cfg  # results_dir and scale are one per grid
    print(f"{experiment}: {len(pending) + len(finished)} runs in the grid, {len(finished)} finished, "
          f"{len(pending)} to run", flush=True)
    submitted, failure = True, ""
    if pending:
        submitted, failure = launch.launch(experiment, launcher, pending, workers, overrides,
                                    Path(cfg0.results_dir) / "logs" / experiment)
    if submitted:
        launch.aggregate(experiment, str(cfg0.results_dir), str(cfg0.suite.scale))
    if failure:
        print(failure, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
