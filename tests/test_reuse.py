"""Shared runs across tables: after a Table 2-like grid, the Table 4-like grid trains only the runs
Table 2 lacks (its r=16 rows are Table 2's ε=6 runs), and Table 4's view shows all of them.

The fast test drives the real planner and runner (`pipelines.runs.launch.plan`,
`pipelines.runs.runner.execute`) with a stand-in trainer; the slow one runs `python -m pipelines reproduce`
end to end on the random-config tiny-llama.
"""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig

from pipelines import tables as agg
from pipelines.config.compose import job_config
from pipelines.runs import launch, store
from pipelines.runs.runner import execute
from pipelines.verbs.reproduce import supersede

REPO = Path(__file__).resolve().parents[1]
TINY = ["backbone=tiny-llama", "method=prism,adamw", "train.steps=2", "logging=disabled", "suite.cutoff_len=1024"]
T2 = [*TINY, "privacy=nondp,eps6"]  # 2 methods x 2 settings x 2 suites = 8 runs, and a 0-step reference per suite
T4 = [*TINY, "lora=r8,r16"]  # 2 ranks x 2 methods x 2 suites = 8 runs, the 4 at r=16 shared with T2


class CountingTrainer:
    """Records which configs it trained; returns a score per suite column."""

    def __init__(self) -> None:
        self.trained: list[str] = []

    def __call__(self, cfg: DictConfig, run_dir: Path, log_fn: Any) -> dict[str, Any]:
        self.trained.append(store.run_hash(cfg))
        column = "SST-2" if cfg.suite.name == "glue8" else "GSM8K"
        eps = float(cfg.privacy.epsilon)
        right = 50 + cfg.lora.r  # of 100 rows: the score 0.5 + 0.01·r
        return {"columns": {column: 0.5 + 0.01 * cfg.lora.r}, "epsilon_spent": eps if math.isinf(eps) else eps - 0.01,
                "n_train": 32, "per_example": {column: {"column": column, "correct": [1] * right + [0] * (100 - right),
                                                        "rows": column}}}


def grid(experiment: str, overrides: list[str], tmp_path: Path, trainer: CountingTrainer) -> tuple[int, int]:
    pending, finished = launch.plan(experiment, [*overrides, f"results_dir={tmp_path}"])
    for job in pending:
        assert execute(job_config(job.overrides), trainer) == "finished"
    return len(pending), len(finished)


def test_table4_trains_only_the_runs_table2_lacks(tmp_path: Path) -> None:
    trainer = CountingTrainer()
    assert grid("table2", T2, tmp_path, trainer) == (10, 0)
    table2_runs = set(trainer.trained)
    assert grid("table4", T4, tmp_path, trainer) == (4, 4)  # 4 trained, 4 reused
    assert len(trainer.trained) == 14 and not table2_runs & set(trainer.trained[10:])
    root = tmp_path / "runs"
    view4 = store.view(root, "table4")
    assert len(view4) == 8 and len(set(view4) & table2_runs) == 4
    table = agg.build_table(agg.SPECS["table4"], agg.read_run_folders(root, "table4"), "embedded").frame
    for rank in (8, 16):
        for method in ("PRISM", "AdamW"):
            row = table[(table["Rank"] == rank) & (table["Method"] == method)].iloc[0]
            assert row["GLUE8_Avg"] == pytest.approx(0.5 + 0.01 * rank) and row["n_runs"] == 2
    assert grid("table4", T4, tmp_path, trainer) == (0, 8) and len(trainer.trained) == 14  # nothing left


def test_a_grid_rerun_at_another_rate_replaces_the_earlier_runs_in_the_table_and_keeps_their_folders(
        tmp_path: Path) -> None:
    trainer = CountingTrainer()
    grid("table2", T2, tmp_path, trainer)
    root, earlier = tmp_path / "runs", set(trainer.trained)
    pending43, finished43 = launch.plan("table2", [*T2, "seed=43", f"results_dir={tmp_path}"])
    assert supersede("table2", pending43 + finished43) == ""  # another seed's cells replace nothing
    assert set(store.view(root, "table2")) == earlier

    pending, finished = launch.plan("table2", [*T2, "train.lr_multiplier=2", f"results_dir={tmp_path}"])
    assert len(pending) == len(earlier) and not finished  # every run's rate moved, so every hash
    for job in pending:
        assert execute(job.cfg, trainer) == "finished"  # the config the grid validated, as its worker runs it
    refused = agg.build_table(agg.SPECS["table2"], agg.read_run_folders(root, "table2"), "embedded").missing
    assert sum("REFUSED" in line for line in refused) == len(earlier)  # both rates in one cell: each cell refused

    line = supersede("table2", pending)
    assert line.startswith(f"table2: {len(earlier)} runs") and "differing: method.lr" in line
    assert set(store.view(root, "table2")) == {job.run_hash for job in pending}
    assert all((root / run_hash).is_dir() for run_hash in earlier)  # left the view, not the store
    table = agg.build_table(agg.SPECS["table2"], agg.read_run_folders(root, "table2"), "embedded")
    assert not [line for line in table.missing if "REFUSED" in line]
    assert {n for n in table.frame["n_runs"] if n} == {2}  # per row: one run of each suite, at the new rate


def test_force_reruns_a_shared_run_and_keeps_the_old_one(tmp_path: Path) -> None:
    trainer = CountingTrainer()
    cfg = job_config(["experiment=table2", "backbone=tiny-llama", "privacy=eps6", "logging=disabled", "suite.cutoff_len=1024",
                      f"results_dir={tmp_path}"])
    execute(cfg, trainer)
    cfg4 = job_config(["experiment=table4", "backbone=tiny-llama", "lora=r16", "logging=disabled", "suite.cutoff_len=1024",
                       f"results_dir={tmp_path}"])
    assert store.run_hash(cfg4) == store.run_hash(cfg) and execute(cfg4, trainer) == "skipped"
    forced = job_config(["experiment=table4", "backbone=tiny-llama", "lora=r16", "logging=disabled", "suite.cutoff_len=1024", "force=true",
                         f"results_dir={tmp_path}"])
    assert execute(forced, trainer) == "finished" and len(trainer.trained) == 2
    root = tmp_path / "runs"
    assert len(list(root.glob(f"{store.run_hash(cfg)}.old-*"))) == 1
    assert store.view(root, "table2") == store.view(root, "table4") == [store.run_hash(cfg)]


@pytest.mark.slow
def test_reproduce_table4_after_table2_end_to_end(tmp_path: Path) -> None:
    """`make reproduce-table2` then `make reproduce-table4` on tiny-llama: the second trains 4 of 8."""
    tiny = ["backbone.lora_layers=null", "train.batch_size=4", "train.micro_batch_size=4", "train.checkpoint_every=1",
            "suite.eval_limit=2", "suite.cutoff_len=1024", "suite.embedded.train_per_task=16", f"results_dir={tmp_path}"]

    def reproduce_(n: str, overrides: list[str]) -> str:
        done = subprocess.run([sys.executable, "-m", "pipelines", "reproduce", f"experiment=table{n}", "jobs=2", *overrides, *tiny],
                              capture_output=True, text=True, cwd=REPO, timeout=1800)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stdout

    out2 = reproduce_("2", T2)
    assert "table2: 8 runs in the grid, 0 finished, 8 to run" in out2
    out4 = reproduce_("4", T4)
    assert "table4: 8 runs in the grid, 4 finished, 4 to run" in out4
    print("\n" + "\n".join(line for line in out4.splitlines() if re.match(r"table4: |\| (8|16) \|", line)))
    md = (tmp_path / "tables" / "table4.embedded.md").read_text()
    assert "Runs behind the table (8 finished)" in md
