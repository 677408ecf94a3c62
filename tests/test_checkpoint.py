"""Checkpointed RNG state: the CPU generator and every CUDA device's generator (faked on CPU)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipelines.config.compose import compose_config, resolve
from prism import checkpoint as C
from prism import train as T


class FakeCuda:
    """Stands in for ``torch.cuda``'s generator API: one byte-state per device, advanced by ``draw``."""

    def __init__(self, devices: int) -> None:
        self.states = [torch.tensor([7 * d], dtype=torch.uint8) for d in range(devices)]
        self.set_calls = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(self.states))
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", self._set)

    def _set(self, states: list[torch.Tensor]) -> None:
        self.set_calls += 1
        self.states = [s.clone() for s in states]

    def draw(self) -> None:
        self.states = [s + 1 for s in self.states]


def test_cuda_generators_of_every_device_are_saved_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda(devices=2)
    fake.install(monkeypatch)
    saved = C.rng_states()
    expected = [s.clone() for s in fake.states]
    cpu_before = torch.rand(3)
    fake.draw()
    fake.draw()
    C.restore_rng_states(saved)
    assert fake.set_calls == 1
    assert [s.tolist() for s in fake.states] == [s.tolist() for s in expected]
    torch.testing.assert_close(torch.rand(3), cpu_before, rtol=0, atol=0)


def test_cuda_states_on_another_device_count_refuse_to_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(devices=2).install(monkeypatch)
    saved = C.rng_states()
    FakeCuda(devices=1).install(monkeypatch)
    with pytest.raises(RuntimeError, match="same CUDA_VISIBLE_DEVICES"):
        C.restore_rng_states(saved)


def test_cpu_checkpoint_resumes_without_touching_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    saved = C.rng_states()
    assert saved["cuda_rng"] == []
    fake = FakeCuda(devices=1)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", fake._set)
    C.restore_rng_states(saved)
    assert fake.set_calls == 0


def test_loop_state_round_trips_the_cuda_generators(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's checkpoint (``_state``/``_restore``) carries the CUDA states through a file."""
    cfg = resolve(compose_config(["backbone=tiny-llama", "suite=glue8", "suite.embedded.train_per_task=16", "suite.cutoff_len=1024",
                                  "train.batch_size=8", "train.micro_batch_size=4", "train.device=cpu",
                                  "method=adamw", "privacy=eps6", "logging=disabled"]))
    setup = T.build(cfg)
    fake = FakeCuda(devices=3)
    fake.install(monkeypatch)
    expected = [s.clone() for s in fake.states]
    C.save_checkpoint(tmp_path, T._state(setup, step=1))
    fake.draw()
    assert T._restore(setup, C.load_checkpoint(tmp_path)) == 1
    assert [s.tolist() for s in fake.states] == [s.tolist() for s in expected]
