"""The offline W&B runs of a results folder not yet uploaded, and the ``wandb`` executable that uploads
them (``python -m pipelines wandb-sync``, :mod:`pipelines.verbs.wandb_sync`)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path


def offline_runs(directory: Path) -> list[Path]:
    """Offline run folders under ``directory`` holding a ``.wandb`` log not yet marked synced."""
    return [folder for folder in sorted(Path(directory).rglob("offline-run-*")) if folder.is_dir()
            and any(not log.with_name(log.name + ".synced").exists() for log in folder.glob("run-*.wandb"))]


def wandb_cli() -> str:
    """The ``wandb`` executable beside this interpreter (the pinned one), else the one on PATH."""
    beside = Path(sys.executable).parent / "wandb"
    return str(beside) if beside.exists() else (shutil.which("wandb") or "wandb")


