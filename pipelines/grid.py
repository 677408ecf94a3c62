"""The job list of an experiment's grid, for the ``slurm/`` scripts.

``python -m pipelines grid experiment=tableN|compare|tune [overrides...] [--pending] [--remote]`` prints
one job per line (shell-quoted overrides, :func:`pipelines.compose.experiment_jobs`) after validating
every job as ``python -m pipelines run`` does (:func:`pipelines.validate.load_experiment`; the first bad
job is one ``error:`` line naming the job and the field, exit code 2); ``--pending`` leaves out
finished runs (trained for any experiment: the run store is shared) and tags them into this
experiment's view; ``--remote``: the jobs run on other machines (SLURM), so the local device is not checked.
"""
from __future__ import annotations

import shlex
from collections.abc import Sequence

from pipelines import store
from pipelines.validate import load_experiment


def main(experiment: str, overrides: Sequence[str], pending: bool = False, remote: bool = False) -> int:
    """Print the jobs of ``experiment``'s grid; exit code 0 (bad input raises, one line)."""
    if experiment == "compare":  # the task files pinned as make compare pins them: the same runs
        from pipelines.compare import pin_task_files

        overrides = pin_task_files(overrides)
    lines = []
    for job, cfg in load_experiment(experiment, overrides, here=False if remote else None):
        if pending:
            root, run_hash = store.runs_root(cfg), store.run_hash(cfg)
            if store.inspect_run(store.find_run(root, run_hash)).state == "finished" and not cfg.force:
                store.tag(root, experiment, run_hash)
                continue
        lines.append(shlex.join(job))
    if lines:
        print("\n".join(lines))
    return 0
