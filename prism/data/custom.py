"""A task from the user's own file (``suite=custom``, docs/custom-task.md), read and checked without torch.

Node ``suite.custom`` (:class:`prism.data.config.CustomTaskConfig`; the key names are fixed):

* ``train`` – a JSON Lines (``.jsonl``) or ``.csv`` file of rows ``{"prompt": ..., "target": ..., "id": ...}``
  (``id`` optional, unique within its file; evaluation records are identified by their prompts' sha256);
* ``eval`` – a second file of the same form, or null: then each training row is held out for evaluation
  when its own draw (:func:`row_draw`) is below ``eval_fraction`` (the same rows for every run seed and
  method, as a paper's fixed test set);
* ``validation_fraction`` – with ``suite.eval_split=validation`` (``make tune``) or in a private
  selection's candidate, each training row left after that hold-out is a validation row, scored instead
  of the evaluation rows, when its draw for validation is below this fraction;
* ``type`` – ``classification`` (``labels``), ``number`` (``tolerance`` on the last number, the Math
  suites' extraction) or ``exact`` (normalised text equal);
* ``train_sha256`` / ``eval_sha256`` – null, or the file's identifier (:func:`file_id`: a keyed hash, not
  the sha256 the names recall), checked when set (``make compare`` sets it).

A row's side of either hold-out depends on that row alone, so adding or removing one row moves no other
row between training and hold-out, and each hold-out's size is Binomial (docs/PRIVACY.md, "A user's
task file"). A row becomes an :class:`~prism.data.Example` (instruction = prompt, output = target), so it
goes through the paper suites' template, tokenisation, decoding and parsing;
:func:`prism.evaluation.metrics.score_task` scores it. Every problem is one line, ``<file> line <n>: <what
is wrong>; <fix>`` (:class:`TaskFileError`), raised by :func:`check_task` before any model is loaded; an
evaluation prompt that is also a training prompt is one warning line (:func:`leakage`).
"""
from __future__ import annotations

import codecs
import contextlib
import csv
import hashlib
import hmac
import json
import logging
import os
import secrets
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism.backbones import cache_root
from prism.data.config import CustomTaskConfig, SuiteConfig
from prism.data.prompts import train_prompt
from prism.data.rows import DataUnavailableError, Example
from prism.evaluation.metrics import TASK_KINDS, TaskRule, extract_number, normalize_exact
from prism.fileio import hmac_sha256_file, sha256_file
from prism.typed import node_of

TASK = "custom"
"""The suite's one evaluation task (its table columns are the task's metrics)."""
FIELDS = ("prompt", "target")
HOLD_OUTS = {"evaluation": ("eval_fraction", b"prism/custom/evaluation-hold-out"),
             "validation": ("validation_fraction", b"prism/custom/validation-hold-out")}
"""Each hold-out's fraction key in ``suite.custom`` and the public key of its rows' draws (:func:`row_draw`;
one key per hold-out, so a row's two draws are independent)."""
MACHINE_KEY = "custom-task.key"
"""The file under ``$PRISM_CACHE`` holding this machine's secret key of :func:`file_id` (32 random bytes)."""
KEY_BYTES = 32

TokenCounter = Callable[[str], int]
log = logging.getLogger(__name__)
_warned: set[str] = set()


class TaskFileError(DataUnavailableError):
    """A task file that cannot be used; the message is one line naming the file, the line and the fix."""


@dataclass(frozen=True)
class Row:
    """One row of a task file and the line it starts on."""

    line: int
    prompt: str
    target: str
    id: str | None


# ------------------------------------------------------------------------------------------ reading
def _text(value: Any) -> str | None:
    """A field as text: strings as they are, numbers written out; None for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return None


def _row(path: Path, line: int, record: Mapping[str, Any]) -> Row:
    for key in FIELDS:
        if key not in record or record[key] is None:
            raise TaskFileError(f"{path} line {line}: field {key!r} is missing; every row needs "
                                f"\"prompt\" and \"target\" (and optionally \"id\")")
        text = _text(record[key])
        if text is None:
            raise TaskFileError(f"{path} line {line}: field {key!r} is a {type(record[key]).__name__}, "
                                "not text; write it as a string")
        if not text.strip():
            raise TaskFileError(f"{path} line {line}: field {key!r} is empty; fill it in or drop the row")
    raw_id = record.get("id")
    row_id = None if raw_id is None or raw_id == "" else _text(raw_id)
    if raw_id not in (None, "") and row_id is None:
        raise TaskFileError(f"{path} line {line}: field 'id' is a {type(raw_id).__name__}; use a string or a number")
    return Row(line, _text(record["prompt"]), _text(record["target"]).strip(), row_id)


def check_utf8(path: Path) -> None:
    """Every line of ``path`` decodes as UTF-8; else a :class:`TaskFileError` naming the line and
    column of the first bad byte (a UTF-16 file, Windows' "Unicode", by its byte-order mark)."""
    with path.open("rb") as fh:
        if fh.read(2) in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):
            raise TaskFileError(f"{path} line 1: the file is UTF-16 text (it starts with a UTF-16 byte-order mark); "
                                "save it as UTF-8")
        fh.seek(0)
        for line, raw in enumerate(fh, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                column = len(raw[:err.start].decode("utf-8")) + 1
                raise TaskFileError(f"{path} line {line} column {column}: byte 0x{raw[err.start]:02x} is not UTF-8 "
                                    "(the file was saved in another encoding, e.g. Latin-1 or Windows-1252); save it "
                                    "as UTF-8") from None


def _jsonl(path: Path) -> list[Row]:
    rows = []
    with path.open(encoding="utf-8-sig") as fh:
        for line, text in enumerate(fh, 1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                raise TaskFileError(f"{path} line {line}: not JSON at column {err.colno} ({err.msg}); write one "
                                    "JSON object per line, e.g. {\"prompt\": \"...\", \"target\": \"...\"}") from None
            if not isinstance(record, dict):
                raise TaskFileError(f"{path} line {line}: a JSON {type(record).__name__}, not an object; write "
                                    "one object per line with \"prompt\" and \"target\"")
            rows.append(_row(path, line, record))
    return rows


def _csv(path: Path) -> list[Row]:
    with path.open(encoding="utf-8-sig", newline="") as fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        missing = [key for key in FIELDS if key not in header]
        if header and missing:
            raise TaskFileError(f"{path} line 1: the header has no column {missing[0]!r} (columns: "
                                f"{', '.join(header)}); name the columns prompt,target[,id]")
        rows, start = [], reader.line_num + 1
        for record in reader:
            if None in record:
                raise TaskFileError(f"{path} line {start}: more values than header columns; quote fields "
                                    "that contain commas")
            if any((v or "").strip() for v in record.values()):
                rows.append(_row(path, start, record))
            start = reader.line_num + 1
    return rows


def read_rows(path: str | Path) -> list[Row]:
    """The rows of a ``.jsonl`` (or ``.csv``) task file; :class:`TaskFileError` for a missing or empty
    file, a byte that is not UTF-8 (:func:`check_utf8`), a line that is not JSON, a missing or empty field."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise TaskFileError(f"{path}: no such file; give suite.custom.train (and .eval) as paths to "
                            ".jsonl or .csv files")
    check_utf8(path)
    rows = _csv(path) if path.suffix.lower() == ".csv" else _jsonl(path)
    if not rows:
        raise TaskFileError(f"{path} line 1: the file is empty (no rows); write one row per line")
    return rows


# ------------------------------------------------------------------------------------------ checking
def task_rule(node: CustomTaskConfig) -> TaskRule:
    """The scoring rule of ``suite.custom`` (type, labels, tolerance); :class:`TaskFileError` naming
    the field when it is unusable."""
    kind = node.type
    if kind not in TASK_KINDS:
        raise TaskFileError(f"suite.custom.type={kind!r} is not a task type; use one of {', '.join(TASK_KINDS)}")
    labels = node.labels
    if kind == "classification":
        typed = [] if isinstance(labels, str) else [x for x in labels or () if isinstance(x, (bool, int, float))]
        if typed:  # Hydra reads unquoted true/false and numbers as values, not as the text typed
            text = [str(x).lower() if isinstance(x, bool) else str(x) for x in labels]
            raise TaskFileError(f"suite.custom.labels=[{','.join(text)}]: Hydra read "
                                f"{', '.join(str(x).lower() if isinstance(x, bool) else str(x) for x in typed)} as "
                                f"{'boolean' if all(isinstance(x, bool) for x in typed) else 'number'}"
                                f"{'s' if len(typed) > 1 else ''}, not as "
                                f"label text; quote each label: 'suite.custom.labels=[{','.join(map(json.dumps, text))}]' "
                                f"(make compare: LABELS={','.join(text)} quotes them itself)")
        if not labels or isinstance(labels, str) or not all(isinstance(x, str) and x.strip() for x in labels):
            raise TaskFileError(f"suite.custom.labels={labels!r}: a classification task needs its label set, "
                                "e.g. suite.custom.labels=[positive,negative] (make compare: LABELS=positive,negative)")
        if len({normalize_exact(x) for x in labels}) != len(labels):
            raise TaskFileError(f"suite.custom.labels={list(labels)} repeats a label (compared lower-cased); "
                                "list each label once")
    tolerance = node.tolerance
    if not tolerance >= 0:
        raise TaskFileError(f"suite.custom.tolerance={tolerance} must be >= 0, e.g. 1e-3")
    return TaskRule(kind, tuple(str(x).strip() for x in labels or ()) if kind == "classification" else (),
                    tolerance)


def gold(rule: TaskRule, row: Row, path: Path) -> int | float | str:
    """A row's gold answer under ``rule``: label index, the target's last number, or its normalised text."""
    if rule.kind == "classification":
        if row.target not in rule.labels:
            raise TaskFileError(f"{path} line {row.line}: label {row.target!r} is not in suite.custom.labels "
                                f"{list(rule.labels)}; fix the row or add the label")
        return rule.labels.index(row.target)
    if rule.kind == "number":
        value = extract_number(row.target)
        if value is None:
            raise TaskFileError(f"{path} line {row.line}: target {row.target[:40]!r} holds no number, but "
                                "suite.custom.type=number; fix the row or use type=exact")
        return value
    return normalize_exact(row.target)


def check_ids(path: Path, rows: Sequence[Row]) -> None:
    """No id twice within one file (the training and evaluation files may each number from ``r0``)."""
    seen: dict[str, int] = {}
    for row in rows:
        if row.id is None:
            continue
        if row.id in seen:
            raise TaskFileError(f"{path} line {row.line}: duplicate id {row.id!r} (first on line {seen[row.id]}); "
                                "give every row of the file its own id")
        seen[row.id] = row.line


def _same_prompt(prompt: str) -> str:
    return " ".join(prompt.split())


def leakage(train: tuple[Path, Sequence[Row]], evals: tuple[Path, Sequence[Row]]) -> str | None:
    """One warning line when evaluation rows repeat a training row's prompt (compared with runs of
    whitespace collapsed; ids play no part): how many, and the first such pair's lines. None when none."""
    (train_path, train_rows), (eval_path, eval_rows) = train, evals
    first_line: dict[str, int] = {}
    for row in train_rows:
        first_line.setdefault(_same_prompt(row.prompt), row.line)
    repeated = [row for row in eval_rows if _same_prompt(row.prompt) in first_line]
    if not repeated:
        return None
    row = repeated[0]
    return (f"warning: {len(repeated)} of {len(eval_rows)} evaluation rows repeat a training prompt (first: {eval_path} "
            f"line {row.line} = {train_path} line {first_line[_same_prompt(row.prompt)]}), so the score also measures "
            "memorisation; drop those rows from one of the files")


def example(row: Row, answer: int | float | str) -> Example:
    """The instruction-format example of a row: instruction = prompt, output = target, no input."""
    return Example(TASK, row.prompt, "", row.target, answer)


def check_lengths(path: Path, rows: Sequence[Row], cutoff_len: int, count_tokens: TokenCounter, backbone: str,
                  evaluation: bool = False) -> None:
    """Every row's prompt, target and EOS fit in ``suite.cutoff_len`` tokens, held out or not: else training
    would cut off its target, or an evaluation prompt would be longer than any trained sequence."""
    for row in rows:
        n = count_tokens(train_prompt(example(row, 0))) + 1  # + EOS
        if n > cutoff_len:
            why = ("an evaluation row must fit as a training row does" if evaluation
                   else "so the target would be cut off")
            raise TaskFileError(f"{path} line {row.line}: prompt and target are {n} tokens with backbone "
                                f"{backbone}'s tokenizer (EOS included), over suite.cutoff_len={cutoff_len}, {why}; "
                                f"shorten the row or raise suite.cutoff_len to {n}")


def answer_room(train: Sequence[Example], count_tokens: TokenCounter, max_new_tokens: int) -> str | None:
    """A warning when the longest training target (plus EOS) is longer than the generation cap: the
    evaluation would cut such answers off and score them wrong."""
    longest = max((count_tokens(ex.output) + 1 for ex in train), default=0)
    if longest <= max_new_tokens:
        return None
    return (f"training targets are up to {longest} tokens (EOS included) but suite.decoding.max_new_tokens="
            f"{max_new_tokens}: longer answers are cut off in evaluation; raise suite.decoding.max_new_tokens")


def machine_key() -> bytes:
    """This machine's secret key of :func:`file_id`: ``$PRISM_CACHE/custom-task.key``, created on first use with
    mode 0600 from the OS CSPRNG, atomically (written whole, then hard-linked into place, so concurrent first
    uses agree on one key), and read as it is afterwards. It never leaves the machine: no run records it."""
    path = cache_root() / MACHINE_KEY
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{MACHINE_KEY}.", dir=path.parent)  # mode 0600
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(secrets.token_bytes(KEY_BYTES))
                handle.flush()
                os.fsync(handle.fileno())
            with contextlib.suppress(FileExistsError):  # another process created it first: its key is the key
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise TaskFileError(f"{path}: {len(key)} bytes, not a {KEY_BYTES}-byte key of suite.custom's file "
                            "identifiers; delete it (a new key is made, and pinned identifiers must be set again)")
    return key


def file_id(path: Path) -> str:
    """The published identifier of a user's task file: HMAC-SHA256 of its bytes under :func:`machine_key`.
    It tells an edited file from the one a run was configured with, as the sha256 did, but no one without
    the key can test a guessed file (the user's rows with or without one candidate row) against it."""
    return hmac_sha256_file(path, machine_key())


def _verified(path: Path, expected: Any, key: str) -> str:
    identifier = file_id(path)
    if expected and str(expected) != identifier:
        if str(expected) == sha256_file(path):
            raise TaskFileError(f"{path}: suite.custom.{key}={expected} is the file's plain sha256, no longer its "
                                "identifier (a function of every row, docs/PRIVACY.md); set "
                                f"suite.custom.{key}={identifier} (its keyed identifier on this machine) or null")
        raise TaskFileError(f"{path}: identifier {identifier} differs from suite.custom.{key}={expected} (the file "
                            "changed since the run was configured, or it was configured with another machine's key, "
                            f"docs/custom-task.md); set suite.custom.{key}={identifier} or null")
    return identifier


def row_draw(row: Row, hold_out: str) -> float:
    """A row's uniform draw in [0, 1) for ``hold_out`` (a key of :data:`HOLD_OUTS`): the first 53 bits of
    HMAC-SHA256 under the hold-out's public key of the row's prompt (runs of whitespace collapsed, as
    :func:`leakage` compares prompts), over 2**53. It depends on this row alone, so no row's side changes when
    another is added or removed; rows repeating a prompt share it and land on one side."""
    mac = hmac.new(HOLD_OUTS[hold_out][1], _same_prompt(row.prompt).encode("utf-8"), hashlib.sha256).digest()
    return (int.from_bytes(mac[:8], "big") >> 11) / 2**53


def hold_out(path: Path, rows: Sequence[Row], node: CustomTaskConfig, name: str) -> tuple[list[Row], list[Row]]:
    """(kept, held) rows of ``name``'s hold-out: held when the row's :func:`row_draw` is below the fraction
    ``p`` of ``suite.custom`` (each prompt independently: for distinct prompts the held count is
    Binomial(len(rows), p), rows repeating a prompt go together); a
    :class:`TaskFileError` naming the fraction when it is not in (0, 1) or leaves either side empty."""
    key = HOLD_OUTS[name][0]
    fraction = getattr(node, key)
    if not 0 < fraction < 1:
        raise TaskFileError(f"suite.custom.{key}={fraction!r}: give the fraction in (0, 1) of the training rows to "
                            f"hold out for {name}, e.g. 0.2")
    draws = [row_draw(row, name) < fraction for row in rows]
    held = [row for row, below in zip(rows, draws) if below]
    kept = [row for row, below in zip(rows, draws) if not below]
    other = " or give suite.custom.eval=PATH" if name == "evaluation" else ""
    if not held:
        raise TaskFileError(f"{path}: no row fell in the hold-out of suite.custom.{key}={fraction:g} (each of "
                            f"the {len(rows)} rows is held out for {name} by its own draw, with that probability); "
                            f"add rows, raise suite.custom.{key}{other}")
    if not kept:
        raise TaskFileError(f"{path}: every row fell in the hold-out of suite.custom.{key}={fraction:g} "
                            f"({len(rows)} rows), none is left for training; add rows, lower suite.custom.{key}{other}")
    return kept, held


@dataclass
class CustomTask:
    """A checked task: training and evaluation examples, the scoring rule, and the file facts."""

    train: list[Example]
    eval: list[Example]
    rule: TaskRule
    source: dict[str, Any]
    warning: str | None = None  # :func:`leakage`


def load_task(node: CustomTaskConfig | Mapping[str, Any],
              validating: bool = False) -> tuple[CustomTask, list[tuple[Path, list[Row]]]]:
    """Read and check the files of ``suite.custom`` (a :class:`CustomTaskConfig`, or a mapping
    :func:`prism.typed.node_of` builds one of; all checks but lengths and batch size): the task (when
    ``validating``, validation rows held out of the training rows are its evaluation rows) and every row of
    each file, the training file's first."""
    node = node_of(CustomTaskConfig, node)
    if not node.train:
        raise TaskFileError("suite.custom.train is not set; give suite.custom.train=PATH (a .jsonl or .csv file)")
    rule = task_rule(node)
    train_path = Path(node.train).expanduser()
    train_rows = read_rows(train_path)
    source: dict[str, Any] = {"train": node.train, "train_sha256": _verified(train_path, node.train_sha256, "train_sha256")}
    check_ids(train_path, train_rows)
    files = [(train_path, train_rows)]
    if node.eval:
        eval_path = Path(node.eval).expanduser()
        eval_rows = read_rows(eval_path)
        check_ids(eval_path, eval_rows)
        files.append((eval_path, eval_rows))
        source.update(eval=node.eval, eval_sha256=_verified(eval_path, node.eval_sha256, "eval_sha256"))
    else:
        train_rows, eval_rows = hold_out(train_path, train_rows, node, "evaluation")
        source.update(eval=f"{len(eval_rows)} rows held out of {node.train} (each row by its own draw, "
                      f"eval_fraction={node.eval_fraction:g})")
    eval_path = files[-1][0]
    if validating:
        train_rows, eval_rows = hold_out(train_path, train_rows, node, "validation")
        eval_path = train_path
        source.update(split="validation", eval=f"{len(eval_rows)} validation rows held out of the training rows of "
                      f"{node.train} (each row by its own draw, validation_fraction="
                      f"{node.validation_fraction:g}; the evaluation rows are not scored)")
    train = [example(row, gold(rule, row, train_path)) for row in train_rows]
    evals = [example(row, gold(rule, row, eval_path)) for row in eval_rows]
    source.update(type=rule.kind, n_train=len(train), n_eval=len(evals))
    warning = leakage((train_path, train_rows), (eval_path, eval_rows))
    return CustomTask(train, evals, rule, source, warning), files


def validating(cfg_suite: SuiteConfig, selecting: bool = False) -> bool:
    """Whether a run of ``cfg_suite`` holds validation rows out of the training rows and scores them:
    under ``suite.eval_split=validation`` or in a private selection's candidate (``selecting``)."""
    return selecting or cfg_suite.eval_split == "validation"


def check_task(node: CustomTaskConfig | Mapping[str, Any], batch_size: int, cutoff_len: int,
               count_tokens: TokenCounter | None, backbone: str, validation: bool = False) -> CustomTask:
    """Every check of a custom task that needs no model: :func:`load_task`, the row lengths when the tokenizer
    is readable without a model (``count_tokens``), enough rows for ``train.batch_size``; a :func:`leakage`
    warning is logged once per process."""
    node = node_of(CustomTaskConfig, node)
    task, files = load_task(node, validation)
    train_path = files[0][0]
    if count_tokens is not None:
        for k, (path, rows) in enumerate(files):
            check_lengths(path, rows, cutoff_len, count_tokens, backbone, evaluation=k > 0)
    if len(task.train) < batch_size:
        held = f" after holding out {len(task.eval)} for validation" if validation else (
            "" if node.eval else f" after holding out {len(task.eval)} for evaluation")
        raise TaskFileError(f"{train_path}: {len(task.train)} training rows{held}, fewer than train.batch_size="
                            f"{batch_size}; add rows or lower train.batch_size to at most {len(task.train)}")
    if task.warning and task.warning not in _warned:
        _warned.add(task.warning)
        log.warning(task.warning)
    return task


def build(cfg_suite: SuiteConfig) -> tuple[list[Example], dict[str, list[Example]], dict[str, str], TaskRule,
                                          dict[str, Any]]:
    """``suite=custom`` for :func:`prism.data.build_suite`: (train, eval by task, task → column, rule, file facts)."""
    task, _ = load_task(cfg_suite.custom, validating(cfg_suite))
    return task.train, {TASK: task.eval}, {TASK: task.rule.columns[0]}, task.rule, task.source
