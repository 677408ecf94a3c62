"""The training loop end to end on a tiny random-config model: DP semantics that only show at loop level."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import adapter_tensors, tiny_cfg

from prism import train as T
from prism.privacy import epsilon_spent


@pytest.mark.parametrize("method", ["prism", "adamw"])
def test_dp_run_end_to_end(tmp_path: Path, method: str) -> None:
    cfg = tiny_cfg(f"method={method}", "privacy=eps6", "suite.embedded.unscored=[]")  # both stand-ins scored
    log: list[dict] = []
    final = T.train_and_evaluate(cfg, tmp_path, log.append)
    assert [r["step"] for r in log] == [1, 2, 3]
    # σ was calibrated for exactly these 3 steps at q = B/N: the realised ε is at (not above) the target
    q = 8 / 32
    assert final["sample_rate"] == pytest.approx(q)
    assert final["epsilon_spent"] <= 6.0 + 1e-9
    assert final["epsilon_spent"] == pytest.approx(epsilon_spent(final["sigma"], q, 3, 1e-5), rel=1e-6)
    assert final["epsilon_spent"] > 5.9
    assert all(0.0 <= r["clip_fraction"] <= 1.0 for r in log if r["batch_size"])
    assert set(final["columns"]) == {"SST-2", "RTE"}
    assert adapter_tensors(tmp_path)


def test_non_dp_run_has_no_noise_and_infinite_epsilon(tmp_path: Path) -> None:
    cfg = tiny_cfg("method=adamw", "privacy=nondp")
    log: list[dict] = []
    final = T.train_and_evaluate(cfg, tmp_path, log.append)
    assert final["sigma"] == 0.0 and math.isinf(final["epsilon_spent"])
    assert all(r.get("noise_norm", 0.0) == 0.0 for r in log)


def _params_after(cfg, tmp_path: Path) -> dict[str, torch.Tensor]:
    setup = T.build(cfg)
    for _ in range(cfg.train.steps):
        T.train_step(setup, cfg)
    return {k: v.detach().clone() for k, v in setup.params.items()}


@pytest.mark.parametrize("method", ["prism", "adamw"])
def test_micro_batch_size_does_not_change_the_update(tmp_path: Path, method: str) -> None:
    """Physical micro-batches only bound memory: clipped sums add up, noise is drawn once per step."""
    base = ("backbone.dtype=float64", f"method={method}", "privacy=eps3", "train.steps=2")
    if method == "prism":
        base = (*base, "method.compute_dtype=float64")
    results = [_params_after(tiny_cfg(*base, f"train.micro_batch_size={k}"), tmp_path) for k in (1, 2, 4)]
    for other in results[1:]:
        for name, value in results[0].items():
            torch.testing.assert_close(other[name], value, rtol=1e-9, atol=1e-12)


def test_resume_after_interruption_is_bitwise_identical(tmp_path: Path) -> None:
    cfg = tiny_cfg("method=prism", "privacy=eps6", "train.steps=4", "train.checkpoint_every=2")
    T.train_and_evaluate(cfg, tmp_path / "straight")

    class KilledError(Exception):
        pass

    def kill_at_step_3(record: dict) -> None:
        if record["step"] == 3:
            raise KilledError

    interrupted = tmp_path / "interrupted"
    with pytest.raises(KilledError):
        T.train_and_evaluate(cfg, interrupted, kill_at_step_3)
    resumed_log: list[dict] = []
    final = T.train_and_evaluate(cfg, interrupted, resumed_log.append)
    assert [r["step"] for r in resumed_log] == [3, 4]  # resumed from the step-2 checkpoint
    straight, resumed = adapter_tensors(tmp_path / "straight"), adapter_tensors(interrupted)
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    assert final["epsilon_spent"] == pytest.approx(epsilon_spent(final["sigma"], 8 / 32, 4, 1e-5), rel=1e-6)


def test_divergence_stops_the_run_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    cfg = tiny_cfg("method=adamw", "privacy=nondp", "method.lr=1e30", "train.steps=4")
    with pytest.raises(T.TrainingDivergedError, match="non-finite"):
        T.train_and_evaluate(cfg, tmp_path)
    # the checkpoint on disk is from a step before the failure and holds finite weights only
    state = torch.load(tmp_path / "checkpoint" / "state.pt", weights_only=False)
    assert all(torch.isfinite(v).all() for v in state["params"].values())


def test_batch_larger_than_dataset_fails_before_training(tmp_path: Path) -> None:
    cfg = tiny_cfg("train.batch_size=64")
    with pytest.raises(ValueError, match="lower train.batch_size"):
        T.train_and_evaluate(cfg, tmp_path)
    assert not (tmp_path / "checkpoint").exists()


def test_prefix_cache_trains_exactly_like_the_full_forward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cached frozen prefix is an optimisation only: same losses, same updates."""
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path / "cache"))
    common = ("backbone.lora_layers=1", "method=prism", "privacy=eps6", "train.steps=2")
    cached_cfg = tiny_cfg(*common, "train.prefix_cache=auto")
    setup = T.build(cached_cfg)
    assert setup.prefix is not None and setup.prefix.depth == 1
    cached = [float(T.train_step(setup, cached_cfg)["loss"]) for _ in range(2)]
    cached_params = {k: v.detach().clone() for k, v in setup.params.items()}
    full_cfg = tiny_cfg(*common, "train.prefix_cache=off")
    setup = T.build(full_cfg)
    assert setup.prefix is None
    full = [float(T.train_step(setup, full_cfg)["loss"]) for _ in range(2)]
    assert cached == pytest.approx(full, rel=1e-5)
    for name, value in cached_params.items():
        torch.testing.assert_close(setup.params[name].detach(), value, rtol=1e-4, atol=1e-6)


def test_a_non_finite_loss_stops_the_step_after_one_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The once-per-step check sees a NaN loss even when the gradients and the update are finite."""
    setup = T.build(tiny_cfg("method=adamw", "privacy=nondp"))
    gradients = setup.gradients

    def nan_loss(batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, grads = gradients(batch)
        return torch.full_like(loss, math.nan), grads

    setup.gradients = nan_loss
    with pytest.raises(T.TrainingDivergedError, match="non-finite loss"):
        T.train_step(setup, tiny_cfg("method=adamw", "privacy=nondp"))
