"""The config schema (pipelines/config/schema.py, docs/DECISIONS.md D78): one dataclass per config group
registered in Hydra's ConfigStore, adding no key to a job config; each job composed and validated once;
the tuned-rate files read through their schema, a bad file one line naming its line and the fix."""
from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

import prism.data.config
import prism.job
from pipelines.config import compose, validate
from pipelines.config.compose import job_config
from pipelines.config.schema import ConfigError, JobConfig, conform, record
from pipelines.runs import launch, runner, store, worker
from pipelines.verbs import run
from prism.data.config import DecodingConfig, EmbeddedDataConfig
from prism.methods.schema import AdamWConfig

TUNED = Path(__file__).resolve().parents[1] / "conf" / "tuned" / "embedded.yaml"


def _schemas(node: type) -> list[type]:
    """``node`` and every dataclass its fields hold (nested groups)."""
    out = [node]
    for f in fields(node):
        for kind in re.findall(r"\w+Config", str(f.type)):
            cls = vars(prism.job).get(kind) or vars(prism.data.config)[kind]
            if is_dataclass(cls) and cls not in out:
                out += [c for c in _schemas(cls) if c not in out]
    return out


def test_every_group_is_registered_and_every_field_has_help() -> None:
    repo = ConfigStore.instance().repo
    assert "job_schema.yaml" in repo
    assert {"backbone.yaml", "suite.yaml", "privacy.yaml", "lora.yaml", "train.yaml", "protocol.yaml",
            "logging.yaml", "tune.yaml"} <= set(repo["schema"])
    for cls in _schemas(JobConfig):
        for f in fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"


@pytest.mark.parametrize("job", [[], ["experiment=table5"], ["experiment=tune", "method=lamb"], ["protocol=released"],
                                 ["experiment=diagnostics"], ["scale=paper", "suite=math10k"]])
def test_the_schema_adds_no_key_and_changes_no_hash(job: list[str]) -> None:
    cfg = job_config(job)
    typed = record(cfg)
    assert OmegaConf.to_container(typed) == OmegaConf.to_container(cfg)
    assert store.run_hash(typed) == store.run_hash(cfg)
    assert isinstance(conform(cfg), JobConfig)


def test_conform_hands_prism_the_typed_job_and_the_hash_reads_only_the_yaml_keys() -> None:
    """``conform`` builds the dataclass tree prism reads (the method node as its method's own dataclass, an
    int given for a float that float); a key no yaml sets takes its dataclass default there and stays out
    of ``record``, the config the run hash reads."""
    cfg = job_config(["suite=math10k", "method=adamw", "method.lr=1"])
    job = conform(cfg)
    assert isinstance(job, JobConfig) and isinstance(job.method, AdamWConfig)
    assert isinstance(job.suite.decoding, DecodingConfig)
    assert isinstance(job.suite.embedded, EmbeddedDataConfig)
    assert type(job.method.lr) is float and job.method.lr == 1.0
    assert job.method.betas == tuple(cfg.method.betas)
    assert job.suite.embedded.tasks == list(cfg.suite.embedded.tasks)
    assert "eval_split" not in cfg.suite and job.suite.eval_split == "test"
    assert "min_confidence" not in cfg.suite.embedded and job.suite.embedded.min_confidence == 0.8
    kept = record(cfg)
    assert type(kept.method.lr) is float and "eval_split" not in kept.suite
    assert store.run_hash(kept) == store.run_hash(OmegaConf.merge(cfg, {"method": {"lr": 1.0}}))


def test_an_int_for_a_float_is_that_float_and_a_float_for_an_int_is_refused() -> None:
    assert type(validate.load_job(["privacy.clip_norm=2"]).privacy.clip_norm) is float
    assert type(validate.load_job(["method=prism", "method.floor_factor=1"]).method.floor_factor) is float
    with pytest.raises(ConfigError, match=r"^lora.alpha must be an integer"):
        validate.load_job(["lora.alpha=2.5"])


def _stub(cfg: Any, folder: Path, log_fn: Any, load: Any = None) -> dict[str, Any]:
    log_fn({"step": 1, "loss": 1.0})
    return {"columns": {"SST-2": 0.5}, "average": 0.5}


def test_a_grid_job_and_a_single_run_are_composed_and_validated_once(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The grid process composes and validates each job once; its worker runs that config as is. A
    single ``pipelines.runs.runner`` composes and validates once too."""
    counts: Counter[str] = Counter()
    compose_job, check = compose.compose_job, validate.check

    def counted_compose(overrides: Any) -> Any:
        counts["compose"] += 1
        return compose_job(overrides)

    def counted_check(cfg: Any, *, here: bool = True) -> Any:
        counts["check"] += 1
        return check(cfg, here=here)

    monkeypatch.setattr(compose, "compose_job", counted_compose)
    monkeypatch.setattr(validate, "check", counted_check)
    monkeypatch.setattr(runner, "default_trainer", _stub)
    monkeypatch.setattr(worker, "_kept", object())  # no backbone: the stub trainer loads none
    handlers, level = logging.root.handlers[:], logging.root.level
    try:
        pending, finished = launch.plan("table2", ["scale=smoke", "method=adamw,prism", "privacy=eps6", "suite=glue8",
                                                   "logging=disabled", f"results_dir={tmp_path}"])
        # two cells and the suite's 0-step reference run
        assert (len(pending), len(finished)) == (3, 0) and counts == {"compose": 3, "check": 3}
        for job in pending:
            assert worker.run_job(job.cfg, str(tmp_path / f"{job.run_hash}.log")) == 0
            assert store.inspect_run(job.folder).state == "finished"
        assert counts == {"compose": 3, "check": 3}
        counts.clear()
        assert run.command(["scale=smoke", "method=lamb", "logging=disabled", f"results_dir={tmp_path}"]) == 0
        assert counts == {"compose": 1, "check": 1}
    finally:
        logging.root.handlers[:], logging.root.level = handlers, level


# ------------------------------------------------------------------------------------ tuned rates
def _tuned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: Any) -> tuple[Path, list[str]]:
    """conf/tuned/embedded.yaml with ``edit`` applied to its lines, as the only tuned file read."""
    lines = TUNED.read_text().splitlines()
    edit(lines)
    folder = tmp_path / "tuned"
    folder.mkdir()
    (folder / "embedded.yaml").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("PRISM_TUNED_DIR", str(folder))
    return folder / "embedded.yaml", lines


def _refusal(tmp_path: Path) -> str:
    with pytest.raises(ConfigError) as err:
        validate.load_job(["method=adamw", f"results_dir={tmp_path / 'results'}"])
    message = str(err.value)
    assert "\n" not in message and "make tune" in message
    return message


def _line(lines: list[str], text: str, start: int = 0) -> int:
    return next(i for i in range(start, len(lines)) if lines[i] == text) + 1


def test_the_committed_tuned_file_reads_clean_and_sets_the_rates() -> None:
    entries = yaml.safe_load(TUNED.read_text())["rates"]
    want = next(e["lr"] for e in entries if (e["method"], e["suite"], e["epsilon"]) == ("adamw", "math10k", 3.0))
    cfg = validate.load_job(["method=adamw", "privacy=eps3", "suite=math10k"])
    assert cfg.method.lr == pytest.approx(want)


def _entry_lines(lines: list[str]) -> int:
    """Lines per entry of the tuned file: the distance between its first two entries."""
    starts = [i for i, text in enumerate(lines) if text.startswith("- method: ")]
    return starts[1] - starts[0]


def test_a_tuned_value_of_the_wrong_type_names_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def edit(lines: list[str]) -> None:
        lines[_line(lines, "  epsilon: 6.0") - 1] = "  epsilon: three"

    path, lines = _tuned(tmp_path, monkeypatch, edit)
    message = _refusal(tmp_path)
    assert message.startswith(f"{path}:{_line(lines, '  epsilon: three')}: ") and "epsilon='three' must be a number" in message


def test_an_unknown_tuned_key_names_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def edit(lines: list[str]) -> None:
        lines.insert(_line(lines, next(text for text in lines if text.startswith("  lr: "))), "  learning_rate: 0.1")

    path, lines = _tuned(tmp_path, monkeypatch, edit)
    message = _refusal(tmp_path)
    assert message.startswith(f"{path}:{_line(lines, '  learning_rate: 0.1')}: unknown key learning_rate")


def test_a_duplicated_tuned_cell_names_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def edit(lines: list[str]) -> None:
        first = _line(lines, "- method: adamw") - 1
        lines.extend(lines[first:first + _entry_lines(lines)])  # the first entry again, at the end

    path, lines = _tuned(tmp_path, monkeypatch, edit)
    copy = max(i for i, text in enumerate(lines) if text == "- method: adamw") + 1
    message = _refusal(tmp_path)
    assert message.startswith(f"{path}:{copy}: a second entry for the cell of line {_line(lines, '- method: adamw')}")


def test_a_missing_tuned_cell_is_refused_not_run_at_the_default_rate(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def edit(lines: list[str]) -> None:  # the entry of prism, glue8, ε = 6
        start = next(i for i in range(len(lines)) if lines[i] == "- method: prism" and lines[i + 3] == "  epsilon: 6.0")
        del lines[start:start + _entry_lines(lines)]

    path, lines = _tuned(tmp_path, monkeypatch, edit)
    message = _refusal(tmp_path)
    assert message.startswith(f"{path}:{_line(lines, 'rates:')}: rates has no entry for method=prism epsilon=6 "
                              "suite=glue8")
    assert "default rate" in message


def _drop_entries(keep: Any) -> Any:
    """An edit deleting every entry whose (method, ε) ``keep`` rejects."""
    def edit(lines: list[str]) -> None:
        size = _entry_lines(lines)
        starts = [i for i, text in enumerate(lines) if text.startswith("- method: ")]
        for start in reversed(starts):
            if not keep(lines[start].split(": ")[1], lines[start + 3].split(": ")[1]):
                del lines[start:start + size]
    return edit


def _no_rates(lines: list[str]) -> None:
    del lines[_line(lines, "rates:"):]
    lines[-1] = "rates: []"


@pytest.mark.parametrize(("edit", "first_missing"), [
    (_drop_entries(lambda method, eps: method != "ffa"), "method=ffa epsilon=3 suite=glue8"),
    (_drop_entries(lambda method, eps: eps != "6.0"), "method=adamw epsilon=6 suite=glue8"),
    (_no_rates, "method=adamw epsilon=3 suite=glue8"),
], ids=["one method removed", "one epsilon removed", "rates: []"])
def test_a_tuned_file_short_of_the_grid_it_covers_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               edit: Any, first_missing: str) -> None:
    """The committed file covers glue8, math10k × six methods × ε 3, 6, ∞ (its `generated`); with a whole
    method, a whole ε or every entry removed, a cell of that grid would run at the default rate."""
    path, lines = _tuned(tmp_path, monkeypatch, edit)
    message = _refusal(tmp_path)
    assert message.startswith(f"{path}:{_line(lines, 'rates: []' if edit is _no_rates else 'rates:')}: rates has no "
                              f"entry for {first_missing}")
    assert "default rate" in message and "python -m pipelines tune scale=embedded" in message


def test_a_tuned_file_that_does_not_say_what_it_covers_is_refused(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def edit(lines: list[str]) -> None:
        start = _line(lines, "  methods:") - 1
        del lines[start:_line(lines, "  epsilons:") - 1]

    path, lines = _tuned(tmp_path, monkeypatch, edit)
    message = _refusal(tmp_path)
    assert message.startswith(f"{path}:{_line(lines, 'generated:')}: generated.methods is missing")
