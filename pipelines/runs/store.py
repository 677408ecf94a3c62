"""Run folders: the on-disk format every pipeline stage agrees on.

Layout (the spec; :mod:`pipelines.tables` and ``slurm/`` read it)
--------------------------------------------------------------------
The run store is content-addressed: one folder per result-changing config, shared by every
experiment (table) whose grid contains that config, so Table 3's Gemma-3-4B rows and Table 4's
r=16 rows reuse Table 2's finished runs instead of training them again.

* ``<results_dir>/runs/<hash>/`` — the run folder, where ``<hash>`` = first 12 hex digits of
  sha256 over the canonical JSON (sorted keys, no spaces, ``Infinity`` for ε = ∞) of the resolved
  config minus the fields that cannot change the result (:data:`pipelines.config.identity.NON_RESULT_KEYS`: ``experiment``,
  ``force``, ``results_dir``, ``logging``, launcher/``hydra`` settings, the evaluation's exact prefix
  switches ``suite.decoding.shared_prefix`` / ``frozen_prefix``). Everything else is hashed,
  including ``backbone.paper_name`` (the table row), so two paper backbones mapped onto the same
  embedded stand-in keep separate folders, and any group added later (e.g. ``protocol``).
* ``<results_dir>/runs/<hash>.lock`` — the ``filelock`` (``flock``) lock held by the job training
  the run; a run whose ``status.json`` says ``running`` while no process holds this lock was killed
  (:func:`run_state` calls it ``stale``; re-running the grid resumes it).
* ``<results_dir>/runs/_views/<experiment>/<hash>`` — empty files: the experiments a run belongs
  to. A job tags its run when it starts or skips it, and :mod:`pipelines.verbs.reproduce` tags the
  finished runs it finds, so an experiment is a view over the shared store.
* Older checkouts wrote ``<results_dir>/runs/<experiment>/<hash>/``. Such folders are not read in
  place: a command that reads the store refuses it in one line until
  ``python -m pipelines migrate results_dir=<results_dir>`` has moved them in (:func:`refuse_older_layout`,
  docs/DECISIONS.md D82).

Inside a run folder:

* ``config.yaml`` — the resolved job config (``OmegaConf.load`` gives back what the core read).
* ``metrics.jsonl`` — one JSON object per logical step, appended as training runs (the core's
  ``log_fn`` records: ``step, loss, clip_fraction, sigma, epsilon_spent, noise_norm, step_time_s``,
  …). A resumed run first drops the lines of the steps it trains again (:func:`trim_metrics`), so
  each step appears once; a line cut off by a kill is skipped by readers.
* ``final.json`` — written once, atomically, when training and evaluation finished: the core's
  returned record verbatim at top level (task scores, ``sigma``, ``epsilon_spent`` (realised ε),
  ``n_train``, ``eval_rows``, ``peak_memory_mb``, ``step_time_s``, ``wall_time_s``, …) plus
  ``"run"``: ``{hash, experiment (the one that trained it), wall_time_s (whole job incl. loading),
  peak_rss_mb, started, ended, attempts, versions {…}, git_commit, git_dirty, hostname}``; under
  ``privacy.log_private_stats=false`` neither block holds a time or memory figure. A private selection's
  candidate (``privacy.selection``) also has the core's ``selection`` block. The core's fields are typed by
  :class:`prism.record.FinalRecord` (written and read through it), the ``run`` block by :class:`RunBlock`.
* ``status.json`` — written atomically (tmp + ``os.replace``): ``{state: running|finished|failed|stopped,
  error: str|null, started, ended, attempts}`` (times ISO-8601 UTC, absent under
  ``privacy.log_private_stats=false``; ``attempts`` counts job starts).
* ``checkpoint/`` (owned by the core), ``adapter/`` (exported LoRA adapter).
* ``traceback.txt`` — the full traceback of a failed job (the console shows one line).
* ``<name>.corrupt-<UTC timestamp>`` — a file found unreadable, kept aside (never deleted).
* ``final.json.unconfirmed-<UTC timestamp>`` — a parseable ``final.json`` of a run whose
  ``status.json`` does not say ``finished`` (unreadable, or the job died between the two writes),
  set aside before the run trains again, so no result is ever overwritten.

Files are written through :func:`prism.fileio.atomic_write` (fsync, mode 0644), readable by a group on a
shared cluster. A run is **finished** iff ``status.json`` says ``finished`` and ``final.json``
parses; only then is it skipped on re-submission. ``force=true`` renames a finished folder to
``<hash>.old-<timestamp>`` (never deleted); the views keep pointing at the hash, i.e. at the rerun.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipelines.config.identity import HASH_RE, canonical, hash_payload, run_hash
from pipelines.config.schema import ConfigError
from prism.evaluation.metrics import COLUMN_RULES, gold_is_valid
from prism.fileio import write_text_atomic
from prism.record import FinalRecord, Outcome, RecordError

VIEWS = "_views"
STATUS_STATES = ("running", "finished", "failed", "stopped")  # status.json's `state` (stopped: by a signal)
FULL = (errno.ENOSPC, errno.EDQUOT)  # a write failed because the disk (or the user's quota) is full
STATUS_ERROR_CHARS = 300  # the error text kept when status.json is rewritten in place on a full disk


def utc_stamp() -> str:
    """Now, ISO-8601 UTC to the second."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def runs_root(cfg: DictConfig) -> Path:
    """``<results_dir>/runs``: the store, its locks and its views."""
    return Path(cfg.results_dir) / "runs"


def run_dir(cfg: DictConfig) -> Path:
    """``<results_dir>/runs/<hash>`` (the store folder, whichever experiment asks)."""
    return find_run(runs_root(cfg), run_hash(cfg))


def lock_path(folder: Path) -> Path:
    """The lock file beside a run folder (outside it, so moving the folder aside keeps the lock)."""
    return folder.with_name(folder.name + ".lock")


def lock_held(folder: Path) -> bool:
    """Whether a live process holds the run's lock (a shared ``flock`` probe, released at once).

    ``flock`` locks die with their process, so a killed job leaves no holder behind."""
    try:
        fd = os.open(lock_path(folder), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a probe lock that was granted
    return False


# ------------------------------------------------------------------------------------- views

def tag(root: Path, experiment: str, run_hash_: str) -> bool:
    """Add run ``run_hash_`` to the view of ``experiment`` (idempotent; safe under concurrency);
    False when the store is not writable (a read-only store's views stay as they are)."""
    view = Path(root) / VIEWS / experiment
    try:
        view.mkdir(parents=True, exist_ok=True)
        (view / run_hash_).touch(exist_ok=True)
    except OSError:
        return False
    return True


def untag(root: Path, experiment: str, run_hash_: str) -> None:
    """Take run ``run_hash_`` out of the view of ``experiment``; its folder stays in the store."""
    (Path(root) / VIEWS / experiment / run_hash_).unlink(missing_ok=True)


def view(root: Path, experiment: str) -> list[str]:
    """Run hashes of ``experiment``'s view (:func:`refuse_older_layout` first); a view (or ``_views``) that is
    not a folder is one :class:`ConfigError` line, not an empty view."""
    refuse_older_layout(root)
    tagged = Path(root) / VIEWS / experiment
    for path in (tagged.parent, tagged):
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{path} is a file, not the folder of an experiment's run hashes, so the runs of "
                              f"{experiment} cannot be listed; move it aside, then rerun the experiment's command "
                              f"(e.g. python -m pipelines reproduce experiment={experiment}): it tags its finished "
                              "runs again without training them")
    return sorted(p.name for p in tagged.iterdir()) if tagged.is_dir() else []


def find_run(root: Path, run_hash_: str) -> Path:
    """Where run ``run_hash_`` lives: ``<root>/<hash>`` (absent until a job starts it)."""
    return Path(root) / run_hash_


def older_layout(root: Path) -> dict[str, list[Path]]:
    """Run folders of the older ``<root>/<experiment>/<hash>/`` layout, by hash (each hash's in sorted order)."""
    root, runs = Path(root), {}
    parents = sorted(p for p in root.iterdir() if p.name != VIEWS and not HASH_RE.fullmatch(p.name.split(".")[0])
                     and p.is_dir()) if root.is_dir() else []
    for folder in (p for parent in parents for p in sorted(parent.iterdir())):
        if HASH_RE.fullmatch(folder.name) and folder.is_dir():
            runs.setdefault(folder.name, []).append(folder)
    return runs


def refuse_older_layout(root: Path) -> None:
    """A one-line :class:`ConfigError` when ``root`` (``<results_dir>/runs``) holds an older-layout folder that
    :func:`migrate` has not taken in (its run not in the store, or not tagged into its experiment's view)."""
    root = Path(root)
    older = older_layout(root)
    if (root / "runs" / VIEWS).is_dir() or any(p.parent.name == "runs" for copies in older.values() for p in copies):
        raise ConfigError(f"{root} is the results folder, not its run store: pass {root / 'runs'} "
                          f"(runs_dir={root / 'runs'})")
    if any(not (root / h).exists() or not (root / VIEWS / p.parent.name / h).exists()
           for h, copies in older.items() for p in copies):
        raise ConfigError(f"{root} holds runs in the older layout; run python -m pipelines migrate "
                          f"results_dir={root.parent} once")


def migrate(results_dir: Path) -> list[tuple[Path, Path]]:
    """Move every older-layout run folder into the store and tag its run into its experiment's view (a run
    already in the store, or a second copy of a run, stays where it is: the store's copy is read, a finished
    copy moved in first; a copy whose lock an older checkout holds is left for a later call). A store copy that
    is not finished gives way to a finished older copy: it is moved aside (:func:`move_aside`, never deleted;
    returned as a move too), so the table reads the finished record and the grid does not train it again."""
    from filelock import FileLock, Timeout

    root = Path(results_dir) / "runs"
    moved = []
    for run_hash_, copies in sorted(older_layout(root).items()):
        folder = root / run_hash_
        lock = FileLock(lock_path(folder))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        try:
            source = ([p for p in copies if inspect_run(p).state == "finished"] or copies)[0]
            if (folder.exists() and inspect_run(folder).state != "finished" and inspect_run(source).state == "finished"
                    and not lock_held(source)):  # our lock: no job of this checkout trains the store's copy
                moved.append((folder, move_aside(folder, "unfinished")))
            if not folder.exists() and not lock_held(source):  # an older checkout may still be training it
                source.rename(folder)
                moved.append((source, folder))
            for copy in copies:
                tag(root, copy.parent.name, run_hash_)
        finally:
            lock.release()
    return moved


# ------------------------------------------------------------------------------------- files

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


@dataclass(frozen=True)
class RunBlock:
    """``final.json``'s ``run`` block: who trained the run, where and with which code. Written by
    :mod:`pipelines.runs.runner` through :meth:`to_json` and read back only through :meth:`from_final` (or
    :func:`read_final`); the times and memory are ``None`` (absent from the file) under ``privacy.log_private_stats=false``."""

    hash: str
    experiment: str
    attempts: int
    versions: dict[str, str | None]
    git_commit: str | None
    git_dirty: bool | None
    hostname: str
    wall_time_s: float | None = None
    started: str | None = None
    ended: str | None = None
    peak_rss_mb: float | None = None

    TIMES = ("wall_time_s", "started", "ended", "peak_rss_mb")
    KEY = "run"  # its key in final.json, beside the core's fields

    def to_json(self) -> dict[str, Any]:
        """The block as written (the times only when recorded)."""
        return {k: v for k, v in asdict(self).items() if k not in self.TIMES or v is not None}

    @classmethod
    def from_final(cls, final: Mapping[str, Any]) -> RunBlock:
        """The block of a parsed ``final.json``; :class:`RecordError` naming the first missing field."""
        block = final.get(cls.KEY)
        if not isinstance(block, Mapping):
            raise RecordError("final.json has no `run` block")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in block and n not in cls.TIMES]
        if missing:
            raise RecordError(f"final.json's `run` block lacks `{missing[0]}`")
        return cls(**{n: block[n] for n in names if n in block})


SCORED_FIELDS = ("columns", "epsilon_spent", "per_example")
""":class:`~prism.record.FinalRecord` fields every scored (non-benchmark) run writes: its columns, its realised ε and
the per-row outcomes of its evaluation rows (the tables' intervals are bootstraps over them)."""


def read_final(final: Mapping[str, Any]) -> tuple[FinalRecord, RunBlock]:
    """The core's record and the runner's :class:`RunBlock` of a parsed ``final.json``; :class:`RecordError` naming
    the first missing or mistyped field."""
    run = RunBlock.from_final(final)
    return FinalRecord.from_json(final), run


def read_record(folder: Path) -> FinalRecord:
    """The core's record of a run folder's ``final.json``: ``ValueError`` (:class:`RecordError` included) when it
    does not parse, ``FileNotFoundError`` when it is absent."""
    return FinalRecord.from_json(read_json(folder / "final.json"))


def final_problem(final: Mapping[str, Any]) -> str:
    """Why a parsed ``final.json`` cannot be averaged ('' when it can): a field that does not parse into its
    :class:`RunBlock` or :class:`~prism.record.FinalRecord` (its :class:`~prism.record.SelectionBlock` included),
    or a problem of its scores (:func:`scores_problem`)."""
    try:
        record, _ = read_final(final)
    except RecordError as err:
        return str(err)
    return scores_problem(record)


def scores_problem(record: FinalRecord) -> str:
    """Why the scores of a record (a ``final.json``, or a W&B summary, which carries no run block) cannot be
    averaged ('' when they can): a missing field of :data:`SCORED_FIELDS`, or a column without rows."""
    if record.columns:
        missing = [f for f in SCORED_FIELDS if getattr(record, f) is None]
        if missing:
            return f"final.json lacks `{missing[0]}`"
        scored = {o.column for o in record.per_example.values()}
        unscored = [c for c in record.columns if c not in scored]
        if unscored:
            return f"final.json's `per_example` has no rows of column {unscored[0]}"
        scored_rows = record.n or {}
        for name, outcome in record.per_example.items():
            if why := outcome_problem(outcome, scored_rows.get(name.split("/")[0])):
                return f"final.json's `per_example` of {name}: {why}"
    return ""


def outcome_problem(outcome: Outcome, scored: Any) -> str:
    """Why one task's per-row outcomes (:func:`prism.evaluation.metrics.row_outcomes`; a user classification
    task's ``Macro-F1`` labels) disagree with their metric or with ``scored``, the rows the evaluation scored
    (``final.json`` ``n``; None if not recorded) ('' when they agree): a correctness outside 0/1, a label
    outside the task's labels, a gold answer its column's rule would have skipped, or another row count."""
    if outcome.correct is not None:
        rows = outcome.correct
        if bad := [c for c in rows if c not in (0, 1)]:
            return f"correct={bad[0]!r} is not 0 or 1"
    else:
        rows, preds, labels = outcome.gold or [], outcome.pred or [], outcome.labels
        if labels is not None:  # Macro-F1: labels 0..labels-1, an unparsed prediction -1
            bad = [g for g in rows if g not in range(labels)] or [p for p in preds if p not in range(-1, labels)]
        else:
            bad = [g for g in rows if outcome.column in COLUMN_RULES and not gold_is_valid(outcome.column, g)]
        if bad:
            return f"{bad[0]!r} is outside the labels or answers of its column"
        if len(preds) != len(rows):
            return f"{len(preds)} predictions beside {len(rows)} gold answers"
    if isinstance(scored, int) and len(rows) != scored:
        return f"{len(rows)} rows of outcomes, but the evaluation scored {scored} (final.json `n`)"
    return ""


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
        if not isinstance(status, dict) or status.get("state") not in STATUS_STATES:
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
    with contextlib.suppress(ValueError, FileNotFoundError):
        final_ok = isinstance(read_json(folder / "final.json"), dict)
    finished = status is not None and status["state"] == "finished"
    if not final_ok and (finished or (folder / "final.json").exists()):  # unreadable, or finished without it
        bad.append("final.json")
    if bad:
        return RunInfo("corrupt", status, tuple(bad), f"unreadable or missing: {', '.join(bad)}")
    if finished:
        return RunInfo("finished", status)
    reason = "no status.json" if status is None else f"state {status['state']}"
    return RunInfo("incomplete", status, reason=reason)


def run_state(folder: Path, info: RunInfo | None = None) -> str:
    """One of finished, running, stale, stopped, failed, corrupt, absent: ``running`` only while a live
    process holds the run's lock; ``stale`` for a started run nobody holds (killed: status still says
    running, or no status); ``failed`` when the job recorded its error, ``stopped`` when a signal (Ctrl-C,
    SIGTERM, a SLURM preemption) stopped it. Stale, stopped and failed runs resume on re-submission."""
    info = inspect_run(folder) if info is None else info
    if info.state in ("absent", "finished", "corrupt"):
        return info.state
    if lock_held(folder):
        return "running"
    recorded = (info.status or {}).get("state")
    return recorded if recorded in ("failed", "stopped") else "stale"


def quarantine(folder: Path, names: tuple[str, ...]) -> list[Path]:
    """Rename the listed files to ``<name>.corrupt-<timestamp>`` (kept for inspection, never deleted)."""
    return [move_aside(folder / name, "corrupt") for name in names if (folder / name).exists()]


def remove_temporaries(folder: Path) -> list[Path]:
    """Delete the half-written temporary files of an atomic write (``.<name>.*tmp*``, e.g. a
    checkpoint cut off by a full disk) under a run folder whose lock the caller holds."""
    removed = [path for path in sorted(folder.rglob(".*tmp*")) if path.is_file()] if folder.is_dir() else []
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def move_aside(path: Path, why: str = "old") -> Path:
    """Rename a run folder (or a file in one) to ``<name>.<why>-<timestamp>``, a unique name: earlier
    results are kept, never overwritten or deleted."""
    stamp = utc_stamp().replace(":", "")
    target, n = path.with_name(f"{path.name}.{why}-{stamp}"), 1
    while target.exists():
        target, n = path.with_name(f"{path.name}.{why}-{stamp}-{n}"), n + 1
    path.rename(target)
    return target


def config_matches(folder: Path, cfg: DictConfig) -> bool:
    """Whether the folder's saved config has the same result-changing fields as ``cfg``."""
    path = folder / "config.yaml"
    if not path.exists():
        return True
    return canonical(hash_payload(OmegaConf.load(path))) == canonical(hash_payload(cfg))


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    """The step records of ``metrics.jsonl`` in file order (none when absent; a line cut off by a kill
    is skipped)."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


def write_status(folder: Path, state: str, *, started: str | None, attempts: int, error: str | None = None,
                 ended: str | None = None) -> None:
    """Atomically (re)write ``status.json``; ``started`` and ``ended`` only when given (a run with
    ``privacy.log_private_stats=false`` records no time)."""
    times = {key: value for key, value in (("started", started), ("ended", ended)) if value is not None}
    status = {"state": state, "error": error, "attempts": attempts, **times}
    try:
        write_json_atomic(folder / "status.json", status)
    except OSError as err:  # a full disk: overwrite the old status in place, in the blocks it already has
        if err.errno not in FULL or not (folder / "status.json").exists():
            raise
        text = json.dumps({**status, "error": (error or "")[:STATUS_ERROR_CHARS] or None}, indent=1, sort_keys=True)
        with open(folder / "status.json", "r+") as handle:
            handle.write(text + "\n")
            handle.truncate()
            handle.flush()
            os.fsync(handle.fileno())


def trim_metrics(folder: Path, before_step: int) -> int:
    """Keep only the ``metrics.jsonl`` lines of steps before ``before_step`` (a resumed run logs its
    steps again from its checkpoint on, so each step stays in the file once); returns the lines dropped."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        with contextlib.suppress(ValueError, TypeError):
            record = json.loads(line)
            if int(record["step"]) < before_step:
                kept.append(line)
    if len(kept) < len(lines):
        write_text_atomic(path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


