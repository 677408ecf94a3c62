"""`make wandb-sync` (pipelines/runs/wandb_sync.py) against a real offline W&B run, without network.

The pinned wandb's own `sync --dry-run` must accept the run folders we pass (the flags are the
ones its `--help` documents; `--sync-all` is gone); an upload without an API key or without a
reachable server is one `error:` line, exit code 2, before wandb would retry for minutes.
"""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pipelines.__main__ import main as cli
from pipelines.runs import wandb_sync


@pytest.fixture
def offline_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A real offline run written by wandb.init under ``tmp_path/wandb`` (as ``logging=offline`` does)."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for var, sub in (("HOME", "home"), ("NETRC", "home/.netrc"), ("WANDB_CONFIG_DIR", "home/wandb")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    (tmp_path / "wandb").mkdir()
    run = wandb.init(project="prism-dp-lora", id="table2-0123456789ab", dir=str(tmp_path / "wandb"), mode="offline",
                     settings=wandb.Settings(console="off", quiet=True, x_disable_stats=True))
    run.log({"loss": 0.5}, step=1)
    run.finish()
    wandb.teardown()
    return tmp_path / "wandb"


def test_dry_run_lists_the_offline_run_through_the_pinned_wandb(offline_run: Path, capfd) -> None:
    runs = wandb_sync.offline_runs(offline_run)
    assert [p.name.endswith("table2-0123456789ab") for p in runs] == [True]
    assert cli(["wandb-sync", f"folder={offline_run}", "--dry-run"]) == 0
    out = capfd.readouterr()
    assert "Would sync 1 run(s)" in out.out + out.err and "run-table2-0123456789ab.wandb" in out.out + out.err


def test_upload_without_key_or_server_is_one_line(offline_run: Path, monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    assert cli(["wandb-sync", f"folder={offline_run}"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: 1 offline run(s) not uploaded: no W&B API key")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    assert cli(["wandb-sync", f"folder={offline_run}"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "cannot reach the W&B server http://127.0.0.1:" in err


def test_synced_runs_and_missing_folders(offline_run: Path, tmp_path: Path, capfd) -> None:
    log = next(offline_run.rglob("run-*.wandb"))
    log.with_name(log.name + ".synced").touch()  # what `wandb sync` leaves after an upload
    assert cli(["wandb-sync", f"folder={offline_run}"]) == 0
    assert "no unsynced offline W&B runs" in capfd.readouterr().out
    assert cli(["wandb-sync", f"folder={tmp_path / 'nowhere'}"]) == 2
