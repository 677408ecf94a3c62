"""The job list of an experiment's grid, for the ``slurm/`` scripts.

``python -m pipelines.grid tableN [overrides...] [--pending] [--remote]`` prints one job per line
(shell-quoted overrides, :func:`pipelines.compose.experiment_jobs`) after validating every job as
``pipelines.run`` does (:func:`pipelines.validate.load_experiment`); ``--pending`` leaves out finished
runs (trained for any experiment: the run store is shared) and tags them into this experiment's view;
``--remote``: the jobs run on other machines (SLURM), so the local device is not checked. The first bad
job is one ``error:`` line on stderr naming the job and the field, exit code 2.
"""
from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence

from pipelines import store
from pipelines.compose import COMPOSE_ERRORS, error_line
from pipelines.validate import ConfigError, load_experiment

USAGE = "usage: python -m pipelines.grid tableN|compare|tune [overrides...] [--pending] [--remote]"
HELP = """prints every job of the table's grid, one line of shell-quoted overrides each, after validating
all of them as `python -m pipelines.run` does (the first bad one: one error line, exit code 2)
  --pending  leave out the runs already finished (they are tagged into the table's view)
  --remote   the jobs run on other machines (SLURM): do not check this machine's device
Values with spaces or non-ASCII characters: quote them for Hydra inside one shell word,
  e.g. 'results_dir="/tmp/my runs"'"""


def main(argv: Sequence[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(f"{USAGE}\n{HELP}")
        return 0
    flags = [a for a in argv if a.startswith("--")]
    if not argv or argv[0].startswith("-") or set(flags) - {"--pending", "--remote"}:
        bad = next((f for f in flags if f not in ("--pending", "--remote")), None)
        print(f"error: unknown option {bad}, " if bad else "", USAGE, sep="", file=sys.stderr)
        return 2
    args = [a for a in argv if a not in flags]
    experiment = f"table{args[0]}" if args[0].isdigit() else args[0]  # 2 or table2; compare, tune
    if experiment == "compare":  # the task files pinned as make compare pins them: the same runs
        from pipelines.compare import pin_task_files

        args = [args[0], *pin_task_files(args[1:])]
    lines = []
    try:
        for job, cfg in load_experiment(experiment, args[1:], here=False if "--remote" in flags else None):
            if "--pending" in flags:
                root, run_hash = store.runs_root(cfg), store.run_hash(cfg)
                if store.inspect_run(store.find_run(root, run_hash)).state == "finished" and not cfg.force:
                    store.tag(root, experiment, run_hash)
                    continue
            lines.append(shlex.join(job))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except COMPOSE_ERRORS as err:
        print(f"error: {error_line(err)}", file=sys.stderr)
        return 2
    if lines:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
