"""SLURM integration on a real single-node cluster (tests/slurm_harness.py): `make test-slurm`.

The same 2-job tiny grid (Table 2 layout on the random-config `tiny-llama`, PRISM and DP-AdamW at
ε = 6, GLUE8 stand-in, a 2-step budget) goes through both cluster paths — the plain
`slurm/submit.sh` job array and hydra-submitit-launcher (`launcher=slurm`) — and both run folders
must end `finished`, written by the real `python -m pipelines run`. Both jobs of an array run at once
(parallelism 2), so the array's scheduling is exercised; non-private runs of the same runner are
tested without SLURM (`tests/test_worker.py`).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TINY_JOB

sys.path.insert(0, str(Path(__file__).parent))
from slurm_harness import HarnessUnavailableError, LocalSlurm  # noqa: E402

pytestmark = [pytest.mark.slurm]
REPO = Path(__file__).resolve().parents[1]
TINY_GRID = ["method=prism,adamw", "privacy=eps6", "suite=glue8", "train.steps=2", "train.micro_batch_size=4",
             "train.checkpoint_every=1", *TINY_JOB]
JOB_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    slurm = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        slurm.start()
    except HarnessUnavailableError as err:
        pytest.skip(f"no local SLURM: {err}")
    print(f"\nslurm harness: install {slurm.install_s:.1f} s, daemons up and node idle in {slurm.startup_s:.1f} s")
    yield slurm
    slurm.stop()  # raises if a daemon or job step survives


def _wait_queue_empty(cluster: LocalSlurm, timeout: float) -> float:
    t0 = time.monotonic()
    while not cluster.queue_empty():
        assert time.monotonic() - t0 < timeout, "SLURM jobs did not finish in time"
        time.sleep(1)
    return time.monotonic() - t0


def _run_states(results_dir: Path) -> dict[str, str]:
    from pipelines.runs import store

    root = results_dir / "runs"
    return {h: store.run_state(store.find_run(root, h)) for h in store.view(root, "table2")}


def test_harness_runs_a_trivial_array(cluster: LocalSlurm, tmp_path: Path) -> None:
    out = subprocess.run(["sbatch", "--parsable", "--array=0-3%2", f"--output={tmp_path}/%a.out",
                          "--wrap", "echo task $SLURM_ARRAY_TASK_ID"], env=cluster.env(), capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip().isdigit()
    _wait_queue_empty(cluster, 60)
    assert sorted((tmp_path / f"{i}.out").read_text() for i in range(4)) == [f"task {i}\n" for i in range(4)]


def test_submit_sh_array_runs_the_real_runner(cluster: LocalSlurm, tmp_path: Path) -> None:
    env = {**cluster.env(), "PRISM_SLURM_GPUS": "0", "PRISM_SLURM_CPUS": "1", "PRISM_SLURM_MEM": "2G",
           "PRISM_SLURM_TIME": "00:20:00", "PRISM_SLURM_PARALLEL": "2", "PRISM_PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1", "PRISM_SLURM_DIR": str(tmp_path / "slurm")}
    t0 = time.monotonic()
    done = subprocess.run([str(REPO / "slurm" / "submit.sh"), "table2", *TINY_GRID, f"results_dir={tmp_path}"],
                          env=env, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "submitted array" in done.stdout
    submission = max((tmp_path / "slurm").glob("table2-*"))
    assert len((submission / "jobs.txt").read_text().splitlines()) == 3  # two cells and their 0-step reference
    _wait_queue_empty(cluster, JOB_TIMEOUT_S)
    print(f"\nsubmit.sh path: 3 jobs in {time.monotonic() - t0:.0f} s")
    logs = "\n".join(p.read_text()[-2000:] for p in (submission / "logs").glob("*.out"))
    assert list(_run_states(tmp_path).values()) == ["finished"] * 3, logs
    status = subprocess.run([str(REPO / "slurm" / "status.sh"), "table2", str(submission)], env=env,
                            capture_output=True, text=True, cwd=REPO)
    assert "finished=3 running=0 stale=0 stopped=0 failed=0 corrupt=0 missing=0 total=3" in status.stdout, status.stderr


def test_submitit_launcher_runs_the_real_runner(cluster: LocalSlurm, tmp_path: Path) -> None:
    env = {**cluster.env(), "OMP_NUM_THREADS": "1"}
    launcher = ["launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
                "hydra.launcher.mem_gb=2", "hydra.launcher.timeout_min=20", "hydra.launcher.array_parallelism=2"]
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pipelines", "run", "-m", "experiment=table2", *TINY_GRID,
                           *launcher, f"results_dir={tmp_path}"], env=env, capture_output=True, text=True,
                          cwd=REPO, timeout=JOB_TIMEOUT_S)
    print(f"\nsubmitit path: 2 jobs in {time.monotonic() - t0:.0f} s")
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(_run_states(tmp_path).values()) == ["finished"] * 2, done.stderr[-3000:]

