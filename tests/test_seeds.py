"""The seeds axis: SEEDS=a,b,c adds a seed axis to every grid, for every launcher's job list."""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from pipelines.config import compose, identity

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("experiment", ["table2", "table3", "table4", "table5"])
def test_a_seed_sweep_multiplies_every_grid(experiment: str) -> None:
    one = compose.experiment_jobs(experiment, ["scale=smoke"])
    three = compose.experiment_jobs(experiment, ["scale=smoke", "seed=42,43,44"])
    assert len(three) == 3 * len(one)
    cells = {tuple(o for o in job if not o.startswith("seed=")) for job in three}
    assert len(cells) == len(one)  # each cell once per seed
    assert {o for job in three for o in job if o.startswith("seed=")} == {"seed=42", "seed=43", "seed=44"}


def test_seeds_are_separate_runs_of_one_cell(tmp_path: Path) -> None:
    from pipelines.runs import store

    jobs = compose.experiment_jobs("table2", ["scale=smoke", f"results_dir={tmp_path}", "method=prism",
                                           "privacy=eps6", "suite=glue8", "seed=42,43"])
    cfgs = [compose.job_config(j) for j in jobs if "train.steps=0" not in j]  # the cell, not its 0-step model
    assert [c.seed for c in cfgs] == [42, 43] and len({store.run_hash(c) for c in cfgs}) == 2
    fields = [identity.result_fields(c) for c in cfgs]
    for f in fields:
        f.pop("seed")
    assert identity.canonical(fields[0]) == identity.canonical(fields[1])  # the aggregator's "same cell but the seed"


def test_make_passes_seeds_to_every_reproduce_target_and_the_slurm_job_list() -> None:
    for target in ("reproduce-table2", "reproduce-table3", "reproduce-table4", "reproduce-table5"):
        dry = subprocess.run(["make", "-n", "--no-print-directory", "-o", ".venv/.setup-stamp", "-o", "setup-gemma3", target, "SEEDS=42,43,44"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout
        assert "seed=42,43,44" in shlex.split(dry.strip().splitlines()[-1])
    listed = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "pipelines", "grid", "experiment=table5", "scale=smoke",
                             "seed=42,43"], cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(listed) == 2 * len(compose.experiment_jobs("table5", ["scale=smoke"]))
