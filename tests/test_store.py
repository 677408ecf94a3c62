"""The run-folder format of pipelines/runs/store.py: atomic writes, metric replay, folder states."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from pipelines.__main__ import main as cli
from pipelines.config import identity
from pipelines.runs import store
from tests.oracles import read_metrics


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
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 3.0), (2, 2.0), (3, 0.5)]


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


def test_files_are_group_readable(tmp_path: Path) -> None:
    """config.yaml / final.json / status.json are written 0666 & ~umask (0644 here), not mkstemp's 0600."""
    old = os.umask(0o022)
    try:
        store.write_text_atomic(tmp_path / "config.yaml", "seed: 1\n")
        store.write_json_atomic(tmp_path / "final.json", {"avg": 0.5})
        store.write_status(tmp_path, "running", started="t0", attempts=1)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"config.yaml": 0o644, "final.json": 0o644, "status.json": 0o644}


def test_hash_covers_every_field_but_the_non_result_ones() -> None:
    """Blacklist, not whitelist: a group added later (e.g. ``protocol``) changes the hash;
    experiment, force, results_dir, logging and launcher settings do not."""
    base = {k: {"x": 1} for k in identity.REQUIRED_KEYS}
    h = store.run_hash(base)
    assert store.run_hash({**base, "protocol": {"name": "released"}}) != h
    assert store.run_hash({**base, "protocol": {"name": "released"}}) != store.run_hash(
        {**base, "protocol": {"name": "corrected"}})
    same = {**base, "experiment": "table4", "force": True, "results_dir": "/x", "logging": {"mode": "online"},
            "hydra": {"launcher": "slurm"}, "launcher": "slurm"}
    assert store.run_hash(same) == h
    assert store.run_hash({**base, "seed": {"x": 2}}) != h


def test_run_state_tells_running_from_stale_by_the_lock(tmp_path: Path) -> None:
    folder = make_run(tmp_path / "abc", state="running", final=None)
    assert store.run_state(folder) == "stale"  # no lock file at all: killed before or after locking
    lock = FileLock(store.lock_path(folder))
    with lock:
        assert store.lock_held(folder) and store.run_state(folder) == "running"
    assert not store.lock_held(folder) and store.run_state(folder) == "stale"  # lock file left, no holder
    # a holder in another process that gets killed: its flock dies with it
    code = f"from filelock import FileLock; lock = FileLock({str(store.lock_path(folder))!r}); lock.acquire(); print('held', flush=True); input()"
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert store.run_state(folder) == "running"
    finally:
        holder.kill()
        holder.wait()
    assert store.run_state(folder) == "stale"
    store.write_status(folder, "failed", started="t0", attempts=1, error="boom")
    assert store.run_state(folder) == "failed"
    assert store.run_state(tmp_path / "none") == "absent"


def test_views_tag_runs_and_refuse_the_older_layout(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    new = make_run(root / "aaaaaaaaaaaa")
    store.tag(root, "table2", new.name)
    store.tag(root, "table2", new.name)  # idempotent
    make_run(root / "aaaaaaaaaaaa.old-2026")  # a forced rerun's predecessor: not in the view
    assert store.view(root, "table2") == ["aaaaaaaaaaaa"] and store.view(root, "table4") == []
    assert store.find_run(root, "aaaaaaaaaaaa") == new
    make_run(root / "table4" / "bbbbbbbbbbbb")  # the older runs/<experiment>/<hash>/ layout
    with pytest.raises(store.ConfigError) as refused:
        store.view(root, "table2")
    assert str(refused.value) == (f"{root} holds runs in the older layout; run python -m pipelines migrate "
                                  f"results_dir={tmp_path} once")


def test_commands_refuse_the_older_layout_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "runs"
    make_run(root / "table2" / "bbbbbbbbbbbb")
    line = f"error: {root} holds runs in the older layout; run python -m pipelines migrate results_dir={tmp_path} once\n"
    job = [f"results_dir={tmp_path}", "logging=disabled", "backbone=tiny-llama", "suite.cutoff_len=1024"]
    for argv in (["aggregate", "experiment=table2", f"runs_dir={root}", f"out_dir={tmp_path / 'tables'}"],
                 ["run", *job], ["run", "-m", *job, "seed=1,2"],
                 ["reproduce", "experiment=table2", *job, "method=adamw", "privacy=eps6", "suite=glue8"]):
        assert cli(argv) == 2, argv
        assert capsys.readouterr().err == line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"] and sorted(p.name for p in root.iterdir()) == [
        "table2"]  # no lock, view, log or table
    assert cli(["migrate", f"results_dir={tmp_path}"]) == 0
    store.refuse_older_layout(root)  # migrated: read again
    assert store.view(root, "table2") == ["bbbbbbbbbbbb"]


def test_migrate_moves_the_finished_copy_and_tags_every_view(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    unfinished = make_run(root / "table2" / "bbbbbbbbbbbb", state="failed", final=None)
    finished = make_run(root / "table4" / "bbbbbbbbbbbb")
    folder = root / "bbbbbbbbbbbb"
    assert store.migrate(tmp_path) == [(finished, folder)]  # the finished copy wins
    assert store.inspect_run(folder).state == "finished" and unfinished.exists() and not finished.exists()
    for experiment in ("table2", "table4"):
        assert store.view(root, experiment) == ["bbbbbbbbbbbb"]
    assert store.migrate(tmp_path) == []


def test_migrate_cli_moves_every_old_layout_run(tmp_path: Path) -> None:
    for experiment, run_hash in (("table2", "aaaaaaaaaaaa"), ("table2", "bbbbbbbbbbbb"), ("table4", "aaaaaaaaaaaa")):
        make_run(tmp_path / "runs" / experiment / run_hash)
    assert cli(["migrate", f"results_dir={tmp_path}"]) == 0
    root = tmp_path / "runs"
    assert sorted(p.name for p in root.iterdir() if p.is_dir() and store.HASH_RE.fullmatch(p.name)) == [
        "aaaaaaaaaaaa", "bbbbbbbbbbbb"]
    assert store.view(root, "table4") == ["aaaaaaaaaaaa"]  # its own copy stays readable, and tagged
    assert store.view(root, "table2") == ["aaaaaaaaaaaa", "bbbbbbbbbbbb"]
    assert cli(["migrate", f"results_dir={tmp_path / 'nowhere'}"]) == 2


def test_migrate_prefers_an_old_finished_copy_to_a_failed_store_copy(tmp_path: Path) -> None:
    """The store holds a failed copy of the run, the older layout a finished one: the finished record is
    what the store then holds (the failed one kept aside), so the table reads it and the grid skips it."""
    root = tmp_path / "runs"
    failed = make_run(root / "bbbbbbbbbbbb", state="failed", final=None)
    old = make_run(root / "table2" / "bbbbbbbbbbbb")
    assert cli(["migrate", f"results_dir={tmp_path}"]) == 0
    assert store.inspect_run(failed).state == "finished" and not old.exists()
    (aside,) = [p for p in root.iterdir() if p.name.startswith("bbbbbbbbbbbb.unfinished-")]
    assert store.read_json(aside / "status.json")["state"] == "failed"  # kept, never deleted
    assert store.view(root, "table2") == ["bbbbbbbbbbbb"] and store.run_state(root / "bbbbbbbbbbbb") == "finished"


def test_a_view_that_is_a_file_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "runs"
    store.tag(root, "table2", make_run(root / "aaaaaaaaaaaa").name)
    view = root / "_views" / "table2"
    for path in sorted(view.iterdir()):
        path.unlink()
    view.rmdir()
    view.write_text("")
    assert cli(["aggregate", "experiment=table2", f"runs_dir={root}", f"out_dir={tmp_path / 'tables'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {view} is a file") and "Traceback" not in err
    assert not (tmp_path / "tables").exists()


def test_a_results_folder_given_as_the_run_store_is_named_with_the_path_that_works(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "runs"
    store.tag(root, "table2", make_run(root / "aaaaaaaaaaaa").name)
    tables = tmp_path / "tables"
    assert cli(["aggregate", "experiment=table2", f"runs_dir={tmp_path}", f"out_dir={tables}"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path} is the results folder, not its run store: pass {root} (runs_dir={root})\n"
    assert cli(["aggregate", "experiment=table2", f"runs_dir={root}", f"out_dir={tables}"]) == 0  # the fix works
