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
:mod:`pipelines.runs.store`) — are skipped and tagged into this experiment's view. A run of the view
that holds the same table cell, suite, seed, scale and protocol as a planned job at another config
(e.g. at a rate ``make tune`` has changed since) leaves the view, with one line naming the fields that
differ (:func:`supersede`), so the table shows the grid that was run instead of refusing the cell;
nothing is deleted, and the aggregator runs at the end when a run was trained. A grid whose seeds include a seed its tuned
rates were chosen on prints one line saying so (:func:`pipelines.config.tuned_rates.seed_overlap_line`).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf

from pipelines.config import tuned_rates
from pipelines.runs import launch, store
from pipelines.runs.launch import Job
from pipelines.tables.build import differing_fields, load_paper, protocol_of
from pipelines.tables.records import RunRecord, read_run_folder
from pipelines.tables.specs import SPECS

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
    if replaced := supersede(experiment, pending + finished):
        print(replaced, flush=True)
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


def supersede(experiment: str, jobs: Sequence[Job]) -> str:
    """Take out of ``experiment``'s view every run that a planned job replaces: one of the same table cell
    (the table's row key), suite, seed, scale and protocol at another config (another hash). Their folders
    stay in the store (rerunning an older grid tags them back). Returns the line that says how many left
    and on which fields they differ from the grid's runs ('' when none)."""
    spec, paper = SPECS[experiment], load_paper(experiment)

    def slot(record: RunRecord) -> tuple:
        return (spec.cell_key(record, paper), record.get("suite.name"), record.get("seed"),
                record.get("suite.scale"), protocol_of(record))

    planned = {job.run_hash: RunRecord(job.run_hash, "planned", config=OmegaConf.to_container(job.cfg, resolve=True))
               for job in jobs}
    by_slot = {slot(record): record for record in planned.values()}
    left, fields = 0, set()
    for root in {job.root for job in jobs}:
        for run_hash_ in store.view(root, experiment):
            record = read_run_folder(store.find_run(root, run_hash_))
            if run_hash_ in planned or not record.config or (new := by_slot.get(slot(record))) is None:
                continue
            store.untag(root, experiment, run_hash_)
            left += 1
            fields |= {part.split(":")[0] for part in differing_fields([record, new], limit=99).split("; ") if part}
    if not left:
        return ""
    return (f"{experiment}: {left} run{'s' * (left != 1)} of the grid's cells and seeds at an earlier config left its "
            f"view (their folders stay in the store; differing: {', '.join(sorted(fields)) or 'the hash only'})")

