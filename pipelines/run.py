"""Hydra entry point: one job = one resolved config = one run folder (SPEC §6).

    python -m pipelines.run method=adamw privacy=eps3 suite=math10k        # one run
    python -m pipelines.run -m experiment=table2                           # Hydra multirun (basic launcher: sequential)
    python -m pipelines.run -m experiment=table2 scale=paper launcher=slurm   # SLURM array; blocks: use tmux/nohup

Each job validates its config, takes the run folder's lock, skips a finished run (unless
``force=true``), resumes an interrupted one, sets aside unreadable files of a corrupt one, then
calls ``prism.train.train_and_evaluate`` and writes the folder format of :mod:`pipelines.store`.
"""
from __future__ import annotations

import importlib.metadata
import logging
import math
import os
import platform
import resource
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from filelock import FileLock, Timeout
from omegaconf import DictConfig, OmegaConf

from pipelines import store
from pipelines.grid import resolve
from pipelines.wandb_log import WandbRun

log = logging.getLogger("pipelines.run")
REPO = Path(__file__).resolve().parents[1]
Trainer = Callable[[DictConfig, Path, Callable[[dict[str, Any]], None]], dict[str, Any]]
VERSIONED = ("torch", "transformers", "peft", "opacus", "hydra-core", "wandb")


class ConfigError(ValueError):
    """A config value that cannot run; the message names the field and the fix."""


def validate(cfg: DictConfig) -> None:
    """Reject impossible configs before any work (rank/width and batch/data checks need the model
    and data and run in the core, still before the first step)."""
    eps, delta = float(cfg.privacy.epsilon), float(cfg.privacy.delta)
    t = cfg.train
    checks = [
        (eps > 0, f"privacy.epsilon={eps} must be > 0 (use privacy=nondp for a non-private run)"),
        (0 < delta < 1, f"privacy.delta={delta} must lie in (0, 1), e.g. 1e-5"),
        (float(cfg.privacy.clip_norm) > 0, f"privacy.clip_norm={cfg.privacy.clip_norm} must be > 0"),
        (t.batch_size >= 1, f"train.batch_size={t.batch_size} must be >= 1"),
        (1 <= t.micro_batch_size <= t.batch_size,
         f"train.micro_batch_size={t.micro_batch_size} must lie in [1, train.batch_size={t.batch_size}]"),
        (t.steps >= 1, f"train.steps={t.steps} must be >= 1"),
        (t.checkpoint_every >= 1, f"train.checkpoint_every={t.checkpoint_every} must be >= 1"),
        (cfg.lora.r >= 1, f"lora.r={cfg.lora.r} must be >= 1"),
        (0 <= float(cfg.lora.dropout) < 1, f"lora.dropout={cfg.lora.dropout} must lie in [0, 1)"),
        (isinstance(cfg.method.lr, float) and cfg.method.lr > 0,
         f"method.lr={cfg.method.lr!r} must be a positive float"),
    ]
    if t.benchmark is not None:
        checks.append((t.benchmark.warmup >= 0 and t.benchmark.measure >= 1,
                       "train.benchmark needs warmup >= 0 and measure >= 1"))
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def default_trainer(cfg: DictConfig, folder: Path, log_fn: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """``prism.train.train_and_evaluate`` (imported lazily: the pipeline tests never load torch models)."""
    from prism.train import train_and_evaluate

    return train_and_evaluate(cfg, folder, log_fn)


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
    """Run one job; returns ``finished`` (trained now), ``skipped`` (already finished) or ``busy``
    (another process holds the run folder's lock). A failing trainer marks the run ``failed`` and
    re-raises."""
    cfg = resolve(cfg)
    validate(cfg)
    run_hash, folder = store.run_hash(cfg), store.run_dir(cfg)
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(store.lock_path(folder))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("run %s is being trained by another process (lock %s held); not starting a second copy",
                    folder, store.lock_path(folder))
        return "busy"
    try:
        store.adopt(folder, str(cfg.experiment))  # old-layout folder moved in; run tagged with the experiment
        info = store.inspect_run(folder)
        if info.state == "finished" and not cfg.force:
            log.info("run %s already finished; skipped (force=true trains it again)", folder)
            return "skipped"
        if info.state == "finished":
            log.warning("force=true: moved the finished run to %s", store.move_aside(folder))
            info = store.inspect_run(folder)
        if info.state == "corrupt":
            moved = store.quarantine(folder, info.bad)
            log.warning("run %s was corrupt (%s); kept %s and rerunning", folder, info.reason,
                        ", ".join(p.name for p in moved))
        if folder.exists() and not store.config_matches(folder, cfg):
            log.warning("run folder %s holds a different config; moved it to %s", folder, store.move_aside(folder))
        attempts = 1 + int((info.status or {}).get("attempts", 0)) if folder.exists() else 1
        return _train(cfg, folder, run_hash, attempts, trainer or default_trainer)
    finally:
        lock.release()


def _train(cfg: DictConfig, folder: Path, run_hash: str, attempts: int, trainer: Trainer) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    store.write_text_atomic(folder / "config.yaml", OmegaConf.to_yaml(cfg))
    store.seal_metrics(folder)
    started, t0 = store.utc_stamp(), time.time()
    store.write_status(folder, "running", started=started, attempts=attempts)
    if attempts > 1:
        log.info("run %s: attempt %d, resuming from %s", folder, attempts, folder / "checkpoint")
    generation = len(list(folder.parent.glob(f"{run_hash}.old-*")))
    wb = WandbRun(cfg, run_hash, generation)
    total = cfg.train.benchmark.warmup + cfg.train.benchmark.measure if cfg.train.benchmark else cfg.train.steps

    def log_fn(record: dict[str, Any]) -> None:
        store.append_metrics(folder, record)
        wb.log_step(record)
        log.info("[%s] step %s/%s %s", run_hash, record.get("step"), total, _brief(record))

    try:
        record = trainer(cfg, folder, log_fn)
    except BaseException as exc:
        store.write_status(folder, "failed", started=started, attempts=attempts,
                           error=f"{type(exc).__name__}: {exc}", ended=store.utc_stamp())
        wb.finish(None, exit_code=1)
        raise
    commit, dirty = git_state()
    final = {**record, "run": {
        "hash": run_hash, "experiment": str(cfg.experiment), "wall_time_s": time.time() - t0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "started": started, "ended": store.utc_stamp(), "attempts": attempts, "versions": versions(),
        "git_commit": commit, "git_dirty": dirty, "hostname": socket.gethostname(),
    }}
    store.write_json_atomic(folder / "final.json", final)
    store.write_status(folder, "finished", started=started, attempts=attempts, ended=final["run"]["ended"])
    wb.finish(final)
    log.info("run %s finished in %.1f s", folder, final["run"]["wall_time_s"])
    return "finished"


def _brief(record: dict[str, Any]) -> str:
    keys = ("loss", "clip_fraction", "epsilon_spent", "step_time_s")
    return " ".join(f"{k}={record[k]:.4g}" for k in keys
                    if isinstance(record.get(k), (int, float)) and math.isfinite(record[k]))


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> str:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return execute(cfg)


if __name__ == "__main__":
    main()
