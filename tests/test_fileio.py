"""prism.fileio.atomic_write: group-readable files, all or nothing."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from prism.fileio import atomic_write, write_text_atomic


def test_files_are_0644_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)  # a private umask must not make results unreadable to the group
    try:
        path = write_text_atomic(tmp_path / "sub" / "final.json", "{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and path.read_text() == "{}\n"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = write_text_atomic(tmp_path / "status.json", "old")

    def half_then_crash(tmp: Path) -> None:
        tmp.write_text("ne")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_crash)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]
