"""An override either means what it says or is refused in one line before any run folder: an empty or
all-unscored task list, a bad data seed, more evaluation rows than a stand-in holds; a quoted ``~`` is
the home folder, a per-task mapping of training rows is read as written. (``gpu_check --methods``:
tests/test_gpu_check.py; quoting hints: tests/test_grid_validation.py.)"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from pipelines.__main__ import main as cli
from pipelines.config.validate import ConfigError, load_job
from pipelines.runs import runner


@pytest.mark.parametrize("overrides", [["suite.embedded.tasks=[]"], ["suite=math10k", "suite.embedded.tasks=[]"]])
def test_an_empty_task_list_is_refused_not_all_tasks(overrides: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"suite\.embedded\.tasks=\[\] lists no task"):
        load_job(overrides)


@pytest.mark.parametrize(("overrides", "message"), [
    (["suite.embedded.unscored=[gsm_symbolic]"], r"suite\.embedded\.unscored=\['gsm_symbolic'\] must name glue8 tasks"),
    (["suite.embedded.unscored=[tweet_sentiment,syllogism]"], r"and leave one of suite\.embedded\.tasks=\["),
    (["suite=math10k", "suite.embedded.tasks=[gsm_symbolic]"], r"suite\.embedded\.unscored=\[\]"),
    (["suite.data_seed=-1"], r"suite\.data_seed=-1 must be an integer in \[0, 2\^32\)"),
    (["suite.data_seed=abc"], r"suite\.data_seed must be an integer, got 'abc'"),
])
def test_unscored_tasks_that_leave_nothing_scored_and_bad_data_seeds_are_refused(overrides: list[str],
                                                                                   message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_job(overrides)


def test_a_quoted_tilde_results_dir_is_the_home_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, cwd = tmp_path / "home", tmp_path / "checkout"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    cfg = load_job(["results_dir='~/x'"])
    assert cfg.results_dir == str(home / "x") and cfg.logging.dir == str(home / "x" / "wandb")

    def trainer(cfg: Any, folder: Path, log_fn: Any) -> dict[str, Any]:
        return {"columns": {}}

    monkeypatch.setattr(runner, "default_trainer", trainer)
    handlers, level = logging.root.handlers[:], logging.root.level
    try:
        assert cli(["run", "results_dir='~/x'", "logging=disabled"]) == 0
    finally:
        logging.root.handlers[:], logging.root.level = handlers, level
    assert list((home / "x" / "runs").glob("*/final.json")) and not (cwd / "~").exists()


def test_a_train_per_task_mapping_is_accepted_and_read() -> None:
    """The mapping form of conf/suite_scale/glue8_embedded.yaml, for the suite whose default is a count:
    accepted, and its sum is the training-set size the batch is checked against (40 rows < B = 64)."""
    cfg = load_job(["suite=math10k", "suite.embedded.train_per_task={basic_arithmetic:100,leg_counting:50}",
                    "suite.embedded.tasks=[basic_arithmetic,leg_counting]"])
    assert cfg.suite.embedded.train_per_task == {"basic_arithmetic": 100, "leg_counting": 50}
    with pytest.raises(ConfigError, match="40 training examples"):
        load_job(["suite=math10k", "suite.embedded.train_per_task={basic_arithmetic:40}",
                  "suite.embedded.tasks=[basic_arithmetic]"])


def test_eval_rows_beyond_a_stand_ins_supply_are_refused_before_the_run() -> None:
    """The stand-in's own builder refuses the same request (after model load, before this check)."""
    from prism.data.config import EmbeddedDataConfig
    from prism.data.embedded import build

    with pytest.raises(ConfigError, match="tweet_sentiment yields 1600 train / [0-9]+ eval rows"):
        load_job(["suite.embedded.eval_per_task=5000"])
    node = EmbeddedDataConfig(tasks=["tweet_sentiment"], train_per_task=1600, eval_per_task=5000, unscored=[])
    with pytest.raises(ValueError, match="fewer than requested"):
        build("glue8", node, 42)
    assert load_job(["suite.embedded.eval_per_task=300"]).suite.embedded.eval_per_task == 300


def test_no_run_folder_for_any_refused_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("suite.embedded.tasks=[]", "suite.embedded.eval_per_task=5000", "method.init=peft",
                "privacy.delta=1e-30"):
        assert cli(["run", bad, f"results_dir={tmp_path}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and bad.split("=")[0] in err
    assert not os.listdir(tmp_path)
