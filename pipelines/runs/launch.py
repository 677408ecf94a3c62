"""Running a grid's jobs (a library: no command): the job list and its plan, the local worker pool, the
SLURM / submitit multirun, stopping them on a signal, and rendering the grid's table afterwards.

:mod:`pipelines.verbs.reproduce`, :mod:`pipelines.verbs.tune` and :mod:`pipelines.verbs.compare` plan their jobs and call
:func:`launch`; the behaviour of each launcher is described in :mod:`pipelines.verbs.reproduce`.
"""
from __future__ import annotations

import collections
import contextlib
import getpass
import json
import multiprocessing
import operator
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from omegaconf import DictConfig
from tqdm import tqdm

from pipelines.config import compose
from pipelines.config.validate import load_experiment
from pipelines.runs import store, worker
from prism.privacy.budget import total_steps

POLL_S = 1.0
WORKER_RSS_GB = 2.2  # a worker's resident memory at embedded scale (backbone, caches, optimizer state)
STOP_GRACE_S = 60.0  # how long a stopped worker may take to record its run before it is killed


@dataclass
class Job:
    """One grid job: its overrides, its validated config (what the worker runs), its run (store root and
    hash), planned step count, whether it is a timing run (a process of its own) and its cache group (jobs
    of one group read the frozen-prefix and prompt caches the first of them builds)."""

    overrides: list[str]
    cfg: DictConfig
    root: Path
    run_hash: str
    steps: int
    benchmark: bool = False
    cache_group: str = ""

    @classmethod
    def of(cls, overrides: list[str], cfg: DictConfig) -> Job:
        """The job of ``overrides`` whose validated config is ``cfg``."""
        return cls(overrides, cfg, store.runs_root(cfg), store.run_hash(cfg), total_steps(cfg),
                   benchmark=bool(cfg.train.benchmark),
                   cache_group=f"{cfg.suite.name}/{cfg.backbone.name}/{cfg.backbone.lora_layers}")

    @property
    def folder(self) -> Path:
        """The run folder, ``<root>/<hash>``."""
        return store.find_run(self.root, self.run_hash)


@dataclass(frozen=True)
class Unit:
    """What the local pool's progress counts and names: groups of jobs (``of(job)``: a job's group, by name),
    ``name`` their noun, and whether a job's line shows its ``overrides``. By default every job is a group of
    its own, named by its run hash; a selection's candidates are counted and named by their selection only."""

    name: str = "run"
    of: Callable[[Job], str] = operator.attrgetter("run_hash")
    overrides: bool = True

    def label(self, job: Job, first: int = 1) -> str:
        """A job's name in a progress line: its group, then (``overrides``) its overrides from index ``first``."""
        return " ".join([self.of(job), *(job.overrides[first:] if self.overrides else [])])


def default_jobs(cores: int, available_bytes: int, worker_bytes: float = WORKER_RSS_GB * 1e9) -> int:
    """The local launcher's worker count when ``jobs=`` is not given: one per core, as many as the
    available memory holds (a worker holds :data:`WORKER_RSS_GB`), at least 1."""
    return max(1, min(cores, int(available_bytes // worker_bytes)))


def available_memory() -> int:
    """Bytes of memory available to new processes (``MemAvailable`` of /proc/meminfo; free pages elsewhere)."""
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/meminfo") as f:
        return int(next(line for line in f if line.startswith("MemAvailable:")).split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_jobs(jobs: int | None) -> int:
    """``jobs`` if given, else :func:`default_jobs` of this machine, printed on one line."""
    if jobs is not None:
        return jobs
    cores, free = len(os.sched_getaffinity(0)), available_memory()
    chosen = default_jobs(cores, free)
    print(f"JOBS={chosen} ({cores} cores, {free / 2**30:.1f} GiB free; JOBS= overrides)", flush=True)
    return chosen


def override_value(overrides: Sequence[str], key: str, default: str) -> str:
    """The value of ``key=`` in ``overrides`` (the last one given), else ``default``."""
    return next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith(f"{key}=")), default)


def launcher_error(launcher: str) -> int | None:
    """Check that ``launcher`` can take jobs here, before a grid is planned: prints one ``error:``
    line and returns the exit code (2 without ``sbatch``/``squeue``, 1 when the controller does not
    answer), or returns None."""
    if launcher != "slurm" or (problem := slurm_problem()) is None:
        return None
    print(f"error: launcher=slurm: {problem}; nothing was submitted", file=sys.stderr)
    return 2 if shutil.which("sbatch") is None or shutil.which("squeue") is None else 1


def plan(experiment: str, overrides: Sequence[str]) -> tuple[list[Job], list[Job]]:
    """(pending, finished) jobs of the grid (:func:`split_finished`), every job validated once, before any runs."""
    return split_finished(experiment, [Job.of(o, cfg) for o, cfg in load_experiment(experiment, overrides)])


def split_finished(experiment: str, jobs: Sequence[Job]) -> tuple[list[Job], list[Job]]:
    """(pending, finished) ``jobs``; finished runs (trained for any experiment) are tagged into ``experiment``'s
    view, as the runner would. A store in the older layout is refused first (:func:`pipelines.runs.store.refuse_older_layout`)."""
    for root in {job.root for job in jobs}:
        store.refuse_older_layout(root)
    pending, finished = [], []
    for job in jobs:
        done = store.inspect_run(job.folder).state == "finished" and not job.cfg.force
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


class Stop(KeyboardInterrupt):
    """SIGTERM or SIGINT reached the launcher while its workers run (:func:`stop_signals`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_stopped(stop: Stop, what: str) -> NoReturn:
    """One line ``stopped (<signal>): <what>`` on stderr, then ``SystemExit`` with 128 + the signal number."""
    print(f"stopped ({signal.Signals(stop.signum).name}): {what}", file=sys.stderr, flush=True)
    raise SystemExit(128 + stop.signum)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Within: SIGTERM and SIGINT raise :class:`Stop` in the main thread, once (a second signal does not
    cut the stop short); the earlier handlers after."""
    def raise_stop(signum: int, _frame: object) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise Stop(signum)

    previous = {sig: signal.signal(sig, raise_stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_workers(pool: ProcessPoolExecutor, grace_s: float = STOP_GRACE_S) -> None:
    """Cancel the queued jobs of ``pool`` and SIGTERM its workers, again every half second (a running
    job records its run interrupted and ends its worker, an idle worker exits at once:
    :func:`pipelines.runs.worker.init`); a worker still alive after ``grace_s`` is killed."""
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + grace_s
    while workers := multiprocessing.active_children():  # also one the pool started meanwhile
        for process in workers:
            process.terminate() if time.monotonic() < deadline else process.kill()
        time.sleep(0.5)


def record_stopped(jobs: Sequence[Job], signum: int) -> list[Job]:
    """The runs of ``jobs`` that a stop cut off (not finished); one whose worker was killed before it could
    record that (status still ``running``, lock free) is marked ``stopped``, as :mod:`pipelines.runs.runner` marks a
    Ctrl-C or SIGTERM (with no time when the run records none)."""
    cut = []
    for job in jobs:
        info = store.inspect_run(job.folder)
        if info.state != "incomplete" or info.status is None:
            continue
        cut.append(job)
        if info.status["state"] == "running" and not store.lock_held(job.folder):
            store.write_status(job.folder, "stopped", started=info.status.get("started"),
                               attempts=int(info.status.get("attempts") or 1), ended=info.status.get("started") and
                               store.utc_stamp(), error=f"interrupted ({signal.Signals(signum).name}): the launcher "
                                                        "stopped the worker")
    return cut


def run_local(pending: list[Job], workers: int, log_dir: Path, unit: Unit | None = None) -> dict[str, list[Job]]:
    """Run ``pending`` on at most ``workers`` processes of :mod:`pipelines.runs.worker` (a benchmark job gets a
    fresh process), in queue order but for jobs of a warming cache group (:func:`next_job`); returns jobs by
    outcome (ok / failed). The progress bar counts ``unit``'s groups (default: one per job) and names a job by
    its group. A worker that dies fails only the jobs it held; the next jobs get a new pool.
    SIGTERM or SIGINT stops every worker (:func:`stop_workers`), marks the runs cut off (:func:`record_stopped`)
    and ends in ``SystemExit`` (128 + the signal number)."""
    os.environ.update(worker.THREAD_ENV)  # inherited by the spawned workers before torch is imported
    log_dir.mkdir(parents=True, exist_ok=True)
    queue, running, outcome = list(pending), {}, {"ok": [], "failed": []}
    warm: set[str] = set()  # cache groups with a job finished in this call
    fresh = any(job.benchmark for job in pending)
    pool: ProcessPoolExecutor | None = None
    stop: Stop | None = None
    unit = unit or Unit()
    left = collections.Counter(unit.of(job) for job in pending)  # jobs per group not yet ended
    bars = sys.stderr.isatty()  # a bar redraws itself with cursor escapes: a log file gets plain lines instead
    grid_bar = tqdm(total=len(left), desc="grid", position=0, unit=unit.name, disable=not bars)
    slots = [tqdm(total=1, position=i + 1, leave=False, bar_format="{desc}", disable=not bars)
             for i in range(workers)]
    if not bars:
        print(f"grid: {len(left)} {unit.name}(s) on {workers} worker(s), one line per finished {unit.name}", flush=True)
    with stop_signals():  # also while the workers are stopped: a second signal does not cut that short
        try:
            while queue or running:
                while queue and len(running) < workers:
                    if pool is None:
                        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                   initializer=worker.init,
                                                   max_tasks_per_child=1 if fresh else None)
                    job = queue.pop(next_job(queue, {j.cache_group for _, j in running.values()} - warm))
                    slot = next(i for i in range(workers) if i not in {s for s, _ in running.values()})
                    running[pool.submit(worker.run_job, job.cfg, str(log_dir / f"{job.run_hash}.log"))] = (
                        slot, job)
                for future, (slot, job) in list(running.items()):
                    slots[slot].set_description_str(
                        f"  {unit.label(job)}: step {last_step(job.folder)}/{job.steps}")
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
                        tqdm.write(f"FAILED {unit.label(job, 0)} (log {log_dir / job.run_hash}.log)")
                    left[unit.of(job)] -= 1
                    grid_bar.update(left[unit.of(job)] == 0)
                    if not bars and left[unit.of(job)] == 0:
                        log = f" (log {log_dir / job.run_hash}.log)" if unit.overrides else ""
                        print(f"finished {unit.label(job, 0)}{log}", flush=True)
                time.sleep(POLL_S if running else 0)
        except Stop as caught:
            stop = caught
        finally:
            if pool is not None and stop is not None:
                stop_workers(pool)
            elif pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            for bar in slots:
                bar.close()
            grid_bar.close()
            if not bars:
                failed = {unit.of(j) for j in outcome["failed"]}
                ended = {g for g, n in left.items() if n == 0}
                print(f"grid: {len(ended - failed)} {unit.name}(s) finished, {len(failed)} failed, "
                      f"{len(left) - len(ended | failed)} not run", flush=True)
    if stop is not None:
        done = {j.run_hash for j in outcome["ok"] + outcome["failed"]}
        queued = {j.run_hash for j in queue}
        cut = record_stopped([j for j in pending if j.run_hash not in done | queued], stop.signum)
        names = list(dict.fromkeys(unit.of(j) for j in cut))
        exit_stopped(stop, f"every worker ended; {len(names)} {unit.name}(s) marked stopped ({', '.join(names) or 'none'}), "
                           f"{len({unit.of(j) for j in queue})} not started; "
                           "rerun the same command to resume them from their checkpoints")
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


def stop_group(pgid: int, grace_s: float = STOP_GRACE_S) -> None:
    """SIGINT to process group ``pgid``: Hydra and a job it runs take it as Ctrl-C (:mod:`pipelines.runs.runner`
    records the run interrupted; submitit's local jobs ignore SIGTERM); SIGKILL to what is left after
    ``grace_s``."""
    deadline = time.monotonic() + grace_s
    try:
        os.killpg(pgid, signal.SIGINT)
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)  # ProcessLookupError once no process of the group is left
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pgid, os.WNOHANG)  # the group leader is this process's child: reap it
            time.sleep(0.2)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return


def run_hydra_multirun(experiment: str, overrides: Sequence[str], log_path: Path) -> tuple[int, str]:
    """Hydra multirun (e.g. launcher=slurm): blocks until every job of the sweep has returned.

    The child's output goes to ``log_path`` in full and to the terminal without tracebacks;
    returns (exit code, the error line of the last traceback or the last output line). The child runs
    in a process group of its own: SIGTERM or SIGINT here stops that whole group (:func:`stop_group`:
    Hydra and the local jobs it started; jobs already handed to SLURM keep running), one line says
    so, and ``SystemExit`` carries 128 + the signal number."""
    cmd = [sys.executable, "-m", "pipelines", "run", "-m", f"experiment={experiment}", *overrides]
    print("running:", " ".join(cmd), flush=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    reason, in_traceback, stop = "", False, None
    with stop_signals(), open(log_path, "a") as log, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True) as proc:
        try:
            for line in proc.stdout or ():
                log.write(line)
                text = line.strip()
                in_traceback = in_traceback or text.startswith("Traceback")
                if in_traceback:
                    reason = text if ERROR_LINE.match(text) else reason
                elif text:
                    print(line, end="", flush=True)
                    reason = text
        except Stop as caught:
            stop = caught
            stop_group(proc.pid)
    if stop is not None:
        exit_stopped(stop, "the multirun and its local jobs ended (jobs already handed to SLURM keep running: "
                           f"scancel them); full log in {log_path}")
    return proc.returncode, reason


def aggregate(experiment: str, results_dir: str, scale: str) -> None:
    """Render the grid's table: ``python -m pipelines aggregate experiment=tableN``; SIGTERM or SIGINT
    here ends that process too, with one line (rerunning the command renders the table again)."""
    root = Path(results_dir)
    with stop_signals(), subprocess.Popen([sys.executable, "-m", "pipelines", "aggregate", f"experiment={experiment}",
                                           f"runs_dir={root / 'runs'}", f"out_dir={root / 'tables'}",
                                           f"scale={scale}"]) as proc:
        try:
            proc.wait()
        except Stop as stop:
            proc.terminate()
            proc.wait()
            exit_stopped(stop, "the table was not rendered (or only in part); rerun the same command to render it "
                               "(finished runs are kept)")
    for table in sorted((root / "tables").glob(f"{experiment}.{scale}*")):
        print("table:", table)


def launch(experiment: str, launcher: str, pending: list[Job], workers: int | None, overrides: Sequence[str],
           log_dir: Path, unit: Unit | None = None) -> tuple[bool, str]:
    """Train ``pending`` (``workers``: ``jobs=``, None for :func:`resolve_jobs`'s default; the caller
    has checked the launcher, :func:`launcher_error`); returns (whether anything was submitted, a
    one-line failure summary or ''). The local pool's progress and its summary count ``unit``'s groups."""
    n = len(pending)
    if launcher == "local":
        unit = unit or Unit()
        run_local(pending, resolve_jobs(workers), log_dir, unit)
        failed = unfinished(pending)
        if not failed:
            return True, ""
        groups = list(dict.fromkeys(unit.of(j) for j in failed))
        return True, (f"{len(groups)} of {len({unit.of(j) for j in pending})} {unit.name}(s) failed; logs in "
                      f"{log_dir} ({', '.join(groups[:5])}{', …' if len(groups) > 5 else ''}); "
                      "rerun the same command to retry them (finished runs are kept)")
    rc, reason = run_hydra_multirun(experiment, overrides, log_dir / f"multirun-{store.utc_stamp()}.log")
    if rc == 0 and experiment in compose.REFERENCE_JOBS and unfinished(pending):  # Hydra's sweep has no reference jobs
        rc, reason = run_hydra_multirun(experiment, [*overrides, *compose.REFERENCE_JOBS[experiment]],
                                        log_dir / f"multirun-{store.utc_stamp()}-reference.log")
    failed = unfinished(pending)
    if rc == 0 and not failed:
        return True, ""
    if all(not job.folder.exists() for job in failed) and len(failed) == n:
        return False, f"0 of {n} submitted: {reason or f'exit code {rc}'} (full log in {log_dir})"
    return True, (f"{len(failed)} of {n} run(s) not finished: {reason or f'exit code {rc}'}; full log in "
                  f"{log_dir}; rerun the same command to retry them (finished runs are kept)")


