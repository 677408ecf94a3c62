"""Math-10K at paper scale (docs/DECISIONS.md D31): the LLM-Adapters training mixture and four test sets.

Node ``suite.paper`` fields: ``train_file`` (local path or URL of ``math_10k.json``; a URL is read from the
`make data` cache), ``train_rows`` (expected row count, 9,919) and ``train_sha256`` (full hex digest or the
report's abbreviated ``prefix...suffix`` form; both checked when given), ``llm_adapters`` (a local
LLM-Adapters checkout or raw-file base URL holding ``dataset/{gsm8k,AQuA,mawps,SVAMP}/test.json``),
``tests`` (which test sets, default all four).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prism.data.config import PaperDataConfig
from prism.data.rows import DataUnavailableError, Example, cache_dir, well_formed
from prism.fileio import sha256_file

MATH10K_URL = "https://raw.githubusercontent.com/AGI-Edgerunners/LLM-Adapters/main/ft-training_set/math_10k.json"
LLM_ADAPTERS_URL = "https://raw.githubusercontent.com/AGI-Edgerunners/LLM-Adapters/main"
MATH10K_ROWS = 9919
MATH10K_SHA256 = "0342d0d8...0418b8"  # only this abbreviation is published; full digest unknown

# test set → (folder in LLM-Adapters/dataset, Table 2 column, expected rows)
MATH_TESTS = {
    "gsm8k": ("gsm8k", "GSM8K", 1319),
    "aqua": ("AQuA", "AQuA", 254),
    "mawps": ("mawps", "MAWPS", 238),
    "svamp": ("SVAMP", "SVAMP", 1000),
}
_NUMBER = re.compile(r"-?\d+\.?\d*")


def is_url(spec: str) -> bool:
    return urlparse(str(spec)).scheme in ("http", "https")


def cached_path(url: str) -> Path:
    """Where `make data` stores a downloaded URL: ``<cache>/url/<host>/<path>``."""
    parsed = urlparse(url)
    return cache_dir() / "url" / parsed.netloc / parsed.path.lstrip("/")


def resolve(spec: str, what: str) -> Path:
    """A local file for `spec` (a path, or a URL already fetched by `make data`)."""
    path = cached_path(spec) if is_url(spec) else Path(spec).expanduser()
    if not path.is_file():
        raise DataUnavailableError(
            f"{what} not found at {path}: run `make data` (needs network) or use scale=embedded"
        )
    return path


def sha256_matches(actual: str, expected: str) -> bool:
    """Compare a digest with a full or abbreviated (``prefix...suffix``) expected value."""
    if "..." in expected:
        head, tail = expected.split("...", 1)
        return actual.startswith(head) and actual.endswith(tail)
    return actual == expected


def read_json_rows(path: Path, what: str) -> list:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataUnavailableError(f"{what} at {path} is not readable JSON ({err}): re-run `make data`") from err
    if not isinstance(rows, list):
        raise DataUnavailableError(f"{what} at {path} is not a JSON list of rows: re-run `make data`")
    return rows


def parse_gold_number(answer: Any) -> float | None:
    """A numeric gold answer ("576.0", "1,234", 12) as float; None when it is not one number."""
    text = str(answer).replace(",", "").strip()
    return float(text) if _NUMBER.fullmatch(text) else None


def math_example(task: str, row: Any, kind: str) -> Example | None:
    """Example from an LLM-Adapters row; `kind` is ``train``, ``number`` or ``choice``; None if malformed."""
    if not isinstance(row, dict) or not isinstance(row.get("instruction"), str) or not row["instruction"].strip():
        return None
    inp = row.get("input") or ""
    output = row.get("output") or ""
    if not isinstance(inp, str) or not isinstance(output, str):
        return None
    if kind == "train":
        return Example(task, row["instruction"], inp, output, str(row.get("answer", ""))) if output else None
    if kind == "choice":
        letter = str(row.get("answer", "")).strip().upper()
        return Example(task, row["instruction"], inp, output, letter) if letter in tuple("ABCDE") else None
    gold = parse_gold_number(row.get("answer"))
    return None if gold is None else Example(task, row["instruction"], inp, output, gold)


def testset_location(root: str, folder: str) -> str:
    """Path or URL of one LLM-Adapters test set under a checkout root or base URL."""
    return f"{root.rstrip('/')}/dataset/{folder}/test.json" if is_url(root) else str(Path(root) / "dataset" / folder / "test.json")


def build_paper(node: PaperDataConfig, seed: int):
    """Paper-scale Math-10K: (train, eval per test set, task → column, skipped rows)."""
    del seed  # the mixture and test sets are used whole, in file order
    tests = list(node.tests or MATH_TESTS)
    unknown = [t for t in tests if t not in MATH_TESTS]
    if unknown:
        raise ValueError(f"unknown Math-10K test set(s) {unknown}; valid: {', '.join(MATH_TESTS)}")
    train_spec = node.train_file or MATH10K_URL
    train_path = resolve(train_spec, "Math-10K training file math_10k.json")
    raw = read_json_rows(train_path, "math_10k.json")
    rows_expected = node.train_rows
    if rows_expected is not None and len(raw) != rows_expected:
        raise DataUnavailableError(
            f"{train_path} has {len(raw)} rows, expected {rows_expected}: fetch the original math_10k.json "
            "(`make data`) or set suite.paper.train_rows=null"
        )
    sha_expected = node.train_sha256
    if sha_expected and not sha256_matches(sha256_file(train_path), sha_expected):
        raise DataUnavailableError(
            f"{train_path} sha256 does not match {sha_expected}: re-fetch it (`make data`) or set "
            "suite.paper.train_sha256=null"
        )
    skipped: dict[str, int] = {}
    train = well_formed([math_example("math10k", row, "train") for row in raw], skipped, "math10k/train")
    root = node.llm_adapters or LLM_ADAPTERS_URL
    evals: dict[str, list[Example]] = {}
    columns: dict[str, str] = {}
    for task in tests:
        folder, column, _ = MATH_TESTS[task]
        path = resolve(testset_location(root, folder), f"LLM-Adapters {folder} test set")
        kind = "choice" if column == "AQuA" else "number"
        rows = read_json_rows(path, f"{folder}/test.json")
        evals[task] = well_formed([math_example(task, row, kind) for row in rows], skipped, f"math/{task}")
        columns[task] = column
    return train, evals, columns, skipped
