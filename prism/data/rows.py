"""What every suite source shares: the row type, the suite type, the Table 2 columns and the seeded row
draws (:mod:`prism.data` builds suites from them; docs/DECISIONS.md D29–D31, D39)."""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prism.backbones import cache_root

# Table 2 column names, in the paper's order.
PAPER_COLUMNS = ("CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI", "QNLI", "RTE", "GSM8K", "AQuA", "MAWPS", "SVAMP")
SUITE_FAMILIES = {"glue8": "glue", "math10k": "math", "custom": "glue"}  # custom: GLUE's template and rates
SCALES = ("embedded", "paper")


class DataUnavailableError(RuntimeError):
    """A dataset is neither cached nor reachable; the message names the fix."""


@dataclass(frozen=True)
class Example:
    """One instruction-format row: `output` is the training target text, `answer` the gold value
    used by evaluation (class index, STS-B score, number, or AQuA letter)."""

    task: str
    instruction: str
    input: str
    output: str
    answer: int | float | str


@dataclass
class Suite:
    """Training examples, evaluation examples per task, and the task → Table 2 column map."""

    name: str
    scale: str
    family: str
    train: list[Example]
    eval: dict[str, list[Example]]
    train_on_inputs: bool
    cutoff_len: int
    task_columns: dict[str, str]
    skipped: dict[str, int] = field(default_factory=dict)  # source → malformed rows dropped
    rules: dict[str, Any] = field(default_factory=dict)  # task → prism.evaluation.metrics.TaskRule (suite=custom)
    source: dict[str, Any] = field(default_factory=dict)  # suite=custom: files, digests, row counts


def well_formed(examples: list[Example | None], skipped: dict[str, int], source: str) -> list[Example]:
    """The rows that parsed (``None``: malformed), the malformed ones counted in ``skipped[source]``."""
    bad = sum(ex is None for ex in examples)
    if bad:
        skipped[source] = skipped.get(source, 0) + bad
    return [ex for ex in examples if ex is not None]


def cache_dir() -> Path:
    """Local data cache: ``$PRISM_CACHE/data`` (default ``~/.cache/prism/data``)."""
    return cache_root() / "data"


def sub_seed(seed: int, *parts: str) -> int:
    """A stable 31-bit seed derived from `seed` and names (independent streams per task/split)."""
    digest = hashlib.sha256(":".join([str(seed), *parts]).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def seeded_subset(rows: list, n: int | None, seed: int, *parts: str) -> list:
    """At most `n` rows, drawn without replacement with a derived seed, original order kept."""
    if n is None or n >= len(rows):
        return list(rows)
    keep = sorted(random.Random(sub_seed(seed, *parts)).sample(range(len(rows)), int(n)))
    return [rows[i] for i in keep]


def row_key(example: Example) -> tuple[str, str]:
    """What makes two rows the same question: instruction and input (the target is not compared)."""
    return example.instruction, example.input


def validation_split(candidates: list[Example], used: list[Example], n: int, balance: bool = False) -> list[Example]:
    """`n` validation rows drawn from the training pool: the first `candidates` (a draw of the pool in
    its own seeded order) whose question is in no row of `used` (the run's training rows and the fixed
    evaluation rows) and not repeated. ``balance``: as evenly as possible across labels (``answer``),
    in the candidates' order. Fewer than `n` when the pool runs out (the caller names the fix)."""
    taken = {row_key(ex) for ex in used}
    fresh = []
    for ex in candidates:
        if row_key(ex) not in taken:
            taken.add(row_key(ex))
            fresh.append(ex)
    if not balance:
        return fresh[:n]
    by_label: dict[Any, list[Example]] = {}
    for ex in fresh:
        by_label.setdefault(ex.answer, []).append(ex)
    labels = sorted(by_label, key=str)
    quota = {label: n // len(labels) + (k < n % len(labels)) for k, label in enumerate(labels)} if labels else {}
    keep = {id(ex) for label in labels for ex in by_label[label][: quota[label]]}
    return [ex for ex in fresh if id(ex) in keep]
