"""Reproduce one paper table: expand its grid, run what is not finished, aggregate.

    python -m pipelines.reproduce N [scale=embedded|paper] [launcher=local|slurm] [jobs=K] [overrides...]
    python -m pipelines.reproduce tune [...]     # the learning-rate sweep, :mod:`pipelines.tune`
    python -m pipelines.reproduce custom TASK.jsonl [model=DIR] ...   # your own task: pipelines.compare

``launcher=local``: K worker processes (``OMP_NUM_THREADS=1`` each, :mod:`pipelines.worker`) that
run the jobs one after another, each job exactly ``python -m pipelines.run <job>`` with its output
in ``<results_dir>/logs/tableN/<hash>.log``, the backbone loaded once per worker; a progress bar
over the grid and one line per running job (its last ``metrics.jsonl`` step).
``launcher=slurm`` (or ``submitit_local``): Hydra multirun through hydra-submitit-launcher
(``python -m pipelines.run -m experiment=tableN ...``); the submitting process blocks until the
array ends, so start it under tmux/nohup; a dead controller or a failed ``sbatch`` is reported as
``0 of N submitted: <reason>`` (exit code 1, no traceback, no table touched). Finished runs — of
this experiment or of any other whose grid holds the same config (the run store is shared, see
:mod:`pipelines.store`) — are skipped and tagged into this experiment's view; nothing is deleted,
and the aggregator runs at the end when a run was trained.
"""
from __future__ import annotations

import getpass
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from pipelines import store, worker
from pipelines.grid import COMPOSE_ERRORS, error_line, job_config
from pipelines.validate import ConfigError, load_experiment
from prism.budget import total_steps

POLL_S = 1.0


@dataclass
class Job:
    """One grid job: its overrides, run (store root and hash) and planned step count."""

    overrides: list[str]
    root: Path
    run_hash: str
    steps: int
    benchmark: bool = False  # a timing/memory run (train.benchmark): needs a process of its own
    cache_group: str = ""  # jobs of one group read the frozen-prefix and prompt caches the first of them builds

    @property
    def folder(self) -> Path:
        """Where the run lives now (the runner may move an old-layout folder into the store)."""
        return store.find_run(self.root, self.run_hash)


def parse_args(argv: Sequence[str]) -> tuple[str, int, list[str]]:
    """``N [jobs=K] [overrides]`` → (experiment, K, overrides); ``ValueError`` naming the bad argument."""
    if not argv or not argv[0].removeprefix("table").isdigit():
        raise ValueError("the first argument is the table number, usage: python -m pipelines.reproduce N "
                         "[scale=..] [launcher=local|slurm] [jobs=K] [overrides]")
    experiment = f"table{argv[0].removeprefix('table')}"
    jobs, overrides = 1, []
    for arg in argv[1:]:
        if arg.startswith("jobs="):
            value = arg.split("=", 1)[1]
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"jobs={value} must be an integer >= 1, e.g. jobs=2")
            jobs = int(value)
        elif arg.startswith("-"):
            raise ValueError(f"unknown option {arg}, usage: python -m pipelines.reproduce N [scale=..] "
                             "[launcher=local|slurm] [jobs=K] [key=value overrides] (--help for more)")
        else:
            overrides.append(arg)
    return experiment, jobs, overrides


def plan(experiment: str, overrides: Sequence[str]) -> tuple[list[Job], list[Job]]:
    """(pending, finished) jobs of the grid; finished runs (trained for any experiment, in the
    store or the old layout) are tagged into ``experiment``'s view, as the runner would."""
    pending, finished = [], []
    for overrides_, cfg in load_experiment(experiment, overrides):  # every job validated before any runs
        job = Job(overrides_, store.runs_root(cfg), store.run_hash(cfg), total_steps(cfg),
                  benchmark=bool(cfg.train.get("benchmark")),
                  cache_group=f"{cfg.suite.name}/{cfg.backbone.name}/{cfg.backbone.lora_layers}")
        done = store.inspect_run(job.folder).state == "finished" and not cfg.force
        if done:
            store.tag(job.root, experiment, job.run_hash)
        (finished if done else pending).append(job)
    return pending, finished


def unfinished(jobs: Sequence[Job]) -> list[Job]:
    """The jobs whose run is not finished now (each job's real run state, not a process's exit code)."""
    return [job for job in jobs if store.inspect_run(job.folder).state != "finished"]


def last_step(folder: Path) -> int:
    """The step of the last complete line of ``metrics.jsonl`` (0 if none)."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 4096))
        lines = f.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        try:
            return int(json.loads(line).get("step", 0))
        except (ValueError, AttributeError, TypeError):
            continue
    return 0


def next_job(queue: Sequence[Job], warming: set[str]) -> int:
    """Index in ``queue`` of the job to start next: the first whose cache group is not warming (a
    group warms until one of its jobs has finished here: its first job builds the caches, and any
    other would wait on their file lock), else the first. So a free worker takes other work instead of
    waiting for another worker's cache build."""
    return next((i for i, job in enumerate(queue) if job.cache_group not in warming), 0)


def run_local(pending: list[Job], workers: int, log_dir: Path) -> dict[str, list[Job]]:
    """Run ``pending`` on at most ``workers`` processes of :mod:`pipelines.worker` (each keeps its
    backbone loaded across jobs; a benchmark job gets a fresh process); returns jobs by outcome
    (ok / failed). Jobs start in queue order, except that a job whose cache group is still warming waits
    while others are queued (:func:`next_job`). A worker that dies (killed, out of memory) fails only
    the jobs it held; the next jobs get a new pool."""
    os.environ.update(worker.THREAD_ENV)  # inherited by the spawned workers before torch is imported
    log_dir.mkdir(parents=True, exist_ok=True)
    queue, running, outcome = list(pending), {}, {"ok": [], "failed": []}
    warm: set[str] = set()  # cache groups with a job finished in this call
    fresh = any(job.benchmark for job in pending)
    pool: ProcessPoolExecutor | None = None
    grid_bar = tqdm(total=len(pending), desc="grid", position=0, unit="run")
    slots = [tqdm(total=1, position=i + 1, leave=False, bar_format="{desc}") for i in range(workers)]
    try:
        while queue or running:
            while queue and len(running) < workers:
                if pool is None:
                    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                               max_tasks_per_child=1 if fresh else None)
                job = queue.pop(next_job(queue, {j.cache_group for _, j in running.values()} - warm))
                slot = next(i for i in range(workers) if i not in {s for s, _ in running.values()})
                running[pool.submit(worker.run_job, job.overrides, str(log_dir / f"{job.run_hash}.log"))] = (slot, job)
            for future, (slot, job) in list(running.items()):
                slots[slot].set_description_str(
                    f"  {job.run_hash} {' '.join(job.overrides[1:])}: step {last_step(job.folder)}/{job.steps}")
                if not future.done():
                    continue
                del running[future]
                slots[slot].set_description_str("")
                try:
                    code = future.result()
                except BrokenProcessPool:
                    code, pool = -9, None  # its worker died; the pool cannot take more jobs
                outcome["ok" if code == 0 else "failed"].append(job)
                warm.add(job.cache_group)
                if code != 0:
                    tqdm.write(f"FAILED {' '.join(job.overrides)} (log {log_dir / job.run_hash}.log)")
                grid_bar.update(1)
            time.sleep(POLL_S if running else 0)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for bar in slots:
            bar.close()
        grid_bar.close()
    return outcome


def slurm_problem(timeout_s: float = 30.0) -> str | None:
    """Why SLURM cannot take a submission now (no ``sbatch``, or ``squeue`` cannot reach the
    controller), or None."""
    if shutil.which("sbatch") is None or shutil.which("squeue") is None:
        return "sbatch/squeue not found (run this on a SLURM login node, or use launcher=local)"
    try:
        probe = subprocess.run(["squeue", "-h", "-u", getpass.getuser(), "-o", "%i"], capture_output=True,
                               text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"squeue did not answer within {timeout_s:.0f} s (SLURM controller down?)"
    if probe.returncode != 0:
        lines = (probe.stderr or probe.stdout).strip().splitlines()
        unconfigured = "configuration source" in (probe.stderr or "").lower()  # installed, no slurm.conf
        fix = ("; SLURM has no configuration here: set SLURM_CONF=/path/to/slurm.conf (ask your cluster admin), "
               "run on a login node, or use launcher=local") if unconfigured else ""
        return f"squeue failed: {lines[-1] if lines else f'exit code {probe.returncode}'}{fix}"
    return None


ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")


def run_hydra_multirun(experiment: str, overrides: Sequence[str], log_path: Path) -> tuple[int, str]:
    """Hydra multirun (e.g. launcher=slurm): blocks until every job of the sweep has returned.

    The child's output goes to ``log_path`` in full and to the terminal without tracebacks;
    returns (exit code, the error line of the last traceback or the last output line)."""
    cmd = [sys.executable, "-m", "pipelines.run", "-m", f"experiment={experiment}", *overrides]
    print("running:", " ".join(cmd), flush=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    reason, in_traceback = "", False
    with open(log_path, "a") as log, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      text=True) as proc:
        for line in proc.stdout or ():
            log.write(line)
            text = line.strip()
            in_traceback = in_traceback or text.startswith("Traceback")
            if in_traceback:
                reason = text if ERROR_LINE.match(text) else reason
            elif text:
                print(line, end="", flush=True)
                reason = text
    return proc.returncode, reason


def aggregate(experiment: str, results_dir: str, scale: str) -> None:
    """Render the grid's table: ``python -m pipelines.aggregate experiment=tableN``."""
    root = Path(results_dir)
    subprocess.call([sys.executable, "-m", "pipelines.aggregate", f"experiment={experiment}",
                     f"runs_dir={root / 'runs'}", f"out_dir={root / 'tables'}", f"scale={scale}"])
    tables = sorted((Path(results_dir) / "tables").glob(f"{experiment}.{scale}*"))
    for table in tables:
        print("table:", table)


def launch(experiment: str, launcher: str, pending: list[Job], workers: int, overrides: Sequence[str],
           log_dir: Path) -> tuple[bool, str]:
    """Train ``pending``; returns (whether anything was submitted, a one-line failure summary or '')."""
    n = len(pending)
    if launcher == "local":
        run_local(pending, workers, log_dir)
        failed = unfinished(pending)
        if not failed:
            return True, ""
        return True, (f"{len(failed)} of {n} run(s) failed; logs in {log_dir} "
                      f"({', '.join(j.run_hash for j in failed[:5])}{', …' if len(failed) > 5 else ''}); "
                      "rerun the same command to retry them (finished runs are kept)")
    if launcher == "slurm" and (problem := slurm_problem()):
        return False, f"0 of {n} submitted: {problem}"
    rc, reason = run_hydra_multirun(experiment, overrides, log_dir / f"multirun-{store.utc_stamp()}.log")
    failed = unfinished(pending)
    if rc == 0 and not failed:
        return True, ""
    if all(not job.folder.exists() for job in failed) and len(failed) == n:
        return False, f"0 of {n} submitted: {reason or f'exit code {rc}'} (full log in {log_dir})"
    return True, (f"{len(failed)} of {n} run(s) not finished: {reason or f'exit code {rc}'}; full log in "
                  f"{log_dir}; rerun the same command to retry them (finished runs are kept)")


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
        pending, finished = plan(experiment, overrides)
        cfg0 = job_config([f"experiment={experiment}", *[o for o in overrides if "," not in o]])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except COMPOSE_ERRORS as err:
        print(f"error: {error_line(err)}", file=sys.stderr)
        return 2
    print(f"{experiment}: {len(pending) + len(finished)} runs in the grid, {len(finished)} finished, "
          f"{len(pending)} to run", flush=True)
    launcher = next((o.split("=", 1)[1] for o in overrides if o.startswith("launcher=")), "local")
    submitted, failure = True, ""
    if pending:
        submitted, failure = launch(experiment, launcher, pending, workers, overrides,
                                    Path(cfg0.results_dir) / "logs" / experiment)
    if submitted:
        aggregate(experiment, str(cfg0.results_dir), str(cfg0.suite.scale))
    if failure:
        print(failure, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
