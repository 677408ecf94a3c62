"""The runner: one job = one resolved config = one run folder (docs/ARCHITECTURE.md), for
``python -m pipelines run`` (:mod:`pipelines.verbs.run`), Hydra's multirun and the local launcher's workers
(:func:`run_config`, :mod:`pipelines.runs.worker`).

:func:`execute` runs one job: it takes the run folder's lock, skips a finished run (unless
``force=true``), resumes an interrupted one, sets aside unreadable files of a corrupt one, then calls
``prism.train.train_and_evaluate`` and writes the folder format of :mod:`pipelines.runs.store`. It
narrates one line per phase on stdout and ends with the scores and the ``final.json`` path.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import math
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from omegaconf import DictConfig, OmegaConf

from pipelines.config.validate import ConfigError, check
from pipelines.runs import store
from pipelines.runs.wandb_log import WandbRun
from prism.fileio import write_text_atomic
from prism.privacy.budget import total_steps
from prism.record import FinalRecord, RecordError

log = logging.getLogger("pipelines.runs.runner")
REPO = Path(__file__).resolve().parents[2]
Trainer = Callable[[DictConfig, Path, Callable[[dict[str, Any]], None]], dict[str, Any]]
PRINT = functools.partial(print, flush=True)  # a line of narration, on stdout at once
VERSIONED = ("torch", "transformers", "peft", "opacus", "hydra-core", "wandb")


__all__ = ["ConfigError", "check", "execute", "run_config"]


def default_trainer(cfg: DictConfig, folder: Path, log_fn: Callable[[dict[str, Any]], None],
                    load: Any = None) -> dict[str, Any]:
    """``prism.train.train_and_evaluate`` (imported lazily: the pipeline tests never load torch models),
    with subnormal floats flushed to zero on the CPU while it trains (docs/DECISIONS.md D64: a diverging run's
    subnormals made its CPU steps 10–25× slower; the losses are the same to the printed digits).
    ``load``: the backbone loader (default :func:`prism.models.load_backbone`; a local-launcher worker
    passes its :class:`prism.models.KeptBackbones`)."""
    import torch

    from prism.models import load_backbone
    from prism.train import train_and_evaluate

    torch.set_flush_denormal(True)
    try:
        return train_and_evaluate(cfg, folder, log_fn, load=load or load_backbone)
    finally:  # back to torch's default (it has no getter for the mode): a caller's arithmetic keeps its subnormals
        torch.set_flush_denormal(False)


def versions() -> dict[str, str | None]:
    """Python and library versions recorded in ``final.json``."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout, or (None, None) outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    if head.returncode != 0:
        return None, None
    return head.stdout.strip(), bool(dirty.stdout.strip())


def execute(cfg: DictConfig, trainer: Trainer | None = None) -> str:
    """Run one job of a validated config (:func:`pipelines.config.validate.load_job`, or a grid's
    :func:`pipelines.config.validate.load_experiment`; it is not validated again); returns ``finished`` (trained
    now), ``skipped`` (already finished) or ``busy`` (another process holds the run folder's lock). A
    failing trainer marks the run ``failed`` and re-raises."""
    run_hash, folder = store.run_hash(cfg), store.run_dir(cfg)
    store.refuse_older_layout(folder.parent)
    lock = FileLock(store.lock_path(folder))
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("run %s is being trained by another process (lock %s held); not starting a second copy",
                    folder, store.lock_path(folder))
        return "busy"
    except OSError as err:  # a read-only (or full) store: a finished run is still read (not tagged into the view)
        if store.inspect_run(folder).state == "finished" and not cfg.force:
            return _skipped(folder, run_hash, f"the store is not writable: {err.strerror or err}; not tagged into "
                                             f"{cfg.experiment}")
        raise StoreError(f"results_dir={cfg.results_dir} is not writable ({err.strerror or err}: "
                         f"{store.lock_path(folder)}), point results_dir at a writable folder") from None
    try:
        store.tag(folder.parent, str(cfg.experiment), run_hash)
        info = store.inspect_run(folder)
        if info.state == "finished" and not cfg.force:
            return _skipped(folder, run_hash, "force=true trains it again")
        if info.state == "finished":
            log.warning("force=true: moved the finished run to %s", store.move_aside(folder))
            info = store.inspect_run(folder)
        if info.state == "corrupt":
            moved = store.quarantine(folder, info.bad)
            log.warning("run %s was corrupt (%s); kept %s and rerunning", folder, info.reason,
                        ", ".join(p.name for p in moved))
        if folder.exists() and not store.config_matches(folder, cfg):
            log.warning("run folder %s holds a different config; moved it to %s", folder, store.move_aside(folder))
        if (folder / "final.json").exists():  # a result without a "finished" status: kept, never overwritten
            log.warning("run %s has a final.json its status.json does not confirm; kept as %s and rerunning",
                        folder, store.move_aside(folder / "final.json", "unconfirmed"))
        attempts = 1 + int((info.status or {}).get("attempts", 0)) if folder.exists() else 1
        return _train(cfg, folder, run_hash, attempts, trainer or default_trainer)
    finally:
        lock.release()


class StoreError(OSError):
    """The run store cannot be written (read-only, full, no permission); one line naming ``results_dir``."""


def _skipped(folder: Path, run_hash: str, why: str) -> str:
    try:
        scores = scores_line(FinalRecord.from_json(store.read_json(folder / "final.json")))
    except RecordError as err:
        scores = f"a record the tables refuse ({err})"
    log.info("run %s already finished, skipped (%s): %s; results in %s", run_hash, why, scores, folder / "final.json")
    return "skipped"


def _train(cfg: DictConfig, folder: Path, run_hash: str, attempts: int, trainer: Trainer) -> str:
    from prism.train import logs_private_stats

    timed = logs_private_stats(cfg)  # off: no time of any kind in the folder, W&B or the log (docs/PRIVACY.md)
    if not timed:  # no [HH:MM:SS] stamp either: step lines a known interval apart would time the steps
        for handler in logging.getLogger().handlers:
            handler.setFormatter(logging.Formatter("%(message)s"))
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(folder / "config.yaml", OmegaConf.to_yaml(cfg))
    store.seal_metrics(folder)
    t0 = time.time()
    started = store.utc_stamp() if timed else None
    store.write_status(folder, "running", started=started, attempts=attempts)
    wb = None
    try:  # from here on, every way out leaves status.json finished or failed, never running
        total = total_steps(cfg)
        log.info("run %s: %s on %s (%s scale), %s, %s, train.steps=%d; folder %s", run_hash, cfg.backbone.paper_name,
                 cfg.suite.name, cfg.suite.scale, cfg.method.name, cfg.privacy.name, total, folder)
        if attempts > 1:
            log.info("run %s: attempt %d (the trainer says from which step it resumes)", run_hash, attempts)
        generation = len(list(folder.parent.glob(f"{run_hash}.old-*")))
        if cfg.logging.mode != "disabled":
            log.info("run %s: W&B %s run under %s", run_hash, cfg.logging.mode, cfg.logging.dir)
        wb = WandbRun(cfg, run_hash, generation, deferred=not timed)
        first = [True]

        def log_fn(record: dict[str, Any]) -> None:
            if first[0] and isinstance(record.get("step"), int):  # a resumed run logs its steps again from here
                if dropped := store.trim_metrics(folder, record["step"]):
                    log.info("run %s: dropped %d metrics line(s) of steps trained again", run_hash, dropped)
                first[0] = False
            store.append_metrics(folder, record)
            wb.log_step(record)
            log.info("[%s] step %s/%s %s", run_hash, *counter(record, total), _brief(record))

        try:
            record = trainer(cfg, folder, log_fn)
        except OSError as err:
            if err.errno not in store.FULL:
                raise
            raise StoreError(f"no space left on the disk of results_dir={cfg.results_dir} (writing {folder}); "
                             "free space there or point results_dir elsewhere, then rerun the same command "
                             "to resume from the last checkpoint") from None
        core = FinalRecord.from_json(record)  # the trainer's record parses into the core's type
        commit, dirty = git_state()
        times = dict(wall_time_s=time.time() - t0, started=started, ended=store.utc_stamp(),
                     peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0) if timed else {}
        run = store.RunBlock(hash=run_hash, experiment=str(cfg.experiment), attempts=attempts, versions=versions(),
                             git_commit=commit, git_dirty=dirty, hostname=socket.gethostname(), **times)
        final = {**record, store.RunBlock.KEY: run.to_json()}
        store.write_json_atomic(folder / "final.json", final)
        store.write_status(folder, "finished", started=started, attempts=attempts, ended=run.ended)
    except BaseException as exc:
        with _signals_deferred(exc):
            _record_failure(folder, run_hash, exc, started, attempts, timed)
        if wb is not None:
            with contextlib.suppress(Exception):
                wb.finish(None, exit_code=1, history=store.read_metrics(folder))
        raise
    with contextlib.suppress(Exception):  # the result is on disk; a W&B upload failure does not undo it
        wb.finish(final, history=store.read_metrics(folder), record=core)
    took = f" in {run.wall_time_s:.0f} s" if run.wall_time_s is not None else ""
    log.info("run %s finished%s: %s; results in %s", run_hash, took, scores_line(core), folder / "final.json")
    return "finished"


@contextlib.contextmanager
def _signals_deferred(exc: BaseException) -> Iterator[None]:
    """Hold SIGINT and SIGTERM while a stopped or failed run records its state, so that a second signal
    cannot cut off the status write: a second Ctrl-C, or submitit's local controller forwarding the
    SIGINT its job already got. A held signal is dropped when ``exc`` is already an interrupt (the run
    is stopping) and raised as one after the block otherwise. Only the main thread can set handlers;
    a handler not installed from Python is left alone."""
    held: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for kind in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(kind) is not None:
                previous[kind] = signal.signal(kind, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for kind, handler in previous.items():
            signal.signal(kind, handler)
    if held and not isinstance(exc, KeyboardInterrupt):
        raise KeyboardInterrupt(signal.Signals(held[0]).name)


def _record_failure(folder: Path, run_hash: str, exc: BaseException, started: str | None, attempts: int,
                    timed: bool) -> None:
    """Mark the run ``stopped`` (a signal: Ctrl-C, SIGTERM, a SLURM preemption) or ``failed`` and keep its
    traceback; first delete the temporaries of a cut-off write, which on a full disk free the space these
    two files need."""
    removed = store.remove_temporaries(folder)
    interrupted = isinstance(exc, KeyboardInterrupt)
    error = f"interrupted ({exc or 'SIGINT'})" if interrupted else f"{type(exc).__name__}: {exc}"
    try:
        store.write_status(folder, "stopped" if interrupted else "failed", started=started, attempts=attempts,
                           error=error, ended=store.utc_stamp() if timed else None)
        write_text_atomic(folder / "traceback.txt", "".join(traceback.format_exception(exc)))
    except OSError as err:
        log.error("run %s failed (%s) and its status could not be recorded: %s", run_hash, error, err)
        return
    if removed:
        log.info("run %s: removed %d half-written temporary file(s) (%s)", run_hash, len(removed),
                 ", ".join(p.name for p in removed))
    if interrupted:
        log.warning("run %s interrupted; the same command resumes it from its last checkpoint", run_hash)
    else:
        log.error("run %s failed; its traceback is in %s", run_hash, folder / "traceback.txt")


def scores_line(final: FinalRecord) -> str:
    """The headline numbers of a ``final.json``: Table 2 columns and their average, or the Table 5
    step time and memory of a benchmark run."""
    columns = final.columns or final.scores or {}
    parts = [f"{name} {value:.4g}" for name, value in columns.items() if isinstance(value, (int, float))]
    if final.average is not None:
        parts.append(f"average {final.average:.4g}")
    if not parts and final.step_time_s is not None:
        parts.append(f"step time {final.step_time_s:.3g} s, peak memory {final.peak_memory_mb or 0:.0f} MiB")
    eps = final.epsilon_spent
    if eps is not None and math.isfinite(eps):
        parts.append(f"ε spent {eps:.3g}")
    return ", ".join(parts) or "no scores"


def counter(record: dict[str, Any], total: int) -> tuple[Any, Any]:
    """The step a metrics record's log line counts and the total it counts against: a trainer that runs
    several short runs in one job (:mod:`pipelines.verbs.diagnostics`) gives each record its run's ``run_step``
    and ``run_steps``; any other record counts its ``step`` against the job's ``total``."""
    if "run_steps" in record:
        return record.get("run_step"), record["run_steps"]
    return record.get("step"), total


def _brief(record: dict[str, Any]) -> str:
    keys = ("loss", "clip_fraction", "epsilon_spent", "step_time_s")
    return " ".join(f"{k}={record[k]:.4g}" for k in keys
                    if isinstance(record.get(k), (int, float)) and math.isfinite(record[k]))


def run_config(cfg: DictConfig, trainer: Trainer | None = None) -> int:
    """Run one job of a grid from its validated config (the local launcher's workers,
    :mod:`pipelines.runs.worker`) as ``python -m pipelines run <its overrides>`` would, without composing or
    validating it again; returns that command's exit code. SIGTERM stays with the worker's own handler
    (:func:`pipelines.runs.worker.init`: the first one interrupts the job, a repeat is ignored, and the
    worker then exits without an interpreter shutdown a further SIGTERM could cut into)."""
    return _stoppable(lambda: _run(cfg, trainer, debug=False), False, sigterm=False)


def _stoppable(body: Callable[[], int], debug: bool, sigterm: bool = True) -> int:
    """``body()`` with SIGTERM taken as Ctrl-C (unless ``sigterm`` is false); an interrupt is exit code 130
    (re-raised under ``--debug``)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    quiet_third_party_warnings()
    previous = None
    if sigterm and threading.current_thread() is threading.main_thread():  # scancel, preemption: as Ctrl-C
        previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return body()
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM raises the interrupt Ctrl-C raises: the run is recorded ``stopped`` and resumes later."""
    raise KeyboardInterrupt("SIGTERM")


def _run(cfg: DictConfig, trainer: Trainer | None, debug: bool) -> int:
    """Run a validated job: narration on stdout, one ``error:`` line and the exit code on failure."""
    setup_logging()
    try:
        execute(cfg, trainer)
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted: the run is marked stopped; rerun the same command to resume it", file=sys.stderr)
        return 130
    except Exception as err:
        if debug:
            raise
        bad_input = isinstance(err, _input_errors())
        kept = store.run_dir(cfg) / "traceback.txt"
        hint = "" if bad_input else f" (traceback in {kept}, or rerun with --debug)" if kept.exists() \
            else " (rerun with --debug for the traceback)"
        print(f"error: {_one_line(err)}{hint}", file=sys.stderr)
        return 2 if bad_input else 1
    return 0


def _input_errors() -> tuple[type[Exception], ...]:
    """Errors of bad input: the config's, the store's, and those the core raises for input only it can
    see (data files, tokenised lengths)."""
    from prism.data import DataUnavailableError
    from prism.data.prompts import TruncatedLabelError

    return ConfigError, StoreError, DataUnavailableError, TruncatedLabelError


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if isinstance(err, _input_errors()) else f"{type(err).__name__}: {text}"


def quiet_third_party_warnings() -> None:
    """Silence library noise a user cannot act on: FutureWarning/DeprecationWarning raised in
    libraries (torch, transformers, peft, opacus), transformers' advisory warnings and weight-loading
    progress bars, W&B's banner. Warnings raised in this project's own code still show."""
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(?!prism\b|pipelines\b)")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # "Loading weights" bars: narrated instead
    os.environ.setdefault("WANDB_SILENT", "true")


def setup_logging() -> None:
    """Narration on stdout, one ``[HH:MM:SS] message`` line per event; libraries only warn."""
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="[%(asctime)s] %(message)s",
                        datefmt="%H:%M:%S", force=True)
    for noisy in ("httpx", "urllib3", "filelock", "wandb"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


