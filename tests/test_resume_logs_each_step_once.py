"""A resumed run continues from its checkpoint and its ``metrics.jsonl`` holds each step once.

Real tiny runs (random 2-layer Llama, 6 steps, a checkpoint every 2): one interrupted by Ctrl-C after
step 3 is logged, one whose second checkpoint hits a full disk. The expectation is independent of the
store's code: the file's steps are exactly 1..6, and the resumed run's numbers equal an uninterrupted
run's (seeded noise: a resume is bitwise the same run).
"""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from pipelines.runs import runner
from pipelines.verbs import run as R

STEPS = 6


def _args(tmp_path: Path, results: Path) -> list[str]:
    task = tmp_path / "task.jsonl"
    if not task.exists():
        task.write_text("".join(json.dumps({"prompt": f"Is {i} even?", "target": "yes" if i % 2 == 0 else "no"}) + "\n"
                                for i in range(40)))
    return ["suite=custom", f"suite.custom.train={task}", "suite.custom.labels=[yes,no]", "backbone=tiny-llama",
            "scale=smoke", "method=adamw", "privacy=eps6", f"train.steps={STEPS}", "train.checkpoint_every=2",
            f"results_dir={results}", "logging=disabled"]


def _steps(results: Path) -> tuple[Path, list[dict]]:
    (folder,) = [p for p in (results / "runs").iterdir() if p.is_dir() and not p.name.startswith("_")]
    return folder, [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _numbers(records: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["update_norm"]) for r in records]


@pytest.fixture
def uninterrupted(tmp_path: Path) -> list[tuple]:
    assert R.command(_args(tmp_path, tmp_path / "whole")) == 0
    return _numbers(_steps(tmp_path / "whole")[1])


def test_a_run_interrupted_after_a_logged_step_resumes_with_each_step_logged_once(
        tmp_path: Path, uninterrupted: list[tuple], capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(cfg, folder, log_fn):
        def log_then_stop(record):
            log_fn(record)
            if record["step"] == 3:  # logged, but the last checkpoint is step 2's
                raise KeyboardInterrupt
        return runner.default_trainer(cfg, folder, log_then_stop)

    results = tmp_path / "results"
    assert R.command(_args(tmp_path, results), trainer=interrupted) == 130
    folder, records = _steps(results)
    assert json.loads((folder / "status.json").read_text())["state"] == "stopped"
    assert [r["step"] for r in records] == [1, 2, 3]
    capsys.readouterr()
    assert R.command(_args(tmp_path, results)) == 0
    out = capsys.readouterr().out
    folder, records = _steps(results)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert "resuming from the checkpoint of step 2" in out
    assert _numbers(records) == uninterrupted


def test_a_full_disk_fails_in_one_line_naming_the_folder_and_the_rerun_continues(
        tmp_path: Path, uninterrupted: list[tuple], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import prism.checkpoint as C

    real = C.write_bytes_atomic
    writes = []

    def full_on_second(path, data):
        writes.append(path)
        if len(writes) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)

    monkeypatch.setattr(C, "write_bytes_atomic", full_on_second)
    results = tmp_path / "results"
    assert R.command(_args(tmp_path, results)) == 2
    err = capsys.readouterr().err
    folder, records = _steps(results)
    assert len(err.strip().splitlines()) == 1 and "no space left" in err and str(folder) in err
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "failed" and "no space left" in status["error"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # step 4's checkpoint failed after its line
    monkeypatch.setattr(C, "write_bytes_atomic", real)
    assert R.command(_args(tmp_path, results)) == 0
    folder, records = _steps(results)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert _numbers(records) == uninterrupted
