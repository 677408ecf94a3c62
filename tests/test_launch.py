"""Launch paths without a cluster: fake `sbatch`/`squeue` on PATH stand for a dead SLURM controller.

A failed submission must say "0 of N submitted: <reason>", exit non-zero, print no traceback,
leave no submission folder behind and touch no table; `submit.sh --dry-run` writes nothing;
`status.sh` reads the latest submission sbatch accepted; the local path counts failed *runs*.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines import reproduce, store

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
    assert "finished=0 running=0 stale=0 failed=0 corrupt=0 missing=1 total=1" in status.stdout


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
    rc = reproduce.main(["5", *ONE_JOB, "scale=embedded", "launcher=slurm", f"results_dir={tmp_path}"])
    out = capsys.readouterr()
    assert rc == 1
    assert out.err.strip() == f"0 of 1 submitted: squeue failed: slurm_load_jobs error: {DEAD}"
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
    rc = reproduce.main(["5", *ONE_JOB, "scale=embedded", "launcher=slurm", f"results_dir={tmp_path}"])
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
    def job(i: int, group: str) -> reproduce.Job:
        return reproduce.Job([f"seed={i}"], tmp_path, f"{i:012x}", 2, cache_group=group)

    queue = [job(1, "math10k/smollm2-135m/1"), job(2, "glue8/smollm2-135m/1"), job(3, "math10k/smollm2-135m/1")]
    assert reproduce.next_job(queue, set()) == 0
    assert reproduce.next_job(queue, {"glue8/smollm2-135m/1"}) == 0
    assert reproduce.next_job(queue[1:], {"glue8/smollm2-135m/1"}) == 1
    assert reproduce.next_job(queue[1:2], {"glue8/smollm2-135m/1"}) == 0  # nothing else left: wait on the lock


def test_local_failure_count_is_the_runs_not_finished(tmp_path: Path, monkeypatch) -> None:
    jobs = [reproduce.Job([f"seed={i}"], tmp_path / "runs", f"{i:012x}", 2) for i in range(3)]
    store.write_status(tmp_path / "runs" / jobs[0].run_hash, "finished", started="t", attempts=1)
    store.write_json_atomic(tmp_path / "runs" / jobs[0].run_hash / "final.json", {"columns": {}})
    store.write_status(tmp_path / "runs" / jobs[1].run_hash, "failed", started="t", attempts=1, error="boom")
    monkeypatch.setattr(reproduce, "run_local", lambda *a: {"ok": [], "failed": []})
    submitted, failure = reproduce.launch("table2", "local", jobs, 1, [], tmp_path / "logs")
    assert submitted and failure.startswith(f"2 of 3 run(s) failed; logs in {tmp_path / 'logs'} "
                                            f"({jobs[1].run_hash}, {jobs[2].run_hash})")


@pytest.mark.parametrize("bad", ["scale=papr", "method=prism,nosuchmethod", "jobs=0"])
def test_reproduce_bad_overrides_are_one_line_errors(bad: str, tmp_path: Path, capsys) -> None:
    assert reproduce.main(["5", bad, "launcher=slurm", f"results_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and bad.split("=")[0] in err
    assert not any(tmp_path.iterdir())
