"""The local launcher's workers (pipelines/runs/worker.py): a job run in a worker that keeps its backbone
loaded gives bitwise the numbers of a fresh ``python -m pipelines run`` of the same job, whatever
ran in that worker before; a failing job fails alone."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_JOB

from pipelines.config.compose import job_config
from pipelines.config.validate import load_job
from pipelines.runs import launch, store
from prism.models import KeptBackbones, load_backbone

REPO = Path(__file__).resolve().parents[1]
TINY = [*TINY_JOB, "train.steps=3", "train.micro_batch_size=2", "train.checkpoint_every=1"]
A = ["suite=glue8", "method=prism", "privacy=eps6", *TINY]
B = ["suite=math10k", "method=adamw", "privacy=nondp", *TINY]


def job(overrides: list[str], results: Path, here: bool = True) -> launch.Job:
    """The grid job of ``overrides``, validated as the grid process validates it (``here=False``: as a
    job that runs on another machine)."""
    return launch.Job.of([*overrides, f"results_dir={results}"], load_job([*overrides, f"results_dir={results}"],
                                                                          here=here))


def outputs(j: launch.Job) -> tuple[list[dict], dict]:
    metrics = [json.loads(line) for line in (j.folder / "metrics.jsonl").read_text().splitlines()]
    final = json.loads((j.folder / "final.json").read_text())
    drop = ("step_time_s",)  # wall-clock
    return [{k: v for k, v in m.items() if k not in drop} for m in metrics], final


def test_kept_backbone_copies_are_fresh_loads_and_independent() -> None:
    cfg = job_config(A).backbone
    kept = KeptBackbones()
    first, _ = kept(cfg, "cpu")
    for p in first.parameters():
        p.data.add_(1.0)  # a run trains its copy; the next copy must not see it
    second, tokenizer = kept(cfg, "cpu")
    reference, ref_tokenizer = load_backbone(cfg, "cpu")
    assert second is not first
    for (name, p), (_, q) in zip(second.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    assert not any(p.requires_grad for p in second.parameters()) and not second.training
    assert tokenizer("a b c")["input_ids"] == ref_tokenizer("a b c")["input_ids"]


def test_worker_run_is_bitwise_a_fresh_process_run_after_another_job(tmp_path: Path) -> None:
    fresh = job(A, tmp_path / "fresh")
    done = subprocess.run([sys.executable, "-m", "pipelines", "run", *fresh.overrides], capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    other, same = job(B, tmp_path / "worker"), job(A, tmp_path / "worker")
    outcome = launch.run_local([other, same], 1, tmp_path / "logs")  # one worker: B then A in one process
    assert [j.run_hash for j in outcome["ok"]] == [other.run_hash, same.run_hash] and not outcome["failed"]
    assert same.run_hash == fresh.run_hash
    (m_fresh, f_fresh), (m_worker, f_worker) = outputs(fresh), outputs(same)
    assert m_worker == m_fresh  # every step's loss, clip fraction, ε, σ: bitwise
    assert f_worker["columns"] == f_fresh["columns"] and f_worker["epsilon_spent"] == f_fresh["epsilon_spent"]
    assert "step 3/3" in (tmp_path / "logs" / f"{same.run_hash}.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="fails a job by asking for a GPU this machine lacks")
def test_a_failing_job_fails_alone_and_the_next_one_runs(tmp_path: Path) -> None:
    broken = job([*A, "train.device=cuda"], tmp_path, here=False)  # validated for another machine
    ok = job(B, tmp_path)
    outcome = launch.run_local([broken, ok], 1, tmp_path / "logs")
    assert [j.run_hash for j in outcome["failed"]] == [broken.run_hash]
    assert [j.run_hash for j in outcome["ok"]] == [ok.run_hash]
    assert store.inspect_run(broken.folder).status["state"] == "failed"
    assert "error: " in (tmp_path / "logs" / f"{broken.run_hash}.log").read_text()


WORKER_UNDER_SIGTERM = """
import os, signal, sys, threading, time
from pipelines.verbs import run
from pipelines.runs import runner
from pipelines.runs import worker
from pipelines.config.validate import load_job

cfg = load_job(sys.argv[2:])


def resend() -> None:  # the launcher resends SIGTERM every half second until its workers end
    while True:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.005)


def trainer(job, folder, log_fn, load=None):
    log_fn({"step": 1})
    threading.Thread(target=resend, daemon=True).start()
    time.sleep(60)


runner.default_trainer = trainer
worker.init()
worker.run_job(cfg, sys.argv[1])
print("run_job returned")
"""


def test_sigterm_inside_a_job_is_the_workers_stop_record_then_exit_without_interpreter_shutdown(tmp_path: Path) -> None:
    """The worker's own SIGTERM handler holds during a job: the first signal interrupts the run, the
    repeats are ignored while it is recorded, and the process leaves through ``os._exit(143)``, never
    returning to (and shutting down) the interpreter that a further signal could cut into."""
    j = job(B, tmp_path)
    log = tmp_path / "job.log"
    done = subprocess.run([sys.executable, "-c", WORKER_UNDER_SIGTERM, str(log), *j.overrides], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert done.returncode == 143, done.stdout[-2000:] + done.stderr[-2000:]
    assert "run_job returned" not in done.stdout
    assert "Traceback" not in done.stderr + log.read_text() and "Exception ignored" not in done.stderr
    status = store.inspect_run(j.folder).status
    assert status["state"] == "stopped" and "SIGTERM" in status["error"], status
