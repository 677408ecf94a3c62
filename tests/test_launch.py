"""Launch paths without a cluster: fake `sbatch`/`squeue` on PATH stand for a dead SLURM controller.

A failed submission must say "0 of N submitted: <reason>", exit non-zero, print no traceback,
leave no submission folder behind and touch no table; `submit.sh --dry-run` writes nothing;
`status.sh` reads the latest submission sbatch accepted; the local path counts failed *runs*.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_JOB

from pipelines.__main__ import function, parse
from pipelines.__main__ import main as cli
from pipelines.runs import launch, store

REPO = Path(__file__).resolve().parents[1]
DEAD = "Unable to contact slurm controller (connect failure)"
ONE_JOB = ["method=prism", "logging=disabled"]  # Table 5's grid cut to one job


def fake_bin(tmp_path: Path, **scripts: str) -> Path:
    """A folder of executables ``name`` → shell body, to put first on PATH."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = folder / name
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(0o755)
    return folder


def env_with(bin_dir: Path, tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PRISM_PYTHON": sys.executable,
            "PRISM_SLURM_DIR": str(tmp_path / "slurm")}


def test_submit_sh_dry_run_and_failed_sbatch_leave_no_submission(tmp_path: Path) -> None:
    dead = tmp_path / "controller-dead"
    bin_dir = fake_bin(tmp_path, sbatch=f'if [[ -e {dead} ]]; then echo "sbatch: error: Batch job submission failed: '
                                        f'{DEAD}" >&2; exit 1; fi; echo "sbatch: warning: no GPU requested" >&2; echo "41;c"')
    env = env_with(bin_dir, tmp_path)
    args = ["table5", *ONE_JOB, f"results_dir={tmp_path}"]
    ok = subprocess.run([str(REPO / "slurm" / "submit.sh"), *args], env=env, capture_output=True, text=True, cwd=REPO,
                        timeout=120)
    assert ok.returncode == 0 and "submitted array 41: 1 jobs of table5" in ok.stdout, ok.stderr
    assert "warning: no GPU requested" in ok.stderr  # a warning on stderr does not make it a failure
    earlier = next((tmp_path / "slurm").iterdir())
    assert (earlier / "job_id").read_text() == "41\n"
    dead.touch()
    dry = subprocess.run([str(REPO / "slurm" / "submit.sh"), "--dry-run", *args], env=env, capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert "dry run: 1 jobs of table5" in dry.stdout and "--array=0-0%16" in dry.stdout
    assert "experiment=table5 method=prism logging=disabled" in dry.stdout
    failed = subprocess.run([str(REPO / "slurm" / "submit.sh"), *args], env=env, capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert failed.returncode == 1
    assert failed.stderr.strip() == f"0 of 1 submitted: sbatch: error: Batch job submission failed: {DEAD}"
    assert "Traceback" not in failed.stdout + failed.stderr
    assert [p.name for p in (tmp_path / "slurm").iterdir()] == [earlier.name]  # no stale folder
    status = subprocess.run([str(REPO / "slurm" / "status.sh"), "table5"], env=env, capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert status.returncode == 0, status.stderr
    assert f"submission: {earlier}" in status.stdout
    assert "finished=0 running=0 stale=0 stopped=0 failed=0 corrupt=0 missing=1 total=1" in status.stdout


def _tables_untouched(tmp_path: Path) -> tuple[Path, bytes]:
    table = tmp_path / "tables" / "table5.paper.md"
    table.parent.mkdir(parents=True)
    table.write_text("# an earlier paper-scale table\n")
    return table, table.read_bytes()


def test_reproduce_on_a_dead_controller_submits_nothing_and_keeps_tables(tmp_path: Path, monkeypatch, capsys) -> None:
    bin_dir = fake_bin(tmp_path, squeue=f'echo "slurm_load_jobs error: {DEAD}" >&2; exit 1', sbatch="exit 1")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    table, before = _tables_untouched(tmp_path)
    # embedded scale: paper scale without its data is refused by validation before SLURM is asked
    rc = cli(["reproduce", "experiment=table5", *ONE_JOB, "scale=embedded", "launcher=slurm", f"results_dir={tmp_path}"])
    out = capsys.readouterr()
    assert rc == 1
    assert out.err.strip() == (f"error: launcher=slurm: squeue failed: slurm_load_jobs error: {DEAD}; "
                               "nothing was submitted")
    assert "Traceback" not in out.out + out.err and "run(s) failed" not in out.out + out.err
    assert table.read_bytes() == before and sorted(p.name for p in table.parent.iterdir()) == [table.name]
    assert not (tmp_path / "runs" / store.VIEWS).exists() or not any((tmp_path / "runs").glob("[0-9a-f]*"))


def test_reproduce_when_sbatch_fails_inside_submitit(tmp_path: Path, monkeypatch, capsys) -> None:
    """The controller answers squeue but the array submission fails: submitit's traceback stays in
    the log; the user sees one reason line."""
    bin_dir = fake_bin(tmp_path, squeue="exit 0",
                       sbatch=f'echo "sbatch: error: Batch job submission failed: {DEAD}" >&2; exit 1')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    table, before = _tables_untouched(tmp_path)
    rc = cli(["reproduce", "experiment=table5", *ONE_JOB, "scale=embedded", "launcher=slurm", f"results_dir={tmp_path}"])
    out = capsys.readouterr()
    assert rc == 1
    assert out.err.startswith("0 of 1 submitted: ") and out.err.count("\n") == 1
    assert "Traceback" not in out.out + out.err
    logs = list((tmp_path / "logs" / "table5").glob("multirun-*.log"))
    assert len(logs) == 1 and "Traceback" in logs[0].read_text()  # the details are kept
    assert table.read_bytes() == before


def test_a_free_worker_skips_jobs_whose_caches_are_still_being_built(tmp_path: Path) -> None:
    """Table 2's queue alternates the suites; with the first GLUE8 job still building its caches, the
    next worker takes the Math jobs in order, and takes a GLUE8 job only once none else is left."""
    def job(i: int, group: str) -> launch.Job:
        return launch.Job([f"seed={i}"], None, tmp_path, f"{i:012x}", 2, cache_group=group)

    queue = [job(1, "math10k/smollm2-135m/1"), job(2, "glue8/smollm2-135m/1"), job(3, "math10k/smollm2-135m/1")]
    assert launch.next_job(queue, set()) == 0
    assert launch.next_job(queue, {"glue8/smollm2-135m/1"}) == 0
    assert launch.next_job(queue[1:], {"glue8/smollm2-135m/1"}) == 1
    assert launch.next_job(queue[1:2], {"glue8/smollm2-135m/1"}) == 0  # nothing else left: wait on the lock


def test_local_failure_count_is_the_runs_not_finished(tmp_path: Path, monkeypatch) -> None:
    jobs = [launch.Job([f"seed={i}"], None, tmp_path / "runs", f"{i:012x}", 2) for i in range(3)]
    store.write_status(tmp_path / "runs" / jobs[0].run_hash, "finished", started="t", attempts=1)
    store.write_json_atomic(tmp_path / "runs" / jobs[0].run_hash / "final.json", {"columns": {}})
    store.write_status(tmp_path / "runs" / jobs[1].run_hash, "failed", started="t", attempts=1, error="boom")
    monkeypatch.setattr(launch, "run_local", lambda *a: {"ok": [], "failed": []})
    submitted, failure = launch.launch("table2", "local", jobs, 1, [], tmp_path / "logs")
    assert submitted and failure.startswith(f"2 of 3 run(s) failed; logs in {tmp_path / 'logs'} "
                                            f"({jobs[1].run_hash}, {jobs[2].run_hash})")


@pytest.mark.parametrize("bad", ["scale=papr", "method=prism,nosuchmethod", "jobs=0"])
def test_reproduce_bad_overrides_are_one_line_errors(bad: str, tmp_path: Path, capsys) -> None:
    assert cli(["reproduce", "experiment=table5", bad, "launcher=local", f"results_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and bad.split("=")[0] in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("cores", "available_gb", "expected"), [
    (2, 22.0, 2),  # memory for 10 workers, 2 cores: the cores decide
    (16, 9.0, 4),  # 9 GB holds four 2.2 GB workers, not five
    (16, 4.3, 1),  # less than two workers' memory
    (8, 1.0, 1),  # not even one worker's memory: still one
    (1, 64.0, 1),
])
def test_default_jobs_is_the_smaller_of_cores_and_workers_that_fit_in_memory(cores: int, available_gb: float,
                                                                             expected: int) -> None:
    assert launch.default_jobs(cores, int(available_gb * 1e9)) == expected


def test_jobs_not_given_is_chosen_and_printed_jobs_given_is_kept(monkeypatch, capsys) -> None:
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(launch, "available_memory", lambda: 5 * 2**30)  # 5.4e9 bytes: two workers
    assert launch.resolve_jobs(3) == 3 and capsys.readouterr().out == ""
    assert launch.resolve_jobs(None) == 2
    assert capsys.readouterr().out == "JOBS=2 (4 cores, 5.0 GiB free; JOBS= overrides)\n"
    given = [parse("reproduce", function("reproduce"), ["experiment=table2", *jobs])[1] for jobs in ([], ["jobs=3"])]
    assert "jobs" not in given[0] and given[1]["jobs"] == 3


def test_slurm_missing_is_refused_before_any_job_is_validated(tmp_path: Path, monkeypatch, capsys) -> None:
    """Without sbatch the answer comes before the grid is planned (Table 2's 36 jobs take ~20 s to
    validate): each launcher's validation is replaced by a failure."""
    from pipelines.verbs import compare

    def validated(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the grid was validated before the launcher was checked")

    monkeypatch.setenv("PATH", str(fake_bin(tmp_path, python3="exit 0")))  # no sbatch, no squeue
    monkeypatch.setattr(launch, "plan", validated)
    monkeypatch.setattr(compare, "plan", validated)
    task = tmp_path / "task.jsonl"
    task.write_text('{"prompt": "a", "target": "b"}\n')
    for run in (lambda: cli(["reproduce", "experiment=table2", "launcher=slurm", f"results_dir={tmp_path}"]),
                lambda: cli(["tune", "launcher=slurm", f"results_dir={tmp_path}"]),
                lambda: cli(["compare", f"task={task}", "launcher=slurm", f"results_dir={tmp_path}"])):
        t0 = time.monotonic()
        assert run() == 2
        assert time.monotonic() - t0 < 2.0
        err = capsys.readouterr().err
        assert err.startswith("error: launcher=slurm: sbatch/squeue not found") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "task.jsonl"]  # no run folder, no log


def stub_venv(tmp_path: Path) -> Path:
    """A VENV whose python prints its arguments as JSON (make's recipes run ``$(VENV)/bin/python``)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    stub = venv / "bin" / "python"
    stub.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n")
    stub.chmod(0o755)
    return venv


def make(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    venv = stub_venv(tmp_path)
    return subprocess.run(["make", "--no-print-directory", "-s", f"VENV={venv}", "-o", f"{venv}/.setup-stamp", "-o",
                           "setup", "-o", "setup-gemma3", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_make_passes_every_value_as_one_verbatim_argument(tmp_path: Path) -> None:
    odd = "my task's $HOME \"x\".jsonl"
    done = make(tmp_path, "compare", f"TASK={odd}", "MODEL=/tmp/my model", "LABELS=very good,bad", "SEEDS=1,2",
                "JOBS=3")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["-m", "pipelines", "compare", f"task={odd}", "model=/tmp/my model", "seed=1,2",
                                       "labels=very good,bad", "scale=embedded", "launcher=local", "jobs=3"]
    done = make(tmp_path, "tune", "SEEDS=7", "TASK=a b.jsonl")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["-m", "pipelines", "tune", "scale=embedded", "launcher=local",
                                       "seed=7", "task=a b.jsonl"]  # no jobs=: the launcher chooses
    done = make(tmp_path, "reproduce-table2", "SEEDS=42,43", "ARGS=train.steps=2 'results_dir=/tmp/a b'")
    assert json.loads(done.stdout) == ["-m", "pipelines", "reproduce", "experiment=table2", "scale=embedded", "launcher=local",
                                       "seed=42,43", "train.steps=2", "results_dir=/tmp/a b"]  # ARGS: shell words
    done = make(tmp_path, "table2-accounted", "SEEDS=42,43", "METHODS=prism,adamw", "EPS=6", "JOBS=2")
    assert json.loads(done.stdout) == ["-m", "pipelines", "select", "scale=embedded", "launcher=local", "jobs=2",
                                       "seed=42,43", "methods=prism,adamw", "eps=6"]


@pytest.mark.parametrize(("goal", "variable", "users"), [
    ("reproduce-table2", "TASK=x.jsonl", "compare tune"),
    ("reproduce-diagnostics", "JOBS=4", "compare reproduce-table2 reproduce-table3 reproduce-table4 "
                                        "reproduce-table5 table2-accounted tune"),
    ("test", "SEEDS=1", "compare reproduce-table2 reproduce-table3 reproduce-table4 reproduce-table5 "
                        "table2-accounted tune"),
])
def test_make_refuses_a_variable_its_goal_does_not_use(goal: str, variable: str, users: str, tmp_path: Path) -> None:
    unset = make(tmp_path, "compare")
    assert unset.returncode == 2 and unset.stderr.count("\n") == 1 and "*** error: TASK is not set" in unset.stderr
    done = make(tmp_path, goal, variable)
    name = variable.split("=")[0]
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().endswith(f"*** error: make {goal} does not use {name}= (used by: {users}); "
                                        "leave it out.  Stop.") and done.stderr.count("\n") == 1



@pytest.mark.parametrize(("typed", "suggestion"), [("METHOD=prism", "did you mean METHODS=? "),
                                                   ("seed=1", "did you mean SEEDS=? "), ("FROBNICATE=1", "")])
def test_make_refuses_a_variable_no_target_reads_with_the_closest_name(typed: str, suggestion: str,
                                                                       tmp_path: Path) -> None:
    done = make(tmp_path, "compare", "TASK=x.jsonl", typed)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.strip().endswith(f"*** error: {typed.split('=')[0]}= is read by no target; {suggestion}"
                                        "make help lists each target's variables.  Stop.")
    kept = make(tmp_path, "compare", "TASK=x.jsonl", "METHODS=prism", "PYTHON=python3", "TEST_JOBS=1",
                "HF_HUB_OFFLINE=1", "SHELL=/bin/bash")  # the goal's, the set-up's and make's own variables
    assert kept.returncode == 0 and json.loads(kept.stdout)[3:5] == ["task=x.jsonl", "methods=prism"], kept.stderr


@pytest.mark.parametrize(("typed", "said", "internal"), [
    (["TYPE=zzz"], "TYPE='zzz' is not a task type", "type="),  # the override suite.custom.type=, from type=
    (["EPS=abc"], "EPS=abc: 'abc' is not a number", "eps="),
    (["METHODS=prizm"], "METHODS=prizm is not an option of method", "method="),  # the override, from methods=
])
def test_make_error_lines_name_the_variable_the_user_typed(typed: list[str], said: str, internal: str,
                                                           tmp_path: Path) -> None:
    task = tmp_path / "task.jsonl"
    task.write_text('{"prompt": "a", "target": "yes"}\n{"prompt": "b", "target": "no"}\n')
    done = subprocess.run(["make", "--no-print-directory", "-s", "-o", ".venv/.setup-stamp", "-o", "setup", "compare",
                           f"TASK={task}", *typed, f"ARGS=results_dir={tmp_path}"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    error = done.stderr.strip().splitlines()[0]
    assert done.returncode == 2 and error.startswith("error: ") and said in error, done.stderr
    assert internal not in error
    assert not (tmp_path / "runs").exists()

LONG_TINY = ["method=prism,adamw", "privacy=nondp", "suite=glue8", "train.steps=100000", "train.micro_batch_size=4",
             "train.checkpoint_every=50", *TINY_JOB]


@pytest.mark.parametrize(("sig", "workers", "to_group"), [
    (signal.SIGTERM, 2, False),  # what make (or a scheduler) sends: to the launcher alone
    (signal.SIGINT, 1, True),  # Ctrl-C: to the terminal's whole process group
])
def test_a_signal_ends_every_process_of_the_local_launcher_and_marks_its_runs_interrupted(
        sig: signal.Signals, workers: int, to_group: bool, tmp_path: Path) -> None:
    """Two runs far from done: once each worker trains, the signal must leave no process of the tree
    (workers, the multiprocessing resource tracker) alive, the runs it cut off marked failed as
    interrupted (resumable), a queued run not started, and one line saying so."""
    psutil = pytest.importorskip("psutil")
    cmd = [sys.executable, "-m", "pipelines", "reproduce", "experiment=table2", f"jobs={workers}", *LONG_TINY, f"results_dir={tmp_path}"]
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while len([m for m in (tmp_path / "runs").glob("*/metrics.jsonl") if m.read_text().strip()]) < workers:
            assert launcher.poll() is None and time.monotonic() < deadline, "the runs did not start training"
            time.sleep(0.5)
        tree = psutil.Process(launcher.pid).children(recursive=True)
        assert len(tree) >= workers + 1  # the workers and the resource tracker
        os.killpg(launcher.pid, sig) if to_group else launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 128 + sig
    _, alive = psutil.wait_procs(tree, timeout=20)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    statuses = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/status.json")]
    assert len(statuses) == workers
    assert all(s["state"] == "stopped" and s["error"].startswith("interrupted") for s in statuses), statuses
    assert all(store.run_state(p.parent) == "stopped" for p in (tmp_path / "runs").glob("*/status.json"))
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"stopped ({sig.name}): every worker ended; {workers} run(s) marked stopped (")
    # three queued: the two long runs, then the suite's 0-step reference
    assert last.endswith(f"{3 - workers} not started; rerun the same command to resume them from their checkpoints")
    assert "Traceback" not in err


def test_a_preempted_array_task_is_requeueable_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """SLURM preempts a task with SIGTERM to its processes and, under ``--requeue``, starts the same
    array task again: the second start must resume the run from its checkpoint and finish it."""
    assert "#SBATCH --requeue" in (REPO / "slurm" / "array.sbatch").read_text().splitlines()
    overrides = [o for o in LONG_TINY if not o.startswith(("method=", "train.steps=", "train.checkpoint_every="))]
    overrides += ["method=prism", "train.steps=40", "train.checkpoint_every=10", f"results_dir={tmp_path}"]
    (tmp_path / "jobs.txt").write_text(shlex.join(overrides) + "\n")
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "0", "PRISM_PYTHON": sys.executable}
    task = [str(REPO / "slurm" / "array.sbatch"), str(tmp_path / "jobs.txt")]
    first = subprocess.Popen(task, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "runs"
    try:
        deadline = time.monotonic() + 300
        while not any(len(m.read_text().splitlines()) > 12 for m in metrics.glob("*/metrics.jsonl")):
            assert first.poll() is None and time.monotonic() < deadline, "the task did not train"
            time.sleep(0.3)
        first.send_signal(signal.SIGTERM)  # the script exec'd the runner: the signal reaches it
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    folder = next(metrics.glob("*/metrics.jsonl")).parent
    assert store.run_state(folder) == "stopped"  # resumable, not finished, nobody holds it
    again = subprocess.run(task, cwd=REPO, env={**env, "SLURM_RESTART_COUNT": "1"}, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resuming from the checkpoint of step 10 ({folder / 'checkpoint'})" in again.stdout + again.stderr
    assert store.inspect_run(folder).state == "finished"
    resumed = re.findall(r"\] step (\d+)/40", again.stdout + again.stderr)
    assert resumed[0] == "11" and resumed[-1] == "40"  # the second start went on from step 10's checkpoint


def test_a_signal_ends_the_hydra_multirun_and_its_local_jobs(tmp_path: Path) -> None:
    """launcher=submitit_local (the path of launcher=slurm, without a cluster): SIGTERM to the launcher
    must end Hydra and the submitit job it started (which ignores SIGTERM itself), and the run must
    be marked interrupted."""
    psutil = pytest.importorskip("psutil")
    overrides = [o for o in LONG_TINY if not o.startswith("method=")]
    cmd = [sys.executable, "-m", "pipelines", "reproduce", "experiment=table2", "launcher=submitit_local", "method=prism", *overrides,
           f"results_dir={tmp_path}"]
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not any(m.read_text().strip() for m in (tmp_path / "runs").glob("*/metrics.jsonl")):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.5)
        tree = psutil.Process(launcher.pid).children(recursive=True)
        assert len(tree) >= 2  # Hydra and the submitit job
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 128 + signal.SIGTERM
    _, alive = psutil.wait_procs(tree, timeout=20)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    [status] = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/status.json")]
    assert status["state"] == "stopped" and status["error"].startswith("interrupted"), status
    assert err.strip().splitlines()[-1].startswith("stopped (SIGTERM): the multirun and its local jobs ended")


def test_make_tune_seeds_sets_the_tuning_seeds(tmp_path: Path) -> None:
    assert json.loads(make(tmp_path, "tune", "SEEDS=1,2").stdout)[-1] == "seed=1,2"  # forwarded, not dropped


def test_a_grid_logged_to_a_file_gets_plain_lines_one_per_finished_run(tmp_path: Path,
                                                                        capfd: pytest.CaptureFixture[str]) -> None:
    """Output captured to files (not a terminal, as under SLURM or CI): no cursor escape, no carriage
    return, one line per finished run naming its overrides."""
    from pipelines.config.validate import load_job

    overrides = ["suite=glue8", "method=prism", "privacy=eps6", *TINY_JOB, "train.steps=2", "train.micro_batch_size=4",
                 "train.checkpoint_every=1", f"results_dir={tmp_path}"]
    job = launch.Job.of(overrides, load_job(overrides))
    outcome = launch.run_local([job], 1, tmp_path / "logs")
    out, err = capfd.readouterr()
    assert [j.run_hash for j in outcome["ok"]] == [job.run_hash]
    assert "\x1b" not in out + err and "\r" not in out + err, (out + err)[:2000]
    assert [line for line in out.splitlines() if line.startswith("finished ")] == [
        f"finished {job.run_hash} {' '.join(overrides)} (log {tmp_path / 'logs' / job.run_hash}.log)"]


def test_a_hydra_launcher_runs_the_0_step_reference_jobs_in_a_second_sweep(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Hydra's multirun sweeps only the experiment's ``hydra.sweeper.params``; under launcher=submitit_local the
    grid's 0-step reference runs follow as a second sweep, whose jobs are exactly the plan's reference runs."""
    from pipelines.config.compose import REFERENCE_JOBS, sweep_jobs
    from pipelines.config.validate import load_grid

    overrides = ["scale=smoke", "method=prism", "privacy=eps6", "seed=42,43", f"results_dir={tmp_path}"]
    pending, _ = launch.plan("table2", overrides)
    calls: list[list[str]] = []
    monkeypatch.setattr(launch, "run_hydra_multirun", lambda exp, ovr, log: (calls.append(list(ovr)), (0, ""))[1])
    launch.launch("table2", "submitit_local", pending, None, overrides, tmp_path / "logs")
    assert calls[0] == overrides and calls[1] == [*overrides, *REFERENCE_JOBS["table2"]]
    second = {store.run_hash(cfg) for cfg in load_grid(sweep_jobs(calls[1], ["experiment=table2"]))}
    assert second == {job.run_hash for job in pending if job.cfg.train.steps == 0} and len(second) == 4
