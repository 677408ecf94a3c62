"""Run folders: the on-disk format every pipeline stage agrees on (SPEC §6).

Format (the spec; :mod:`pipelines.aggregate` and ``slurm/`` read it)
---------------------------------------------------------------------
``<results_dir>/runs/<experiment>/<hash>/`` — one folder per resolved job config, where

* ``<hash>`` = first 12 hex digits of sha256 over the canonical JSON (sorted keys, no spaces,
  ``Infinity`` for ε = ∞) of the resolved fields that change the result: ``seed``, ``backbone``,
  ``suite`` (incl. ``suite.scale``), ``method``, ``privacy``, ``lora``, ``train`` (see
  :data:`RESULT_KEYS`). Not hashed: ``experiment``, ``force``, ``results_dir``, ``logging``,
  launcher/``hydra`` settings. ``backbone.paper_name`` (the table row) is hashed, so two paper
  backbones mapped onto the same embedded stand-in keep separate folders.
* ``config.yaml`` — the resolved job config (``OmegaConf.load`` gives back what the core read).
* ``metrics.jsonl`` — one JSON object per logical step, appended as training runs (the core's
  ``log_fn`` records: ``step, loss, clip_fraction, sigma, epsilon_spent, noise_norm, step_time_s``,
  …). After a resume, steps after the last checkpoint appear twice: readers keep the *last* line
  per ``step`` (:func:`read_metrics`); unparsable lines are skipped.
* ``final.json`` — written once, atomically, when training and evaluation finished: the core's
  returned record verbatim at top level (task scores, ``sigma``, ``epsilon_spent`` (realised ε),
  ``peak_memory_mb``, ``step_time_s``, ``wall_time_s``, …) plus ``"run"``: ``{hash, experiment,
  wall_time_s (whole job incl. loading), peak_rss_mb, started, ended, attempts, versions {python,
  torch, transformers, peft, opacus, hydra-core, wandb}, git_commit, git_dirty, hostname}``.
* ``status.json`` — written atomically (tmp + ``os.replace``): ``{state: running|finished|failed,
  error: str|null, started, ended, attempts}`` (times ISO-8601 UTC; ``attempts`` counts job starts).
* ``checkpoint/`` (owned by the core), ``adapter/`` (exported LoRA adapter).
* ``<name>.corrupt-<UTC timestamp>`` — a file found unreadable, kept aside (never deleted).

A run is **finished** iff ``status.json`` says ``finished`` and ``final.json`` parses; only then
is it skipped on re-submission. ``<hash>.lock`` (beside the folder) is the ``filelock`` lock held
by the job training it. ``force=true`` renames a finished folder to ``<hash>.old-<timestamp>``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

RESULT_KEYS = ("seed", "backbone", "suite", "method", "privacy", "lora", "train")
HASH_LEN = 12
FILES = ("config.yaml", "metrics.jsonl", "final.json", "status.json")


def utc_stamp() -> str:
    """Now, ISO-8601 UTC to the second."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def hash_payload(cfg: DictConfig | dict) -> dict[str, Any]:
    """The resolved fields that change a run's result (:data:`RESULT_KEYS`)."""
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    missing = [k for k in RESULT_KEYS if k not in plain]
    if missing:
        raise ValueError(f"config lacks {missing}; compose it from conf/config.yaml")
    return {k: plain[k] for k in RESULT_KEYS}


def run_hash(cfg: DictConfig | dict) -> str:
    """Short sha256 of the canonical JSON of :func:`hash_payload`."""
    text = json.dumps(hash_payload(cfg), sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_LEN]


def run_dir(cfg: DictConfig) -> Path:
    """``<results_dir>/runs/<experiment>/<hash>``."""
    return Path(cfg.results_dir) / "runs" / str(cfg.experiment) / run_hash(cfg)


def lock_path(folder: Path) -> Path:
    """The lock file beside a run folder (outside it, so moving the folder aside keeps the lock)."""
    return folder.with_name(folder.name + ".lock")


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temp file in the same folder, fsync, then ``os.replace`` (never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """Atomically write ``obj`` as JSON (numpy/torch scalars become numbers)."""
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def read_json(path: Path) -> Any:
    """Parse a JSON file; raises ``ValueError`` (bad JSON) or ``FileNotFoundError``."""
    return json.loads(path.read_text())


def append_metrics(folder: Path, record: dict[str, Any]) -> None:
    """Append one step record as a JSON line (flushed, so a kill loses at most that line)."""
    line = json.dumps(record, sort_keys=True, default=_json_default)
    with open(folder / "metrics.jsonl", "a") as f:
        f.write(line + "\n")
        f.flush()


def seal_metrics(folder: Path) -> None:
    """End a line cut off by a kill, so the next append starts a fresh line (the cut one is skipped)."""
    path = folder / "metrics.jsonl"
    if path.exists() and path.stat().st_size > 0:
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    """Step records, one per ``step`` (the last line wins after a resume), in step order."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    by_step: dict[Any, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            by_step[record.get("step")] = record
    return sorted(by_step.values(), key=lambda r: (r.get("step") is None, r.get("step") or 0))


@dataclass(frozen=True)
class RunInfo:
    """What a run folder holds: ``absent``, ``finished``, ``incomplete`` (running/failed/killed,
    resumable) or ``corrupt`` (files that do not parse, listed in ``bad``)."""

    state: str
    status: dict[str, Any] | None
    bad: tuple[str, ...] = ()
    reason: str = ""


def inspect_run(folder: Path) -> RunInfo:
    """Classify a run folder without modifying it."""
    if not folder.exists():
        return RunInfo("absent", None)
    bad: list[str] = []
    status = None
    try:
        status = read_json(folder / "status.json")
        if not isinstance(status, dict) or status.get("state") not in ("running", "finished", "failed"):
            raise ValueError("no valid state")
    except FileNotFoundError:
        pass
    except ValueError:
        bad.append("status.json")
        status = None
    if (folder / "config.yaml").exists():
        try:
            if not isinstance(OmegaConf.load(folder / "config.yaml"), DictConfig):
                raise ValueError("not a mapping")
        except Exception:
            bad.append("config.yaml")
    final_ok = False
    if (folder / "final.json").exists():
        with contextlib.suppress(ValueError):
            final_ok = isinstance(read_json(folder / "final.json"), dict)
        if not final_ok:
            bad.append("final.json")
    if status is not None and status["state"] == "finished" and not final_ok and "final.json" not in bad:
        bad.append("final.json")  # finished without a result: half-written
    if bad:
        return RunInfo("corrupt", status, tuple(bad), f"unreadable or missing: {', '.join(bad)}")
    if status is not None and status["state"] == "finished":
        return RunInfo("finished", status)
    reason = "no status.json" if status is None else f"state {status['state']}"
    return RunInfo("incomplete", status, reason=reason)


def quarantine(folder: Path, names: tuple[str, ...]) -> list[Path]:
    """Rename the listed files to ``<name>.corrupt-<timestamp>`` (kept for inspection, never deleted)."""
    stamp = utc_stamp().replace(":", "")
    moved = []
    for name in names:
        src = folder / name
        if src.exists():
            dst = folder / f"{name}.corrupt-{stamp}"
            src.rename(dst)
            moved.append(dst)
    return moved


def move_aside(folder: Path) -> Path:
    """Rename a run folder to ``<hash>.old-<timestamp>`` (a unique name; earlier results stay)."""
    stamp = utc_stamp().replace(":", "")
    target = folder.with_name(f"{folder.name}.old-{stamp}")
    n = 1
    while target.exists():
        target = folder.with_name(f"{folder.name}.old-{stamp}-{n}")
        n += 1
    folder.rename(target)
    return target


def config_matches(folder: Path, cfg: DictConfig) -> bool:
    """Whether the folder's saved config has the same result-changing fields as ``cfg``."""
    path = folder / "config.yaml"
    if not path.exists():
        return True
    saved = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return _canonical(hash_payload(saved)) == _canonical(hash_payload(cfg))


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True)


def write_status(folder: Path, state: str, *, started: str, attempts: int, error: str | None = None,
                 ended: str | None = None) -> None:
    """Atomically (re)write ``status.json``."""
    write_json_atomic(folder / "status.json", {
        "state": state, "error": error, "started": started, "ended": ended, "attempts": attempts,
    })
