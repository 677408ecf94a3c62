"""The local launcher's worker processes: each runs grid jobs one after another and keeps its
backbone loaded.

``launcher=local`` (:func:`pipelines.runs.launch.run_local`) starts ``jobs=K`` spawned processes and
hands each one job at a time: its resolved config, composed and validated once by the grid process
(:func:`pipelines.runs.launch.plan`). A job runs as ``python -m pipelines run <overrides>`` would
(:func:`pipelines.runs.runner.run_config`: the run folder's lock, skip / resume, the store format, W&B), with
two differences that change no result: the interpreter and its imports are already warm, and the
frozen backbone comes from :class:`prism.models.KeptBackbones`, a deep copy of the weights the process
loaded for its first job. Every job seeds its own RNGs in :func:`prism.train.build`, so a run's numbers do not depend on
which worker ran it or what ran before (``tests/test_worker.py`` checks them bitwise against a fresh
``python -m pipelines run``). What a shared process does change: ``final.json``'s
``run.peak_rss_mb`` and the CPU ``peak_memory_mb`` are the process's high-water mark so far, so
timing and memory benchmarks (``train.benchmark``, Table 5) get one fresh process per job.

Stopping (:func:`init`): a worker ignores SIGINT (Ctrl-C reaches the whole terminal process group; the
launcher decides) and takes SIGTERM — from the launcher, or from the kernel when the launcher dies —
as Ctrl-C inside a job, so :mod:`pipelines.runs.runner` records the run interrupted, and then exits; an idle
worker exits at once.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import sys
from typing import Any

from omegaconf import DictConfig

# set by the launcher before it spawns the workers: torch reads them when it is first imported
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
_kept: Any = None  # this process's prism.models.KeptBackbones, made on its first job
_busy = False  # a job is running in this process
_stopping = False  # SIGTERM came during the running job
PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


def init() -> None:
    """Pool initializer: SIGINT ignored, SIGTERM stops (:func:`_stop`), and on Linux SIGTERM also
    when the launcher dies, whatever killed it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop)
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop(signum: int, _frame: object) -> None:
    """SIGTERM: between jobs, exit; inside a job, ``KeyboardInterrupt`` (the run's except path records
    it interrupted, and :func:`run_job` then ends the process); a repeat while that is recorded is
    ignored."""
    global _stopping
    if not _busy:
        raise SystemExit(128 + signum)
    if not _stopping:
        _stopping = True
        raise KeyboardInterrupt(signal.Signals(signum).name)


def run_job(cfg: DictConfig, log_path: str) -> int:
    """Run the job of the validated config ``cfg`` as ``python -m pipelines run`` would, its output appended
    to ``log_path``; returns that command's exit code (0 finished or skipped, 1 failed, 2 bad input, 130
    interrupted)."""
    global _kept, _busy
    from pipelines.runs import runner

    try:
        _busy = True
        with open(log_path, "a", buffering=1) as out, contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(out):
            if _kept is None:
                from prism.models import KeptBackbones

                _kept = KeptBackbones()
            return runner.run_config(cfg, trainer=lambda job, folder, log_fn: runner.default_trainer(job, folder, log_fn,
                                                                                                   load=_kept))
    finally:
        if _stopping:  # the run is recorded (the log file is closed); nothing is left for this process to do
            os._exit(128 + signal.SIGTERM)
        _busy = False
        gc.collect()
