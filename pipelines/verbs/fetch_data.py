"""`make data`: materialise the paper-scale datasets into the local cache and hash them.

Writes ``<cache>/glue/<task>/<split>.jsonl`` (from the HF hub's GLUE), ``<cache>/url/...`` copies of
``math_10k.json`` and the four LLM-Adapters test sets, and ``<cache>/manifest.json`` (sha256 and row
count per file), and downloads the paper backbones (Gemma checkpoints, gated: accept their licence
and ``huggingface-cli login`` first) into the Hugging Face cache. ``<cache>`` is ``$PRISM_CACHE/data`` (default ``~/.cache/prism/data``). Files already
cached are kept (use ``--force`` to refetch). Offline, it exits with one line naming what is missing.

    python -m pipelines fetch-data [only=glue|math|models] [llm_adapters=URL] [math_train=URL] [--force]
"""
from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from prism.backbones import BACKBONES
from prism.data import cache_dir
from prism.data.glue import GLUE_HUB_ID, GLUE_TASKS, VALIDATION_ROWS
from prism.data.math10k import (
    LLM_ADAPTERS_URL,
    MATH10K_ROWS,
    MATH10K_SHA256,
    MATH10K_URL,
    MATH_TESTS,
    cached_path,
    sha256_matches,
    testset_location,
)
from prism.fileio import sha256_file, write_bytes_atomic


def fetch_glue(task: str, split: str, force: bool) -> Path:
    """One GLUE split as JSON lines (input columns + label)."""
    path = cache_dir() / "glue" / task / f"{split}.jsonl"
    if path.is_file() and not force:
        return path
    import datasets

    rows = datasets.load_dataset(GLUE_HUB_ID, task, split=split)
    keep = [col for _, col in GLUE_TASKS[task].fields] + ["label"]
    lines = "".join(json.dumps({k: row[k] for k in keep}) + "\n" for row in rows)
    write_bytes_atomic(path, lines.encode("utf-8"))
    return path


def reachable(host: str, timeout: float = 5.0) -> bool:
    """Whether `host` answers on port 443 (a quick probe, so offline runs fail fast, not after retries)."""
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def fetch_url(url: str, force: bool) -> Path:
    path = cached_path(url)
    if not path.is_file() or force:
        host = urlparse(url).netloc
        if not reachable(host):
            raise ConnectionError(f"{host} unreachable")
        with urllib.request.urlopen(url, timeout=120) as response:
            write_bytes_atomic(path, response.read())
    return path


def fetch_model(repo_id: str, force: bool) -> Path:
    """A paper backbone's checkpoint into the HF cache (where ``from_pretrained`` finds it offline)."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, force_download=force, allow_patterns=["*.json", "*.safetensors",
                                                                            "*.model", "*.txt"]))


def _rows(path: Path) -> int:
    if path.suffix == ".jsonl":
        return sum(1 for line in path.open(encoding="utf-8") if line.strip())
    return len(json.loads(path.read_text(encoding="utf-8")))


def jobs(only: str | None, llm_adapters: str, math_train: str) -> list[tuple[str, Callable[[bool], Path], int | None, str | None]]:
    """(name, fetch(force) → path, expected rows, expected sha256) for everything to materialise."""
    out = []
    if only in (None, "glue"):
        for task, spec in GLUE_TASKS.items():
            for split in ["train", *(s for _, s in spec.eval_splits)]:
                out.append((f"GLUE {task}/{split}", lambda f, t=task, s=split: fetch_glue(t, s, f),
                            VALIDATION_ROWS.get((task, split)), None))
    if only in (None, "models"):
        for spec in (b for b in BACKBONES.values() if b.kind == "hub"):
            out.append((f"model {spec.source}", lambda f, repo=spec.source: fetch_model(repo, f), None, None))
    if only in (None, "math"):
        rows, sha = (MATH10K_ROWS, MATH10K_SHA256) if math_train == MATH10K_URL else (None, None)
        out.append(("math_10k.json", lambda f: fetch_url(math_train, f), rows, sha))
        for folder, _, expected in MATH_TESTS.values():
            url = testset_location(llm_adapters, folder)
            out.append((f"LLM-Adapters {folder}/test.json", lambda f, u=url: fetch_url(u, f), expected, None))
    return out


def main(*, only: str | None = None, llm_adapters: str = LLM_ADAPTERS_URL, math_train: str = MATH10K_URL,
         force: bool = False) -> int:
    """Fetch ``only`` one part (glue, math, models; default all; ``llm_adapters``: the raw-file base URL
    of LLM-Adapters, ``math_train``: the URL of math_10k.json), refetching cached files with ``--force``;
    exit 1 when a file is missing or unexpected."""
    if only not in (None, "glue", "math", "models"):
        raise ValueError(f"only={only} is not a part, use only= one of glue, math, models")
    # This command exists to download: lift the offline switches the Makefile exports for everything
    # else, unless the hub is unreachable (then `datasets` may still answer from a warm HF cache).
    hub_online = reachable("huggingface.co")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[var] = "0" if hub_online else "1"
    manifest_path = cache_dir() / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    missing, bad = [], []
    for name, fetch, rows_expected, sha_expected in jobs(only, llm_adapters, math_train):
        try:
            path = fetch(force)
        except Exception as err:  # network, hub or HTTP errors: report the file, keep going
            missing.append(f"{name} ({type(err).__name__})")
            continue
        if path.is_dir():  # a model snapshot: the HF cache verifies its own files by hash
            print(f"ok  {name}: {path}")
            continue
        digest, rows = sha256_file(path), _rows(path)
        if rows_expected is not None and rows != rows_expected:
            bad.append(f"{name}: {rows} rows, expected {rows_expected}")
        if sha_expected and not sha256_matches(digest, sha_expected):
            bad.append(f"{name}: sha256 {digest[:8]}...{digest[-6:]} differs from {sha_expected}")
        manifest[str(path.relative_to(cache_dir()))] = {"sha256": digest, "rows": rows, "source": name}
        print(f"ok  {name}: {rows} rows, sha256 {digest[:12]}  {path}")
    write_bytes_atomic(manifest_path, json.dumps(manifest, indent=2, sort_keys=True).encode())
    if missing:
        print(f"make data: could not fetch {', '.join(missing)}; connect to the network (or warm the HF cache) "
              "and re-run `make data`, or train with scale=embedded", file=sys.stderr)
        return 1
    if bad:
        print(f"make data: unexpected content: {'; '.join(bad)}", file=sys.stderr)
        return 1
    print(f"manifest: {manifest_path}")
    return 0

