"""An empty Poisson batch releases the method's noise-only step (σC/B, nothing accumulated); without
privacy it changes nothing; a non-finite noise draw on it stops the run as on any batch."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import fake_setup, method_cfg, tiny_pair_params
from omegaconf import OmegaConf

from prism import train as T
from prism.methods import build_method, registry
from prism.methods.base import PrivacySpec
from prism.privacy import Accountant


@pytest.mark.parametrize("name", registry.names())
def test_empty_poisson_batch_releases_the_noise_only_step(name: str) -> None:
    """train_step on an empty DP batch = the method's step with nothing accumulated, noise σC/B."""
    B, sigma = 4, 1.5
    privacy = PrivacySpec(sigma=sigma, clip_norm=1.0)
    cfg = OmegaConf.create({"train": {"batch_size": B, "micro_batch_size": 2}})
    params = tiny_pair_params(3)
    setup = SimpleNamespace(
        sampler=SimpleNamespace(sample=lambda: torch.zeros(0, dtype=torch.long), sample_rate=0.5),
        method=build_method(method_cfg(name), params, privacy),
        accountant=Accountant(), sigma=sigma, params=params,
        noise=torch.Generator().manual_seed(5),
    )
    record = T.train_step(setup, cfg)

    twin_params = tiny_pair_params(3)
    twin = build_method(method_cfg(name), twin_params, privacy)
    twin.zero_accumulators()
    twin.step(float(B), torch.Generator().manual_seed(5))
    assert record["batch_size"] == 0
    assert any(not torch.equal(p, tiny_pair_params(3)[n]) for n, p in params.items())  # the noise moved it
    for n, p in params.items():
        torch.testing.assert_close(p, twin_params[n], rtol=0, atol=0)


def test_empty_non_dp_batch_changes_nothing() -> None:
    params = tiny_pair_params(4)
    before = {n: p.detach().clone() for n, p in params.items()}
    setup = SimpleNamespace(
        sampler=SimpleNamespace(sample=lambda: torch.zeros(0, dtype=torch.long), sample_rate=0.5),
        method=build_method(method_cfg("prism"), params, None), accountant=Accountant(), sigma=0.0,
        params=params, noise=torch.Generator().manual_seed(5),
    )
    assert T.train_step(setup, OmegaConf.create({"train": {"batch_size": 4, "micro_batch_size": 2}})) == {"batch_size": 0}
    assert all(torch.equal(p, before[n]) for n, p in params.items())


def test_an_infinite_noise_draw_on_an_empty_batch_stops_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty Poisson batch still releases noise; a non-finite draw must stop the step before any
    checkpoint, as on a non-empty batch."""
    s = fake_setup(tiny_pair_params(5))
    s.sampler.sample = lambda: torch.zeros(0, dtype=torch.long)

    class InfiniteNoise:
        def normal(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
            return torch.full(shape, math.inf, dtype=torch.float64, device=device)

    s.noise = InfiniteNoise()
    cfg = OmegaConf.create({"train": {"batch_size": 4, "micro_batch_size": 2}, "privacy": {}})
    with pytest.raises(T.TrainingDivergedError):
        T.train_step(s, cfg)
