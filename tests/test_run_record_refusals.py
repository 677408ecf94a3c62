"""Records the runner writes and the aggregator refuses: a run that cannot be trusted is listed in one
line naming it and never averaged, and a cell's n counts distinct runs.

Every run folder here is written by :func:`pipelines.runs.runner.execute` (with a stub trainer); the tests
then damage or copy what it wrote, as a user editing or copying run folders would.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from pipelines.config.validate import load_job
from pipelines.runs import runner, store
from pipelines.tables.build import build_table
from pipelines.tables.records import read_run_folders
from pipelines.tables.specs import SPECS


def stub(cfg, folder, log_fn) -> dict:
    log_fn({"step": 1})
    eps = float(cfg.privacy.epsilon)
    correct = [1, 0, 1, 1] if cfg.seed == 42 else [0, 0, 1, 0]
    return {"columns": {"SST-2": sum(correct) / 4}, "average": sum(correct) / 4, "n_train": 32,
            "epsilon_spent": eps - 0.01 if math.isfinite(eps) else math.inf, "sigma": 0.9 if math.isfinite(eps) else 0.0,
            "n": {"sst2": 4}, "per_example": {"sst2": {"column": "SST-2", "correct": correct, "rows": "r"}}}


def _runs(root: Path, seeds=(42, 43)) -> list[Path]:
    for seed in seeds:
        runner.execute(load_job(["experiment=table2", "scale=smoke", f"results_dir={root}", "logging=disabled",
                            "suite=glue8", "method=adamw", "privacy=eps6", f"seed={seed}"]), stub)
    return sorted(p for p in (root / "runs").iterdir() if p.is_dir() and not p.name.startswith("_"))


def _table(root: Path):
    result = build_table(SPECS["table2"], read_run_folders(root / "runs", "table2"), scale="embedded")
    row = result.frame[(result.frame["Setting"] == "ε=6") & (result.frame["Method"] == "AdamW")].iloc[0]
    return result, row


def _seed_42(runs: list[Path]) -> Path:
    return next(r for r in runs if yaml.safe_load((r / "config.yaml").read_text())["seed"] == 42)


def _edit(folder: Path, change) -> None:
    final = json.loads((folder / "final.json").read_text())
    change(final)
    (folder / "final.json").write_text(json.dumps(final))


@pytest.mark.parametrize("field", ["run", "epsilon_spent", "per_example", "run.git_commit"])
def test_a_record_missing_a_field_is_refused_in_one_line(tmp_path: Path, field: str) -> None:
    runs = _runs(tmp_path)
    if field == "run.git_commit":
        _edit(runs[0], lambda f: f["run"].pop("git_commit"))
        expected = "`run` block lacks `git_commit`"
    elif field == "run":
        _edit(runs[0], lambda f: f.pop("run"))
        expected = "final.json has no `run` block"
    else:
        _edit(runs[0], lambda f: f.pop(field))
        expected = f"final.json lacks `{field}`"
    result, row = _table(tmp_path)
    assert row["SST-2_n"] == 1  # the other seed only
    assert row["SST-2"] == (0.25 if runs[0] == _seed_42(runs) else 0.75)  # the other seed's value
    refused = [m for m in result.missing if expected in m]
    assert len(refused) == 1 and str(runs[0]) in refused[0]


def test_a_realised_epsilon_above_the_cell_is_refused(tmp_path: Path) -> None:
    runs = _runs(tmp_path)
    _edit(runs[0], lambda f: f.update(epsilon_spent=60.0))
    result, row = _table(tmp_path)
    assert row["SST-2_n"] == 1
    assert any("realised ε=60" in m and str(runs[0]) in m for m in result.missing)


MISTYPED = {  # a field of the core's record given a value of another type -> what its one line says
    "sigma as text": (lambda f: f.update(sigma="0.9"), "final.json's `sigma` is str, not a number"),
    "a count as a list": (lambda f: f.update(n_train=[32]), "final.json's `n_train` is list, not an integer"),
    "outcomes as text": (lambda f: f["per_example"]["sst2"].update(correct="1011"),
                         "final.json's `per_example` of sst2's `correct` is str, not a list"),
}


@pytest.mark.parametrize("case", list(MISTYPED))
def test_a_record_that_does_not_parse_into_its_type_is_refused_not_averaged(tmp_path: Path, case: str) -> None:
    runs = _runs(tmp_path)
    change, expected = MISTYPED[case]
    _edit(runs[0], change)
    result, row = _table(tmp_path)
    assert row["SST-2_n"] == 1
    assert row["SST-2"] == (0.25 if runs[0] == _seed_42(runs) else 0.75)  # the other seed's value
    refused = [m for m in result.missing if expected in m]
    assert len(refused) == 1 and str(runs[0]) in refused[0] and "refused" in refused[0]


CONTRADICTIONS = {  # a record's fields against each other or its row (ε = 6) -> what its one line says
    "epsilon far below the row": (lambda f: f.update(epsilon_spent=1.5), "realised ε=1.5 is more than 0.03 below"),
    "no noise beside a finite ε": (lambda f: f.update(sigma=0.0), "σ=0 (no noise) beside the row's ε=6"),
    "an outcome outside 0/1": (lambda f: f["per_example"]["sst2"].update(correct=[1, 0, 2, 1]),
                               "correct=2 is not 0 or 1"),
    "fewer outcomes than rows": (lambda f: f["per_example"]["sst2"].update(correct=[1, 0, 1]),
                                 "3 rows of outcomes, but the evaluation scored 4"),
}


@pytest.mark.parametrize("case", list(CONTRADICTIONS))
def test_a_record_that_contradicts_itself_or_its_row_is_refused_in_one_line(tmp_path: Path, case: str) -> None:
    """The runner's record, one field damaged: the run is left out in one line naming it, the other seed
    (its realised ε 0.01 below the row's, as calibration leaves it) is averaged."""
    runs = _runs(tmp_path)
    change, expected = CONTRADICTIONS[case]
    _edit(runs[0], change)
    result, row = _table(tmp_path)
    assert row["SST-2_n"] == 1
    assert row["SST-2"] == (0.25 if runs[0] == _seed_42(runs) else 0.75)  # the other seed's value
    refused = [m for m in result.missing if str(runs[0]) in m]
    assert len(refused) == 1 and expected in refused[0] and "\n" not in refused[0]


def test_a_copied_run_is_refused_and_a_run_listed_twice_counts_once(tmp_path: Path) -> None:
    runs = _runs(tmp_path)
    copy = runs[0].parent / "0123456789ab"
    shutil.copytree(runs[0], copy)
    store.tag(runs[0].parent, "table2", copy.name)
    result, row = _table(tmp_path)
    assert row["SST-2_n"] == 2  # two seeds, not three runs
    assert sum("duplicates run" in m for m in result.missing) == 1
    records = read_run_folders(tmp_path / "runs", "table2")
    twice = build_table(SPECS["table2"], [*records, *records], scale="embedded")
    assert twice.frame.equals(result.frame)


def test_runs_from_commits_whose_mechanism_differs_are_flagged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commits = iter([("0" * 40, False), ("1" * 40, False)])  # unknown to git: it cannot say prism/ is the same
    monkeypatch.setattr(runner, "git_state", lambda: next(commits))
    _runs(tmp_path)
    result, _ = _table(tmp_path)
    assert any("MIXED CODE" in w and "0000000000, 1111111111" in w for w in result.warnings)
