"""Small file helpers shared by the caches, checkpoints and run folders.

Every file the project writes goes through :func:`atomic_write` (a temporary file beside the target,
fsynced, mode 0644 for a group on a shared cluster, renamed over the target): a reader sees the old file
or the new one, never half of one, even after a kill or power loss.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

FILE_MODE = 0o644


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 16 MiB blocks."""
    return _digest_file(path, hashlib.sha256())


def hmac_sha256_file(path: Path, key: bytes) -> str:
    """Hex HMAC-SHA256 of a file under ``key`` (RFC 2104), read in 16 MiB blocks."""
    return _digest_file(path, hmac.new(key, digestmod=hashlib.sha256))


def _digest_file(path: Path, digest: Any) -> str:
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def atomic_write(path: Path, write: Callable[[Path], None]) -> Path:
    """Create ``path`` atomically: ``write(tmp)`` fills a temporary file beside it, which is fsynced,
    made mode 0644 and renamed onto ``path``; the folder entry is fsynced too. On any error the
    temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # persist the rename (POSIX); folders cannot be opened on Windows
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return path


def write_bytes_atomic(path: Path, data: bytes) -> Path:
    """:func:`atomic_write` of ``data``."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def write_text_atomic(path: Path, text: str) -> Path:
    """:func:`atomic_write` of ``text`` in UTF-8."""
    return write_bytes_atomic(path, text.encode("utf-8"))
