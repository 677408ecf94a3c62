"""``privacy.noise_source``: ``os`` draws the sampler's coins and the noise from ``os.urandom`` (no seed),
each unit normal the sum of four inverse-CDF normals, keeps no RNG state in checkpoints and checkpoints
every step before logging it; ``seeded`` continues its stream after a resume (docs/PRIVACY.md)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch
from conftest import F64, fake_setup, tiny_cfg, tiny_pair_params

from prism import train as T
from prism.privacy import PoissonSampler
from prism.privacy import noise as noise_mod


def test_os_noise_is_the_sum_of_four_inverse_cdf_normals_of_urandom_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``os.urandom`` replaced by known bytes: uniforms (b + ½)·2⁻⁵³ of the top 53 bits, normals
    Σ ndtri(u)/2 over four draws (scipy's ndtri as the reference); no torch generator is read."""
    data = np.random.default_rng(0).bytes(8 * 4 * 6)
    monkeypatch.setattr(noise_mod.os, "urandom", lambda n: data[:n])
    torch.manual_seed(0)
    draws = noise_mod.SecureNoise().normal((2, 3), torch.device("cpu"))
    bits = np.frombuffer(data, dtype=np.uint64) >> np.uint64(12)  # the top 52 bits of each 8 bytes
    u = (bits.astype(np.float64) + 0.5) * 2.0**-52
    expected = scipy.special.ndtri(u).reshape(4, 6).sum(0) / 2.0
    np.testing.assert_allclose(draws.numpy().reshape(-1), expected, rtol=1e-14, atol=1e-15)
    torch.manual_seed(1)  # the global RNG plays no part
    assert torch.equal(noise_mod.SecureNoise().normal((2, 3), torch.device("cpu")), draws)


@pytest.mark.parametrize("fill", [b"\xff", b"\x00"])
def test_os_noise_is_finite_for_the_extreme_urandom_bytes(monkeypatch: pytest.MonkeyPatch, fill: bytes) -> None:
    """All-ones bytes give the largest uniform, all-zeros the smallest: both lie strictly inside (0, 1),
    so every draw is finite, and the two extremes are mirror images (the uniform grid is symmetric)."""
    monkeypatch.setattr(noise_mod.os, "urandom", lambda n: fill * n)
    u = noise_mod.os_uniform(5).numpy()
    assert np.all((u > 0.0) & (u < 1.0))
    assert u[0] == (1.0 - 2.0**-53 if fill == b"\xff" else 2.0**-53)
    draws = noise_mod.SecureNoise().normal((5,), torch.device("cpu"))
    assert torch.isfinite(draws).all()
    monkeypatch.setattr(noise_mod.os, "urandom", lambda n: (b"\x00" if fill == b"\xff" else b"\xff") * n)
    assert torch.equal(noise_mod.SecureNoise().normal((5,), torch.device("cpu")), -draws)
    # the exact value: four copies of the normal quantile of the extreme uniform, summed and halved
    expected = 4 * scipy.special.ndtri(u[0]) / 2.0
    np.testing.assert_allclose(draws.numpy(), expected, rtol=1e-14)


def test_os_uniform_grid_is_symmetric_and_exact() -> None:
    """Every grid point (b + ½)·2⁻⁵² is exact in float64 and its mirror 1 − u is on the grid."""
    b = np.array([0, 1, 2**51, 2**52 - 2, 2**52 - 1], dtype=np.uint64)
    u = (b.astype(np.float64) + 0.5) * 2.0**-52
    mirror = ((np.uint64(2**52 - 1) - b).astype(np.float64) + 0.5) * 2.0**-52
    assert np.array_equal(1.0 - u, mirror)
    assert np.array_equal(np.floor(u * 2.0**52).astype(np.uint64), b)


def test_os_noise_has_the_standard_normal_law_and_never_repeats() -> None:
    x = noise_mod.SecureNoise().normal((100_000,), torch.device("cpu")).numpy()
    assert scipy.stats.kstest(x, "norm").pvalue > 1e-3
    assert not np.array_equal(x[:100], noise_mod.SecureNoise().normal((100,), torch.device("cpu")).numpy())


def test_os_sampler_draws_its_coins_from_urandom_and_has_no_state(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = noise_mod.os.urandom
    monkeypatch.setattr(noise_mod.os, "urandom", lambda n: calls.append(n) or real(n))
    sampler = PoissonSampler(1000, 100, generator_seed=None, secure=True)
    sizes = [len(sampler.sample()) for _ in range(200)]
    assert calls == [8 * 1000] * 200
    assert abs(np.mean(sizes) - 100) < 4 * math.sqrt(100 * 0.9 / 200)
    assert "generator" not in sampler.state_dict()


def test_seeded_torch_streams_collide_past_32_bits() -> None:
    """Why the OS source: torch's CPU generator keeps 32 bits of a 63-bit seed, so a seeded stream can be
    enumerated (2³² candidates), whatever the seed's width."""
    s = (12345 << 32) | 678
    a = torch.randn(5, generator=torch.Generator().manual_seed(s), dtype=F64)
    b = torch.randn(5, generator=torch.Generator().manual_seed(s & 0xFFFFFFFF), dtype=F64)
    assert torch.equal(a, b)


def test_os_noise_keeps_rng_states_out_of_checkpoints() -> None:
    for is_secure in (False, True):
        s = fake_setup(tiny_pair_params(7), secure=is_secure)
        state = T._state(s, 3)
        assert ("noise_rng" in state and "sampler" in state) is not is_secure
        resumed = fake_setup(tiny_pair_params(7), secure=is_secure)
        T._restore(resumed, state)
        if not is_secure:  # seeded: the noise stream continues where it stopped
            assert torch.equal(resumed.noise.generator.get_state(), s.noise.generator.get_state())


@pytest.mark.parametrize("source", ["seeded", "os"])
def test_os_noise_checkpoints_every_step_before_logging_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           source: str) -> None:
    """Order of checkpoint writes and logged lines: os noise writes step t's checkpoint before its line
    (so a kill never replays a logged step with fresh noise); seeded logs first (a replay is bitwise the
    same) and checkpoints every ``checkpoint_every`` steps."""
    secure = source == "os"
    setup = fake_setup(tiny_pair_params(6), secure=secure)
    setup.suite.eval, setup.model, setup.tokenizer = {}, None, None
    monkeypatch.setattr(T, "build", lambda cfg, **_: setup)
    monkeypatch.setattr(T, "micro_batch", lambda s, indices, *_: indices)
    events: list[tuple[str, int]] = []
    monkeypatch.setattr(T, "save_checkpoint", lambda path, state: events.append(("ckpt", state["step"])))
    monkeypatch.setattr(T, "evaluate_suite", lambda *a, **k: {})
    monkeypatch.setattr(T, "export_adapter", lambda *a, **k: None)
    cfg = tiny_cfg("method=prism", "privacy=eps6", "train.batch_size=4", "train.micro_batch_size=2", "train.steps=4",
                   "train.checkpoint_every=3", "train.eval_batch_size=2", "train.padding_side=right",
                   f"privacy.noise_source={source}", "privacy.denominator=expected", "privacy.log_private_stats=true")
    T.train_and_evaluate(cfg, tmp_path, lambda record: events.append(("log", record["step"])))
    if secure:
        assert events == [e for t in range(1, 5) for e in (("ckpt", t), ("log", t))]
    else:
        assert events == [("log", 1), ("log", 2), ("log", 3), ("ckpt", 3), ("log", 4), ("ckpt", 4)]
