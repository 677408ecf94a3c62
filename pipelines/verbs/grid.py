"""The job list of an experiment's grid for the ``slurm/`` scripts: ``python -m pipelines grid`` (:func:`main`;
jobs from :func:`pipelines.config.compose.experiment_jobs`, validated by :func:`pipelines.config.validate.load_experiment`)."""
from __future__ import annotations

import shlex
from collections.abc import Sequence

from pipelines.config.schema import ConfigError
from pipelines.config.validate import load_experiment
from pipelines.runs.launch import Job, split_finished

RUN_BY = {  # experiment -> (why its grid is not its job list, the command that runs it, on SLURM)
    "tune": ("rounds: rates past an edge are added from the scores, then the chosen rates are written",
             "python -m pipelines tune launcher=slurm"),
    "table2-accounted": ("each cell and seed draws its candidates, then publishes the best by a noised score",
                         "python -m pipelines select launcher=slurm"),
    "diagnostics": ("one measurement run, then its figures and Table 1",
                    "srun --gres=gpu:1 python -m pipelines diagnostics"),
}
"""Experiments whose jobs are not a fixed list of independent runs: ``slurm/submit.sh`` of one would
submit jobs that are not that experiment, so its list is refused with the command that runs it."""


def main(overrides: Sequence[str], *, experiment: str, pending: bool = False, remote: bool = False) -> int:
    """Print every job of ``experiment``'s grid (tableN or compare), one line of shell-quoted
    overrides each, after validating all of them as ``python -m pipelines run`` does (the first bad one:
    one error line, exit code 2). ``--pending``: leave out the runs already finished (they are tagged
    into the grid's view); ``--remote``: the jobs run on other machines (SLURM), so this machine's
    device is not checked. A value with spaces or non-ASCII characters is quoted for Hydra inside one
    shell word, e.g. 'results_dir="/tmp/my runs"'. An experiment of :data:`RUN_BY` is one
    :class:`ConfigError` line naming the command that runs it."""
    if experiment in RUN_BY:
        why, command = RUN_BY[experiment]
        raise ConfigError(f"experiment={experiment} is not a list of independent jobs ({why}); run it with "
                          f"{' '.join([command, *map(shlex.quote, overrides)])}")
    if experiment == "compare":  # the task files pinned as make compare pins them: the same runs
        from pipelines.config.grids import pin_task_files

        overrides = pin_task_files(overrides)
    jobs = [Job.of(o, cfg) for o, cfg in load_experiment(experiment, overrides, here=False if remote else None)]
    if pending:
        jobs = split_finished(experiment, jobs)[0]
    if jobs:
        print("\n".join(shlex.join(job.overrides) for job in jobs))
    return 0
