"""The core's record (prism/record.py): ``final.json`` written through :class:`FinalRecord` keeps the fields,
order and values the trainer wrote before the type existed, and a stored record parses back to the same bytes."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import fake_setup, tiny_cfg, tiny_pair_params

from pipelines.runs import store
from prism import train as T
from prism.record import FinalRecord, RecordError

# A finished paper-format record as the trainer and the runner wrote it (every kind of field: a null prefix depth,
# ε = ∞, a NaN, a selection block, a user task's Macro-F1 outcomes and metrics), in the order they wrote it.
STORED = {
    "sigma": 0.0, "sample_rate": 0.25, "steps": 3, "empty_batches": 0, "n_train": 32, "epsilon_spent": math.inf,
    "peak_memory_mb": 0.0, "train_time_s": 1.5, "prefix_depth": None, "prefix_build_s": 0.0,
    "protocol": {"name": "corrected", "items": {"D1": "exact"}, "dp_guarantee": "non-private", "dp_caveats": []},
    "step_time_s": math.nan, "best_step": 2,
    "selection": {"score": 3.25, "rows": 6, "candidate": 1, "mean": 3.0, "shape": 1.0, "score_noise": 5.0,
                  "sigma": 0.9, "epsilon": 5.5},
    "scores": {"t": 0.5}, "parse_failure": {"t": 0.0}, "n": {"t": 4}, "skipped": {"t": 0}, "samples": {"t": ["a"]},
    "seconds": {"t": 0.1}, "eval_rows": {"t": 4},
    "per_example": {"t": {"column": "Accuracy", "correct": [1, 0, 1, 0], "rows": "ab"},
                    "t/Macro-F1": {"column": "Macro-F1", "pred": [0, 1, -1, 1], "gold": [0, 1, 1, 1], "labels": 2,
                                   "rows": "ab"}},
    "metrics": {"t": {"Accuracy": 0.5, "Macro-F1": 0.4}}, "unparseable": {"t": 1},
    "columns": {"Accuracy": 0.5, "Macro-F1": 0.4}, "average": 0.5, "suite": "custom", "scale": "embedded",
    "data": {"train": "f.jsonl"}, "wall_time_s": 2.0,
    "run": {"hash": "0123456789ab", "experiment": "adhoc", "attempts": 1, "versions": {}, "git_commit": None,
            "git_dirty": None, "hostname": "h"},
}


def test_a_stored_record_parses_and_writes_back_to_the_same_bytes(tmp_path: Path) -> None:
    store.write_json_atomic(tmp_path / "before.json", STORED)
    record, run = store.read_final(store.read_json(tmp_path / "before.json"))
    assert list(record.to_json()) == [k for k in STORED if k != "run"]  # the trainer's order
    store.write_json_atomic(tmp_path / "after.json", {**record.to_json(), store.RunBlock.KEY: run.to_json()})
    assert (tmp_path / "after.json").read_bytes() == (tmp_path / "before.json").read_bytes()


def test_the_trainer_returns_the_fields_it_returned_before_in_that_order(tmp_path: Path, monkeypatch) -> None:
    """A Table 5 benchmark run (no evaluation) of the real loop on a stand-in setup."""
    monkeypatch.setattr(T, "build", lambda cfg, **_: fake_setup(tiny_pair_params(6)))
    monkeypatch.setattr(T, "micro_batch", lambda s, indices, *_: indices)
    cfg = tiny_cfg("method=prism", "privacy=eps6", "train.batch_size=4", "train.micro_batch_size=2", "train.steps=4",
                   "train.benchmark={warmup:0,measure:4}", "train.padding_side=right", "privacy.denominator=expected",
                   "privacy.log_private_stats=true")
    final = T.train_and_evaluate(cfg, tmp_path)
    assert list(final) == ["sigma", "sample_rate", "steps", "empty_batches", "n_train", "epsilon_spent",
                           "peak_memory_mb", "train_time_s", "prefix_depth", "prefix_build_s", "protocol", "step_time_s",
                           "wall_time_s"]
    assert json.dumps(FinalRecord.from_json(final).to_json()) == json.dumps(final)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("sigma", "0.9", "final.json's `sigma` is str, not a number"),
    ("steps", 2.5, "final.json's `steps` is float, not an integer"),
    ("n", [4], "final.json's `n` is list, not a mapping"),
    ("selection", {"score": "high", "rows": 6, "candidate": 1, "mean": 3.0, "shape": 1.0, "score_noise": 5.0,
                   "sigma": 0.9, "epsilon": 5.5}, "final.json's `selection` block's `score` is str, not a number"),
])
def test_a_field_of_another_type_is_a_record_error_naming_it(field: str, value: object, message: str) -> None:
    with pytest.raises(RecordError) as err:
        FinalRecord.from_json({**STORED, field: value})
    assert str(err.value) == message
