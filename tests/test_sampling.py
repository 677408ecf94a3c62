"""Poisson sampler: inclusion rate, batch-size law, determinism, resume, empty batches."""
from __future__ import annotations

import io
import math

import pytest
import torch

from prism.privacy import PoissonSampler


def draw(sampler: PoissonSampler, n: int) -> list[torch.Tensor]:
    return [sampler.sample() for _ in range(n)]


def test_inclusion_frequency_and_batch_size_match_binomial() -> None:
    N, B, draws = 50, 5, 4000
    q = B / N
    sampler = PoissonSampler(N, B, generator_seed=1)
    assert sampler.sample_rate == q
    batches = draw(sampler, draws)
    counts = torch.zeros(N)
    for batch in batches:
        assert batch.dtype == torch.int64
        assert torch.equal(batch, batch.unique())  # sorted, no repeats
        counts[batch] += 1
    # each example: Binomial(draws, q); 5 standard deviations over 50 examples
    sd = math.sqrt(draws * q * (1 - q))
    assert (counts - draws * q).abs().max() < 5 * sd
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    # batch size: Binomial(N, q) — mean B, variance N q (1 − q)
    assert sizes.mean().item() == pytest.approx(B, abs=5 * math.sqrt(N * q * (1 - q) / draws))
    assert sizes.var().item() == pytest.approx(N * q * (1 - q), rel=0.1)


def test_empty_batches_happen_at_small_rate() -> None:
    N, draws = 1000, 600
    sampler = PoissonSampler(N, 1, generator_seed=3)
    empty = sum(len(b) == 0 for b in draw(sampler, draws)) / draws
    p_empty = (1 - 1 / N) ** N  # ≈ e^{-1}
    assert empty == pytest.approx(p_empty, abs=5 * math.sqrt(p_empty * (1 - p_empty) / draws))


def test_same_seed_same_batches_and_own_generator() -> None:
    first = draw(PoissonSampler(100, 10, generator_seed=7), 20)
    torch.manual_seed(123)  # the global RNG must not matter
    second = draw(PoissonSampler(100, 10, generator_seed=7), 20)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    other = draw(PoissonSampler(100, 10, generator_seed=8), 20)
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_resume_is_bit_identical() -> None:
    uninterrupted = PoissonSampler(100, 10, generator_seed=5)
    expected = draw(uninterrupted, 30)
    run = PoissonSampler(100, 10, generator_seed=5)
    draw(run, 12)
    buffer = io.BytesIO()
    torch.save(run.state_dict(), buffer)
    buffer.seek(0)
    resumed = PoissonSampler(100, 10, generator_seed=999)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert all(torch.equal(a, b) for a, b in zip(draw(resumed, 18), expected[12:]))


def test_full_batch_when_batch_size_equals_dataset() -> None:
    assert torch.equal(PoissonSampler(8, 8, generator_seed=0).sample(), torch.arange(8))


@pytest.mark.parametrize(("N", "B", "match"), [(10, 11, "lower train.batch_size"), (10, 0, "train.batch_size"),
                                                 (0, 1, "training set is empty")])
def test_bad_sizes_are_rejected(N: int, B: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PoissonSampler(N, B, generator_seed=0)


def test_resume_into_different_data_is_rejected() -> None:
    state = PoissonSampler(100, 10, generator_seed=0).state_dict()
    with pytest.raises(ValueError, match="same data"):
        PoissonSampler(101, 10, generator_seed=0).load_state_dict(state)
