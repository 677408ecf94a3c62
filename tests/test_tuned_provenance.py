"""A learning rate's provenance is recorded when the job is composed (``train.lr_source``: the tuned-rate file and
the sha256 of the entry that set ``method.lr``), kept out of the run hash, and read back from the run's stored
config: a later ``make tune`` that rewrites the file changes neither what an earlier run records nor the rate
statement of its table; a run stored before the key existed is shown as "not recorded", never looked up in
today's file."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from pipelines.__main__ import main as cli
from pipelines.config.identity import run_hash
from pipelines.config.tuned_rates import TUNING_COST, cell_fields
from pipelines.config.validate import ConfigError, load_job
from pipelines.runs import store
from pipelines.runs.runner import execute
from pipelines.tables.records import read_run_folder

JOB = ["experiment=table2", "scale=smoke", "method=adamw", "privacy=eps6", "suite=glue8", "logging=disabled"]


def _tuned_file(folder: Path, lr: float, seeds: list[int]) -> tuple[Path, dict]:
    """``<folder>/smoke.yaml`` with one entry, every field written with its type, for JOB's cell at rate ``lr``."""
    folder.mkdir(exist_ok=True)
    fields = cell_fields(load_job(JOB))  # the cell as the composed job states it
    entry = {**fields, "lr": lr, "factor": 1.0, "default_lr": 0.002, "validation_score": 0.5,
             "validation_se": 0.01, "at_edge": False}
    generated = {"seeds": seeds, "suites": [fields["suite"]], "methods": [fields["method"]],
                 "epsilons": [fields["epsilon"]]}
    path = folder / "smoke.yaml"
    path.write_text(yaml.safe_dump({"generated": generated, "rates": [entry]}))
    return path, entry


def _sha256(entry: dict) -> str:
    return hashlib.sha256(json.dumps(entry, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()).hexdigest()


def _trained(cfg) -> Path:
    """The run folder of ``cfg`` after the runner trained it with a stub trainer."""
    def stub(cfg, folder, log_fn) -> dict:
        log_fn({"step": 1})
        return {"columns": {"SST-2": 0.5}, "average": 0.5, "n_train": 32, "epsilon_spent": 5.99,
                "per_example": {"sst2": {"column": "SST-2", "correct": [1, 0], "rows": "r"}}}

    assert execute(cfg, stub) == "finished"
    return store.find_run(store.runs_root(cfg), run_hash(cfg))


def _rate_lines(results: Path) -> list[str]:
    """The table's privacy statement and its tuning lines, as ``make tables`` writes them."""
    out = results / "tables"
    assert cli(["aggregate", "experiment=table2", f"runs_dir={results / 'runs'}", f"out_dir={out}",
                "scale=embedded"]) == 0
    text = (out / "table2.embedded.md").read_text()
    return [line for line in text.splitlines() if "Privacy:" in line or "tuning" in line or "tuned" in line]


def test_a_runs_rate_source_and_its_table_statement_outlive_a_retune(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRISM_TUNED_DIR", str(tmp_path / "tuned"))
    path, entry = _tuned_file(tmp_path / "tuned", 0.0123, [7])
    cfg = load_job([*JOB, f"results_dir={tmp_path / 'r'}"])
    assert cfg.method.lr == 0.0123
    recorded = {"file": str(path), "entry_sha256": _sha256(entry), "seeds": [7]}
    assert OmegaConf.to_container(cfg.train.lr_source) == recorded
    folder = _trained(cfg)
    before = _rate_lines(tmp_path / "r")
    assert any(TUNING_COST.format(n=1) in line for line in before) and any("seeds [7]" in line for line in before)

    _tuned_file(tmp_path / "tuned", 0.05, [8])  # a later `make tune` chose another rate on other seeds
    assert load_job([*JOB, f"results_dir={tmp_path / 'r'}"]).method.lr == 0.05  # new runs read the new file
    assert read_run_folder(folder).config["train"]["lr_source"] == recorded  # the run's stored config
    assert _rate_lines(tmp_path / "r") == before


def test_the_rate_source_is_not_part_of_the_run_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRISM_TUNED_DIR", str(tmp_path / "tuned"))
    _tuned_file(tmp_path / "tuned", 0.0123, [7])
    cfg = OmegaConf.to_container(load_job(JOB))
    assert cfg["train"]["lr_source"] is not None
    without = {**cfg, "train": {k: v for k, v in cfg["train"].items() if k != "lr_source"}}
    assert run_hash(cfg) == run_hash(without)
    assert run_hash(cfg) != run_hash({**without, "method": {**cfg["method"], "lr": 0.05}})  # the rate is hashed


def test_a_run_stored_without_a_rate_source_is_shown_as_not_recorded(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An older store: the run's config has no ``train.lr_source``. Today's file has its cell at its very rate,
    yet the table does not count it as tuned: whether it was is not recorded, and the statement says so."""
    monkeypatch.setenv("PRISM_TUNED_DIR", str(tmp_path / "tuned"))
    _tuned_file(tmp_path / "tuned", 0.0123, [7])
    folder = _trained(load_job([*JOB, f"results_dir={tmp_path / 'r'}"]))
    older = yaml.safe_load((folder / "config.yaml").read_text())
    del older["train"]["lr_source"]
    (folder / "config.yaml").write_text(yaml.safe_dump(older))
    lines = _rate_lines(tmp_path / "r")
    assert not any(TUNING_COST.format(n=1) in line for line in lines), lines
    assert any("whether `make tune` chose the rates of 1 of the 1 private runs is not recorded" in line
               for line in lines), lines


def test_a_typed_rate_source_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^train\.lr_source=null: train\.lr_source records which tuned entry"):
        load_job([*JOB, "train.lr_source=null"])


def test_a_rate_without_a_tuned_entry_records_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default rate, a sweep's multiple of it and a typed rate: no tuned entry set them."""
    monkeypatch.setenv("PRISM_TUNED_DIR", str(tmp_path / "tuned"))
    _tuned_file(tmp_path / "tuned", 0.0123, [7])
    for job in ([*JOB, "suite=math10k"], [*JOB, "method.lr=0.5"], ["experiment=tune", *JOB[1:], "tune.lr_factor=1.0"]):
        cfg = load_job(job)
        assert "lr_source" in cfg.train and cfg.train.lr_source is None, job
    assert not math.isclose(load_job([*JOB, "suite=math10k"]).method.lr, 0.0123)
