"""The repository stands alone: no tracked file cites a design document it does not ship
(comments cite the paper's equations, a docs/DECISIONS.md row or a docs/ARCHITECTURE.md section)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Written independently of the script's own pattern; split so this file does not match itself.
OUTSIDE = re.compile("|".join([
    "SPEC" + " §", "report" + " §", "[Rr]eference" + " doc", "reference" + " §",
    "paper-and-reference" + "-code", "/work" + "/",
]))


def test_no_tracked_file_cites_an_outside_document() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    hits = []
    for rel in files.splitlines():
        try:
            text = (REPO / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        hits += [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    if hits:
        pytest.fail(f"{len(hits)} line(s) cite documents outside the repository; cite a docs/DECISIONS.md "
                    "row or docs/ARCHITECTURE.md instead:\n" + "\n".join(hits[:20]))
