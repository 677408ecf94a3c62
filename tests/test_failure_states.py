"""States after a failure tell the truth and lose nothing.

Each test provokes one failure through the real runner with a stand-in trainer (no model):
garbage ``status.json`` beside a valid ``final.json``; a full disk (ENOSPC) with a half-written
checkpoint; an unreachable W&B server; Ctrl-C; a read-only store; the aggregator's out_dir a file
or read-only; SLURM installed but not configured. The expectation: ``status.json`` says failed
(never running), no traceback on the console, the earlier result kept byte for byte, and a
one-line error that names the fix.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import make_run

from pipelines.__main__ import main as cli
from pipelines.config.validate import load_job
from pipelines.runs import runner, store

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _keep_logging() -> Iterator[None]:
    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    logging.root.handlers[:], logging.root.level = handlers, level


def _job(tmp_path: Path) -> list[str]:
    return [f"results_dir={tmp_path / 'results'}", "logging=disabled"]


def _folder(tmp_path: Path) -> Path:
    return store.run_dir(load_job(_job(tmp_path)))


def _status(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "status.json").read_text())


def _finished(folder: Path, final: dict[str, Any], cfg: Any) -> None:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(__import__("omegaconf").OmegaConf.to_yaml(cfg))
    store.write_json_atomic(folder / "final.json", final)
    store.write_status(folder, "finished", started="t", attempts=1, ended="t")


def test_garbage_status_beside_a_valid_result_sets_the_result_aside(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _folder(tmp_path)
    _finished(folder, {"columns": {"SST-2": 0.625}}, load_job(_job(tmp_path)))
    earlier = (folder / "final.json").read_bytes()
    (folder / "status.json").write_text("{garbage")
    monkeypatch.setattr(runner, "default_trainer", lambda cfg, folder, log_fn: {"columns": {"SST-2": 0.5}})
    assert cli(["run", *_job(tmp_path)]) == 0
    kept = list(folder.glob("final.json.unconfirmed-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == earlier
    assert list(folder.glob("status.json.corrupt-*")) and _status(folder)["state"] == "finished"


def test_a_full_disk_frees_the_temporary_checkpoint_and_records_the_failure(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    def trainer(cfg: Any, folder: Path, log_fn: Any) -> dict[str, Any]:
        (folder / "checkpoint").mkdir(exist_ok=True)
        (folder / "checkpoint" / f".checkpoint.pt.tmp-{os.getpid()}").write_bytes(b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    real_write = store.write_json_atomic

    def full_disk(path: Path, obj: Any) -> None:  # no room while the half-written checkpoint holds it
        if list(Path(path).parent.rglob(".*tmp-*")):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, obj)

    monkeypatch.setattr(runner, "default_trainer", trainer)
    monkeypatch.setattr(store, "write_json_atomic", full_disk)
    assert cli(["run", *_job(tmp_path)]) == 2
    err = capsys.readouterr().err
    folder = _folder(tmp_path)
    assert err.count("\n") == 1 and "no space left" in err and str(folder) in err and "Traceback" not in err
    assert _status(folder)["state"] == "failed" and "no space left" in _status(folder)["error"]
    assert not list(folder.rglob(".*tmp*")) and (folder / "traceback.txt").exists()


def test_an_unreachable_wandb_server_leaves_a_failed_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("wandb: Network error (ConnectionError), api.wandb.ai unreachable")

    monkeypatch.setattr(runner, "WandbRun", unreachable)
    monkeypatch.setattr(runner, "default_trainer", lambda *a: pytest.fail("trained without W&B"))
    assert cli(["run", *_job(tmp_path)]) == 1
    status = _status(_folder(tmp_path))
    assert status["state"] == "failed" and "unreachable" in status["error"]
    assert "Traceback" not in capsys.readouterr().err


def test_ctrl_c_marks_the_run_interrupted_without_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    def trainer(cfg: Any, folder: Path, log_fn: Any) -> dict[str, Any]:
        (folder / ".final.json.x.tmp").write_text("{")
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "default_trainer", trainer)
    assert cli(["run", *_job(tmp_path)]) == 130
    err = capsys.readouterr().err
    folder = _folder(tmp_path)
    assert err.count("\n") == 1 and "interrupted" in err and "Traceback" not in err
    assert _status(folder)["state"] == "stopped" and "interrupted" in _status(folder)["error"]
    assert not list(folder.glob(".*tmp*"))


@pytest.mark.parametrize("first", ["interrupt", "failure"])
def test_a_second_signal_while_the_stop_is_recorded_still_leaves_the_run_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str) -> None:
    """A second Ctrl-C, or submitit's local controller forwarding the SIGINT its job already got, lands
    while the run writes its status: the status is still written. After a failure the held signal
    is the user's stop and ends the run as one; after an interrupt it is the same stop and is dropped."""
    def trainer(cfg: Any, folder: Path, log_fn: Any) -> dict[str, Any]:
        raise KeyboardInterrupt if first == "interrupt" else RuntimeError("boom")

    write_status = store.write_status

    def signalled_write(folder: Path, state: str, **kwargs: Any) -> None:
        if state != "running":
            os.kill(os.getpid(), signal.SIGINT)  # delivered here, before the write, unless held
        write_status(folder, state, **kwargs)

    monkeypatch.setattr(runner, "default_trainer", trainer)
    monkeypatch.setattr(store, "write_status", signalled_write)
    assert cli(["run", *_job(tmp_path)]) == 130
    status = _status(_folder(tmp_path))
    assert status["state"] == ("stopped" if first == "interrupt" else "failed")
    assert ("interrupted" if first == "interrupt" else "boom") in status["error"]


def test_a_read_only_store_still_reports_a_finished_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """(Run as root here, so the read-only store is simulated at the lock, where it first bites.)"""
    cfg = load_job(_job(tmp_path))
    folder = store.run_dir(cfg)
    _finished(folder, {"columns": {"SST-2": 0.625}}, cfg)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def read_only(self: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(runner.FileLock, "acquire", read_only)
    monkeypatch.setattr(runner, "default_trainer", lambda *a: pytest.fail("retrained"))
    assert cli(["run", *_job(tmp_path)]) == 0
    assert "already finished, skipped" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before

    assert cli(["run", *_job(tmp_path), "seed=7"]) == 2  # not finished: one line, no traceback.txt promised
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "results_dir=" in err and "writable" in err and "traceback" not in err


@pytest.mark.parametrize("kind", ["file", "read-only"])
def test_the_aggregator_with_an_unwritable_out_dir_is_one_line(kind: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    make_run(runs, "a1", method="prism", privacy="eps6", suite="glue8", columns={"SST-2": 0.8}, experiment="table2")
    out = tmp_path / "tables"
    if kind == "file":
        out.write_text("not a folder")
    else:
        def read_only(*args: Any, **kwargs: Any) -> None:
            raise PermissionError(errno.EACCES, "Permission denied", str(out))

        monkeypatch.setattr(Path, "mkdir", read_only)
    assert cli(["aggregate", "experiment=table2", f"runs_dir={runs}", f"out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write the tables") and err.count("\n") == 1 and "out_dir=" in err


UNCONFIGURED = "sbatch: error: Could not establish a configuration source"


def _fake_slurm(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("sbatch", "squeue"):
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\necho '{UNCONFIGURED.replace('sbatch', name)}' >&2\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PRISM_PYTHON": sys.executable,
            "PRISM_SLURM_DIR": str(tmp_path / "slurm")}


def test_slurm_installed_but_not_configured_says_how_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    env = _fake_slurm(tmp_path)
    done = subprocess.run([str(REPO / "slurm" / "submit.sh"), "table5", "method=prism", "logging=disabled",
                           f"results_dir={tmp_path / 'r'}"], env=env, capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert done.returncode == 1 and "configuration source" in done.stderr and "SLURM_CONF=" in done.stderr
    assert done.stderr.count("\n") == 1 and not list((tmp_path / "slurm").glob("*"))  # no submission folder left
    monkeypatch.setenv("PATH", env["PATH"])
    assert cli(["reproduce", "experiment=table5", "method=prism", "logging=disabled", "launcher=slurm",
                           f"results_dir={tmp_path / 'r2'}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: launcher=slurm: squeue failed") and "SLURM_CONF=" in err
