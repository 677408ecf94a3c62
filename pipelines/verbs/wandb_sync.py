"""Upload the offline W&B runs of a results folder: ``make wandb-sync`` (``DRY_RUN=1`` previews).

    python -m pipelines wandb-sync [folder=results/wandb] [--dry-run]

Finds every ``offline-run-*`` folder under the given directory that ``wandb sync`` has not marked
synced (it leaves ``run-<id>.wandb.synced`` beside the log) and passes them to ``wandb sync --yes``
(the pinned wandb has no ``--sync-all``; explicit run folders are its documented form). Before
uploading it checks for an API key and a connection to the server, because ``wandb sync`` itself
retries for minutes against an unreachable one: either problem is one ``error:`` line, exit code 2.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipelines.config.wandb_access import access_problem
from pipelines.runs.wandb_sync import offline_runs, wandb_cli


def main(*, folder: str = "results/wandb", dry_run: bool = False) -> int:
    """Upload (``--dry-run``: list) the unsynced offline runs under ``folder``; exit 0, 1 (``wandb sync``
    failed) or 2 (no folder, no key or no connection)."""
    directory = Path(folder)
    if not directory.is_dir():
        raise ValueError(f"folder={directory} does not exist, runs log offline W&B data there (logging=offline)")
    runs = offline_runs(directory)
    if not runs:
        print(f"no unsynced offline W&B runs under {directory}")
        return 0
    if not dry_run and (problem := access_problem()):
        raise ValueError(f"{len(runs)} offline run(s) not uploaded: {problem}")
    cmd = [wandb_cli(), "sync", "--dry-run" if dry_run else "--yes", *map(str, runs)]
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        print(f"error: wandb sync exited with {done.returncode}, see its output above", file=sys.stderr)
        return 1
    if not dry_run:
        print(f"synced {len(runs)} offline run(s) from {directory}")
    return 0
