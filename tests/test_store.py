"""The run-folder format of pipelines/store.py: atomic writes, metric replay, folder states."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines import store


def make_run(folder: Path, state: str = "finished", final: str | None = '{"avg": 0.5}') -> Path:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("seed: 42\n")
    store.write_status(folder, state, started="t0", attempts=1)
    if final is not None:
        (folder / "final.json").write_text(final)
    return folder


def test_atomic_write_keeps_old_content_on_failure(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    store.write_json_atomic(path, {"state": "running"})
    with pytest.raises(TypeError):
        store.write_json_atomic(path, {"state": object()})
    assert json.loads(path.read_text()) == {"state": "running"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]  # no temp file left


def test_metrics_replay_keeps_last_line_per_step_and_skips_cut_lines(tmp_path: Path) -> None:
    for step, loss in ((1, 3.0), (2, 2.0), (3, 1.0)):
        store.append_metrics(tmp_path, {"step": step, "loss": loss})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # killed mid-write
    store.seal_metrics(tmp_path)
    store.append_metrics(tmp_path, {"step": 3, "loss": 0.5})  # resumed from the step-2 checkpoint
    assert [(r["step"], r["loss"]) for r in store.read_metrics(tmp_path)] == [(1, 3.0), (2, 2.0), (3, 0.5)]


@pytest.mark.parametrize("state, final, expected, bad", [
    ("finished", '{"avg": 0.5}', "finished", ()),
    ("running", None, "incomplete", ()),
    ("failed", None, "incomplete", ()),
    ("finished", None, "corrupt", ("final.json",)),
    ("finished", '{"avg": 0.', "corrupt", ("final.json",)),
])
def test_inspect_run_states(tmp_path: Path, state: str, final: str | None, expected: str, bad: tuple) -> None:
    info = store.inspect_run(make_run(tmp_path / "run", state, final))
    assert (info.state, info.bad) == (expected, bad)


def test_inspect_detects_bad_status_and_config(tmp_path: Path) -> None:
    folder = make_run(tmp_path / "run")
    (folder / "status.json").write_text('{"state": "fini')
    (folder / "config.yaml").write_text("seed: [42\n")
    info = store.inspect_run(folder)
    assert info.state == "corrupt" and set(info.bad) == {"status.json", "config.yaml"}
    assert store.inspect_run(tmp_path / "absent").state == "absent"


def test_quarantine_and_move_aside_never_delete(tmp_path: Path) -> None:
    folder = make_run(tmp_path / "abc")
    moved = store.quarantine(folder, ("final.json",))
    assert moved[0].read_text() == '{"avg": 0.5}' and not (folder / "final.json").exists()
    first = store.move_aside(folder)
    second = store.move_aside(make_run(tmp_path / "abc"))
    assert first != second and first.name.startswith("abc.old-") and (first / "config.yaml").exists()
    assert (second / "config.yaml").exists() and not folder.exists()
