"""Poisson subsampling of logical batches (docs/DECISIONS.md D21, D22; the sampling Thm 3.4 and the accountant assume).

Each step includes every example independently with probability ``q = B/N``, so the realised
batch size is Binomial(N, q) with mean B and may be zero. The sampler owns its ``torch.Generator``
(never the global RNG), and its state dict captures that generator so a resumed run draws the
same batches bit for bit. With ``privacy.noise_source: os`` the inclusion coins come from the OS CSPRNG
(:func:`prism.privacy.noise.os_uniform`) instead: no seed, no state, nothing to checkpoint.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from prism.privacy.noise import os_uniform


class PoissonSampler:
    """Draws logical batches: example ``i`` is in a batch with probability ``batch_size / num_examples``."""

    def __init__(self, num_examples: int, batch_size: int, generator_seed: int | None, secure: bool = False) -> None:
        if num_examples < 1:
            raise ValueError(f"num_examples={num_examples}: the training set is empty; check the suite config")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be ≥ 1; set train.batch_size")
        if batch_size > num_examples:
            raise ValueError(f"batch_size={batch_size} is larger than the dataset ({num_examples} examples); "
                             "lower train.batch_size or use more training examples")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.secure = secure
        self.generator = None if secure else torch.Generator().manual_seed(generator_seed)

    @property
    def sample_rate(self) -> float:
        """Poisson rate ``q = B / N``."""
        return self.batch_size / self.num_examples

    def sample(self) -> Tensor:
        """Sorted int64 indices of one logical batch; possibly empty (the step still counts for ε)."""
        coins = os_uniform(self.num_examples) if self.secure else torch.rand(
            self.num_examples, generator=self.generator, dtype=torch.float64)
        return torch.nonzero(coins < self.sample_rate).flatten()

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_examples": self.num_examples,
            "batch_size": self.batch_size,
            **({} if self.secure else {"generator": self.generator.get_state()}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = (state["num_examples"], state["batch_size"])
        if saved != (self.num_examples, self.batch_size):
            raise ValueError(f"checkpoint sampler has (num_examples, batch_size)={saved}, this run "
                             f"{(self.num_examples, self.batch_size)}; resume with the same data and train.batch_size")
        if not self.secure:
            self.generator.set_state(state["generator"])


DENOMINATORS = ("expected", "realised")


def noise_denominator(mode: str, realised: int, expected: int) -> int:
    """What a DP step divides the noisy clipped sum by (``privacy.denominator``; docs/DECISIONS.md D2).

    ``expected``: the expected batch size ``B``, so the noise has the accountant's scale ``σC/B``
    (Thm 3.4). ``realised``: the sampled batch size, as the released code did; the noise scale
    ``σC/|batch|`` then reveals ``|batch|``. An empty batch has no realised size to divide by, so it
    falls back to ``B`` (its noise-only step is the ``expected`` one).
    """
    if mode == "expected":
        return expected
    if mode == "realised":
        return realised if realised > 0 else expected
    raise ValueError(f"privacy.denominator={mode!r}; choose one of {DENOMINATORS}")
