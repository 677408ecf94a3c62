"""Reproduce one paper table: expand its grid, run what is not finished, aggregate (SPEC §6).

    python -m pipelines.reproduce N [scale=embedded|paper] [launcher=local|slurm] [jobs=K] [overrides...]

``launcher=local``: at most K worker processes (``OMP_NUM_THREADS=1`` each), each
``python -m pipelines.run <job>`` with its output in ``<results_dir>/logs/tableN/<hash>.log``; a
progress bar over the grid and one line per running job (its last ``metrics.jsonl`` step).
``launcher=slurm`` (or ``submitit_local``): Hydra multirun through hydra-submitit-launcher
(``python -m pipelines.run -m experiment=tableN ...``); the submitting process blocks until the
array ends, so start it under tmux/nohup. Finished runs are skipped either way (each job checks its
own folder), nothing is deleted, and the aggregator runs at the end if it is installed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from pipelines import store
from pipelines.grid import experiment_jobs, job_config

POLL_S = 1.0


@dataclass
class Job:
    """One grid job: its overrides, run folder and planned step count."""

    overrides: list[str]
    folder: Path
    steps: int


def parse_args(argv: Sequence[str]) -> tuple[str, int, list[str]]:
    """``N [jobs=K] [overrides]`` → (experiment, K, overrides)."""
    if not argv or not argv[0].removeprefix("table").isdigit():
        raise SystemExit("usage: python -m pipelines.reproduce N [scale=..] [launcher=local|slurm] [jobs=K] [overrides]")
    experiment = f"table{argv[0].removeprefix('table')}"
    jobs, overrides = 1, []
    for arg in argv[1:]:
        if arg.startswith("jobs="):
            jobs = int(arg.split("=", 1)[1])
            if jobs < 1:
                raise SystemExit(f"jobs={jobs} must be >= 1")
        else:
            overrides.append(arg)
    return experiment, jobs, overrides


def plan(experiment: str, overrides: Sequence[str]) -> tuple[list[Job], list[Job]]:
    """(pending, finished) jobs of the grid."""
    pending, finished = [], []
    for overrides_ in experiment_jobs(experiment, overrides):
        cfg = job_config(overrides_)
        bench = cfg.train.benchmark
        job = Job(overrides_, store.run_dir(cfg), bench.warmup + bench.measure if bench else cfg.train.steps)
        done = store.inspect_run(job.folder).state == "finished" and not cfg.force
        (finished if done else pending).append(job)
    return pending, finished


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


def run_local(pending: list[Job], workers: int, log_dir: Path) -> dict[str, list[Job]]:
    """Run ``pending`` with at most ``workers`` processes; returns jobs by outcome (ok / failed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log_dir.mkdir(parents=True, exist_ok=True)
    queue, running, outcome = list(pending), {}, {"ok": [], "failed": []}
    grid_bar = tqdm(total=len(pending), desc="grid", position=0, unit="run")
    slots = [tqdm(total=1, position=i + 1, leave=False, bar_format="{desc}") for i in range(workers)]
    try:
        while queue or running:
            while queue and len(running) < workers:
                job = queue.pop(0)
                slot = next(i for i in range(workers) if i not in {s for s, _ in running.values()})
                with open(log_dir / f"{job.folder.name}.log", "a") as out:
                    proc = subprocess.Popen([sys.executable, "-m", "pipelines.run", *job.overrides],
                                            stdout=out, stderr=subprocess.STDOUT, env=env)
                running[proc] = (slot, job)
            for proc, (slot, job) in list(running.items()):
                slots[slot].set_description_str(
                    f"  {job.folder.name} {' '.join(job.overrides[1:])}: step {last_step(job.folder)}/{job.steps}")
                if proc.poll() is None:
                    continue
                del running[proc]
                slots[slot].set_description_str("")
                outcome["ok" if proc.returncode == 0 else "failed"].append(job)
                if proc.returncode != 0:
                    tqdm.write(f"FAILED {' '.join(job.overrides)} (log {log_dir / job.folder.name}.log)")
                grid_bar.update(1)
            time.sleep(POLL_S if running else 0)
    finally:
        for proc in running:
            proc.terminate()
        for bar in slots:
            bar.close()
        grid_bar.close()
    return outcome


def run_hydra_multirun(experiment: str, overrides: Sequence[str]) -> int:
    """Hydra multirun (e.g. launcher=slurm): blocks until every job of the sweep has returned."""
    cmd = [sys.executable, "-m", "pipelines.run", "-m", f"experiment={experiment}", *overrides]
    print("running:", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def aggregate(experiment: str, results_dir: str, scale: str) -> None:
    """Call ``python -m pipelines.aggregate experiment=tableN`` when that module exists."""
    if importlib.util.find_spec("pipelines.aggregate") is None:
        print("pipelines.aggregate not installed; run folders are in", Path(results_dir) / "runs" / experiment)
        return
    root = Path(results_dir)
    subprocess.call([sys.executable, "-m", "pipelines.aggregate", f"experiment={experiment}",
                     f"runs_dir={root / 'runs'}", f"out_dir={root / 'tables'}", f"scale={scale}"])
    tables = sorted((Path(results_dir) / "tables").glob(f"{experiment}*"))
    for table in tables:
        print("table:", table)


def main(argv: Sequence[str]) -> int:
    experiment, workers, overrides = parse_args(argv)
    cfg0 = job_config([f"experiment={experiment}", *[o for o in overrides if "," not in o]])
    pending, finished = plan(experiment, overrides)
    print(f"{experiment}: {len(pending) + len(finished)} runs in the grid, {len(finished)} finished, "
          f"{len(pending)} to run", flush=True)
    launcher = next((o.split("=", 1)[1] for o in overrides if o.startswith("launcher=")), "local")
    failed = 0
    if pending and launcher == "local":
        outcome = run_local(pending, workers, Path(cfg0.results_dir) / "logs" / experiment)
        failed = len(outcome["failed"])
    elif pending:
        failed = int(run_hydra_multirun(experiment, overrides) != 0)
    aggregate(experiment, str(cfg0.results_dir), str(cfg0.suite.scale))
    if failed:
        print(f"{failed} run(s) failed; rerun the same command to retry them (finished runs are kept)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
