"""PRV accounting: golden values, calibration round trip, agreement with Google's PLD accountant."""
from __future__ import annotations

import io
import json
import math

import dp_accounting
import pytest
import torch
from opacus.accountants import PRVAccountant

from prism.privacy import Accountant, accounting, calibrate_sigma, calibration_steps, epsilon_spent, limits
from prism.privacy.accounting import calibrate_sigma_cached

DELTA = 1e-5
MATH_Q = 64 / 9919  # Math-10K: N = 9,919, B = 64
GLUE_Q = 64 / 10000  # GLUE8: N = 10,000, B = 64


def pld_epsilon(sigma: float, q: float, steps: int, delta: float = DELTA) -> float:
    """ε from dp-accounting's privacy-loss-distribution accountant, an independent implementation."""
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(event, steps)
    return accountant.get_epsilon(delta)


def test_prv_golden_value() -> None:
    # Known PRV value for this setting (the PRV accountant's standard example): ε ≈ 6.777.
    assert epsilon_spent(1.5, 0.04, 2250, DELTA) == pytest.approx(6.777, abs=0.02)


@pytest.mark.parametrize(
    ("sigma", "q", "steps"),
    # σ computed with prv-accountant (docs/DECISIONS.md D1) for the paper's grid: (Math, GLUE8) × (ε=6, ε=3)
    [(0.518, MATH_Q, 300), (0.643, MATH_Q, 300), (0.548, GLUE_Q, 500), (0.677, GLUE_Q, 500)],
)
def test_prv_agrees_with_dp_accounting_pld(sigma: float, q: float, steps: int) -> None:
    assert epsilon_spent(sigma, q, steps, DELTA) == pytest.approx(pld_epsilon(sigma, q, steps), abs=0.05)


def test_calibrate_then_spend_round_trips() -> None:
    target = 3.0
    sigma = calibrate_sigma(target, DELTA, MATH_Q, 300)
    eps = epsilon_spent(sigma, MATH_Q, 300, DELTA)
    assert target - 0.01 <= eps <= target
    assert pld_epsilon(sigma, MATH_Q, 300) == pytest.approx(target, abs=0.05)


def test_released_code_epoch_calibration_matches_reference_table() -> None:
    """docs/DECISIONS.md D1: Math-10K ε=6 calibrated for 310 steps gives σ≈0.518, ≈5.95 spent in 300."""
    steps = calibration_steps(300, MATH_Q, "epochs")
    assert steps == 310
    sigma = calibrate_sigma(6.0, DELTA, MATH_Q, steps)
    assert sigma == pytest.approx(0.518, abs=0.005)
    assert epsilon_spent(sigma, MATH_Q, 300, DELTA) == pytest.approx(5.95, abs=0.03)


@pytest.mark.parametrize(
    ("steps", "q", "mode", "expected"),
    [
        (300, MATH_Q, "exact", 300),
        (300, MATH_Q, "epochs", 310),  # ⌈9919/64⌉ = 155 batches per epoch, 2 epochs
        (500, GLUE_Q, "epochs", 628),  # ⌈10000/64⌉ = 157, 4 epochs
        (310, MATH_Q, "epochs", 310),
        (300, 64 / 9600, "epochs", 300),  # N/B = 150 exactly: no float round-up to 151
        (1, 0.5, "epochs", 2),
        (7, 1.0, "epochs", 7),
    ],
)
def test_calibration_steps(steps: int, q: float, mode: str, expected: int) -> None:
    assert calibration_steps(steps, q, mode) == expected


def test_infinite_epsilon_means_no_noise() -> None:
    assert calibrate_sigma(math.inf, DELTA, MATH_Q, 300) == 0.0
    assert epsilon_spent(0.0, MATH_Q, 300, DELTA) == math.inf


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epsilon": 0.0}, "privacy.epsilon"),
        ({"epsilon": -1.0}, "privacy.epsilon"),
        ({"delta": 0.0}, "privacy.delta"),
        ({"delta": 1.0}, "privacy.delta"),
        ({"sample_rate": 0.0}, "train.batch_size"),
        ({"sample_rate": 1.5}, "train.batch_size"),
        ({"steps": 0}, "train.steps"),
        ({"accountant": "moments"}, "prv"),
    ],
)
def test_calibrate_sigma_rejects_bad_input(kwargs: dict, match: str) -> None:
    args = {"epsilon": 6.0, "delta": DELTA, "sample_rate": MATH_Q, "steps": 300, **kwargs}
    with pytest.raises(ValueError, match=match):
        calibrate_sigma(**args)


def test_calibration_steps_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="privacy.calibration"):
        calibration_steps(300, MATH_Q, "rounded")


def test_accountant_matches_closed_history_and_resumes() -> None:
    sigma, q = 0.6, 0.01
    full = Accountant()
    assert full.epsilon(DELTA) == 0.0
    for _ in range(40):
        full.step(noise_multiplier=sigma, sample_rate=q)
    assert full.steps == 40
    assert full.epsilon(DELTA) == epsilon_spent(sigma, q, 40, DELTA)  # Opacus' plain PRV accountant

    first = Accountant()
    for _ in range(25):
        first.step(noise_multiplier=sigma, sample_rate=q)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = Accountant()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.epsilon(DELTA) == first.epsilon(DELTA)
    for _ in range(15):
        resumed.step(noise_multiplier=sigma, sample_rate=q)
    assert resumed.history == full.history
    assert resumed.epsilon(DELTA) == full.epsilon(DELTA)


def test_accountant_equals_opacus_prv_on_mixed_history() -> None:
    """The cached-RDP domain must reproduce Opacus' PRV ε exactly, also for a history with two (σ, q)."""
    accountant = Accountant()
    for sigma, q, steps in [(0.7, 0.02, 5), (1.1, 0.05, 3)]:
        for _ in range(steps):
            accountant.step(noise_multiplier=sigma, sample_rate=q)
    reference = PRVAccountant()
    reference.history = [(0.7, 0.02, 5), (1.1, 0.05, 3)]
    assert accountant.history == reference.history
    assert accountant.epsilon(DELTA) == reference.get_epsilon(DELTA)


def test_accountant_epsilon_grows_and_rejects_zero_noise() -> None:
    accountant = Accountant()
    accountant.step(noise_multiplier=0.6, sample_rate=0.01)
    one = accountant.epsilon(DELTA)
    accountant.step(noise_multiplier=0.6, sample_rate=0.01)
    assert accountant.epsilon(DELTA) > one > 0
    with pytest.raises(ValueError, match="non-DP"):
        accountant.step(noise_multiplier=0.0, sample_rate=0.01)


CACHED_QUESTION = (6.0, DELTA, 0.032, 30)


@pytest.fixture(scope="module")
def calibrated() -> float:
    """calibrate_sigma's σ for :data:`CACHED_QUESTION` (its binary search, ≈ 5 s, once per module)."""
    return calibrate_sigma(*CACHED_QUESTION)


def test_cached_calibration_is_the_same_sigma_and_trusts_no_stored_value(tmp_path, monkeypatch, calibrated) -> None:
    """The cache returns calibrate_sigma's σ bit for bit; a stored σ that would overspend ε, a file
    for another question or a corrupt file is recomputed and rewritten, and a valid file is not.

    The binary search runs once for real; the cache's later calls to it are counted (each returns that
    σ), so the test sees every recomputation without paying ≈ 5 s for each."""
    args, fresh = CACHED_QUESTION, calibrated
    calls: list[tuple] = []

    def counted(*call_args: object) -> float:
        calls.append(call_args)
        assert call_args[:4] == args
        return fresh

    monkeypatch.setattr(accounting, "calibrate_sigma", counted)
    assert calibrate_sigma_cached(*args, cache_dir=tmp_path) == fresh and len(calls) == 1
    (stored,) = tmp_path.glob("*.json")
    assert calibrate_sigma_cached(*args, cache_dir=tmp_path) == fresh  # read back, re-verified
    assert len(calls) == 1
    record = json.loads(stored.read_text())
    record["sigma"] = fresh / 2  # too little noise: ε(σ/2) > 6
    stored.write_text(json.dumps(record))
    assert epsilon_spent(fresh / 2, 0.032, 30, DELTA) > 6.0
    assert calibrate_sigma_cached(*args, cache_dir=tmp_path) == fresh and len(calls) == 2
    assert json.loads(stored.read_text())["sigma"] == fresh
    record = json.loads(stored.read_text())
    record["question"]["steps"] = 31  # a file that answers another question
    stored.write_text(json.dumps(record))
    assert calibrate_sigma_cached(*args, cache_dir=tmp_path) == fresh and len(calls) == 3
    stored.write_text("{not json")
    assert calibrate_sigma_cached(*args, cache_dir=tmp_path) == fresh and len(calls) == 4
    assert json.loads(stored.read_text())["sigma"] == fresh
    monkeypatch.undo()
    assert calibrate_sigma_cached(math.inf, DELTA, 0.032, 30, cache_dir=tmp_path) == 0.0


def test_a_cached_sigma_edited_upward_is_recomputed_not_trained_at(tmp_path, monkeypatch, calibrated) -> None:
    """A stored σ three times the calibrated one spends far less than the row's ε (the PRV accountant's
    ε at that σ): a run at it would be filed as ε = 6 with several times the noise, so it is recomputed."""
    args, fresh = CACHED_QUESTION, calibrated
    monkeypatch.setattr(accounting, "calibrate_sigma", lambda *a: fresh)  # the search's σ, as it returns it
    assert calibrate_sigma_cached(*args, cache_dir=tmp_path) == fresh
    (stored,) = tmp_path.glob("*.json")
    record = json.loads(stored.read_text())
    record["sigma"] = 3 * fresh
    stored.write_text(json.dumps(record))
    assert epsilon_spent(3 * fresh, 0.032, 30, DELTA) < 6.0 / 2  # the edited entry: ε far below its key's
    assert limits.is_calibrated(epsilon_spent(fresh, 0.032, 30, DELTA), 6.0)  # the written one: at its key's
    calls: list[tuple] = []
    monkeypatch.setattr(accounting, "calibrate_sigma", lambda *a: calls.append(a) or fresh)
    assert calibrate_sigma_cached(*args, cache_dir=tmp_path) == fresh and len(calls) == 1
    assert json.loads(stored.read_text())["sigma"] == fresh
