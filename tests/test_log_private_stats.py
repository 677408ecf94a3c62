"""``privacy.log_private_stats: false`` keeps the statistics of un-noised data out of every logged record
and out of ``final.json`` (docs/PRIVACY.md, "What ε does not cover"); the times of the run itself:
tests/test_untimed_private_runs.py."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import fake_setup, tiny_cfg, tiny_pair_params

from prism import train as T
from prism.record import PRIVATE_FINAL


@pytest.mark.parametrize("log_private_stats", [True, False])
def test_log_private_stats_false_drops_unnoised_statistics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_private_stats: bool
) -> None:
    """Every record handed to the metrics/W&B writer, and final.json, lack the private statistics."""
    monkeypatch.setattr(T, "build", lambda cfg, **_: fake_setup(tiny_pair_params(6)))
    monkeypatch.setattr(T, "micro_batch", lambda s, indices, *_: indices)
    cfg = tiny_cfg("method=prism", "privacy=eps6", "train.batch_size=4", "train.micro_batch_size=2", "train.steps=4",
                   "train.benchmark={warmup:0,measure:4}", "train.padding_side=right", "privacy.denominator=expected",
                   f"privacy.log_private_stats={str(log_private_stats).lower()}")
    records: list[dict] = []
    final = T.train_and_evaluate(cfg, tmp_path, records.append)
    logged = {key for record in records for key in record}
    assert len(records) == 4 and {"step", "sigma", "epsilon_spent", "update_norm"} <= logged
    private = {"loss", "clip_fraction", "grad_norm_mean", "noise_norm", "batch_size", "step_time_s"}
    if log_private_stats:
        # a benchmark run has no evaluation, hence no evaluation seconds
        assert private <= logged and set(PRIVATE_FINAL) - {"step_time_s", "seconds"} <= set(final)
    else:
        assert not private & logged and not set(PRIVATE_FINAL) & set(final)
