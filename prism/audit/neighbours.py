"""Record-and-replay of one DP step on neighbouring datasets ``D`` and ``D' = D ∪ {x}`` (docs/audit.md,
"Neighbouring datasets").

``x`` takes the place of the first training row, ``D`` is the others. One draw of the run's Poisson sampler with
that row's coin forced out gives ``D``'s batch, forced in ``D'``'s; ``x`` comes first, so every other row of the
batch moves one place between micro-batches and paddings. Both steps run :func:`prism.train.train_step` (per-example gradients, clipping,
noise, update, as in a run) from the same factors, method state, noise state and global RNG state, and record:

* the **trace**, the public branches of the step: each release's denominator and noise scale (an empty batch
  releases its noise-only step there too), PRISM's rank fallbacks (its log lines) and the divergence guard's stop;
* the **pre-noise release** ``S``, the clipped sum in the space where the method clips, before noise and division:
  PRISM its lift (eq. 14), measured in the intrinsic norm (eq. 15, the image norm); the baselines their factor
  gradients (eq. 3), measured in the flat norm of the factors they train.

The accountant assumes ``‖S(D') − S(D)‖ ≤ C`` and a trace that does not depend on ``x``. The un-noised sums are
read for the audit only: nothing recorded here reaches the factors, the method's state or a checkpoint.
"""
from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import Tensor

from prism.checkpoint import restore_rng_states, rng_states
from prism.mechanism import geometry
from prism.methods.base import Method
from prism.methods.factor import FactorDPMethod
from prism.methods.prism import PrismMethod
from prism.train import Setup, TrainingDivergedError, train_step

CASES = ("real", "longest", "non_finite", "duplicate")
"""``x``: a real training row (the first); a row of the suite's maximal length; a row whose loss is not finite; a
copy of a row of ``D``."""

Trace = tuple[tuple, ...]


@dataclass(frozen=True)
class Step:
    """What one replayed step recorded: its public trace and its pre-noise release (float64)."""

    trace: Trace
    release: list[tuple[Tensor, ...]]


@dataclass(frozen=True)
class Pair:
    """One neighbouring pair: ``‖S(D') − S(D)‖ / C`` in the method's norm and whether the traces agree."""

    ratio: float
    same_trace: bool
    trace_without: Trace
    trace_with: Trace


def pre_noise_release(method: Method) -> list[tuple[Tensor, ...]]:
    """The clipped sum accumulated so far, before noise: PRISM per shape group ``(frame, ΔA, ΔB)`` (its lift,
    eq. 14); the baselines one ``(S_n,)`` per trained tensor. Copies; the method's state is not touched."""
    if isinstance(method, PrismMethod):
        return [(g.frame, *geometry.lift(g.frame.A, g.frame.B, *(s.clone() for s in g.sums), frame=g.frame,
                                         rcond=method.config.pinv_rcond)) for g in method.groups]
    if isinstance(method, FactorDPMethod):
        return [(s.clone(),) for s in method.summed.values()]
    raise TypeError(f"{type(method).__name__} is neither PRISM nor a factor-space DP method; nothing to replay")


def release_distance(a: list[tuple[Tensor, ...]], b: list[tuple[Tensor, ...]]) -> float:
    """``‖S_a − S_b‖`` in the norm the method clips in: the intrinsic norm of the lifts' difference (eq. 15, at
    the shared frame) for PRISM, the flat norm of the factor gradients' difference for the baselines."""
    sq = 0.0
    for x, y in zip(a, b):
        if len(x) == 3:
            fr = x[0]
            sq += float(geometry.intrinsic_sqnorm(fr.A, fr.B, x[1] - y[1], x[2] - y[2], frame=fr).sum())
        else:
            sq += float((x[0] - y[0]).square().sum())
    return math.sqrt(sq)


class _Records(logging.Handler):
    def __init__(self, sink: list) -> None:
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(("rank_fallback", record.getMessage()))


def replay(s: Setup, cfg: DictConfig, indices: Tensor) -> Step:
    """One :func:`prism.train.train_step` on ``indices`` with the trace and the pre-noise release recorded."""
    trace: list[tuple] = []
    releases: list[list[tuple[Tensor, ...]]] = []
    method, inner = s.method, s.method.add_noise

    def recorded(denominator: float, noise, diagnostics: bool = True):
        releases.append(pre_noise_release(method))
        out = inner(denominator, noise, diagnostics)
        trace.append(("release", float(denominator), float(out.scale)))
        return out

    handler = _Records(trace)
    logger = logging.getLogger("prism.methods.prism")
    method.add_noise = recorded
    logger.addHandler(handler)
    try:
        train_step(s, cfg, diagnostics=False, indices=indices)
    except TrainingDivergedError:
        trace.append(("stop",))
    finally:
        logger.removeHandler(handler)
        del method.add_noise
    return Step(tuple(trace), releases[0])


def neighbours(s: Setup, cfg: DictConfig, x: dict[str, list[int]], draws: int) -> list[Pair]:
    """``draws`` neighbouring pairs from the current state: ``x`` takes the place of the setup's first row, so
    ``D`` is the other rows; each pair is one draw of the run's sampler with row 0's coin forced out and in,
    replayed from identical parameters, method state and randomness. The setup's rows, parameters and states
    are as they were afterwards."""
    rows = s.features
    s.features = [x, *rows[1:]]
    saved = ({n: p.detach().clone() for n, p in s.params.items()}, copy.deepcopy(s.method.state_dict()))

    def restore(noise_state: Tensor, rng: dict) -> None:
        with torch.no_grad():
            for n, p in s.params.items():
                p.copy_(saved[0][n])
        s.method.load_state_dict(copy.deepcopy(saved[1]))
        s.noise.generator.set_state(noise_state)
        restore_rng_states(rng)

    pairs = []
    try:
        for _ in range(draws):
            drawn = s.sampler.sample()
            batch = drawn[drawn != 0]  # row 0 is x: its coin is overridden, out and in
            forced = torch.cat([batch.new_zeros(1), batch])
            noise_state, rng = s.noise.generator.get_state(), rng_states()
            steps = []
            for indices in (batch, forced):
                restore(noise_state, rng)
                steps.append(replay(s, cfg, indices))
            without, with_ = steps
            ratio = release_distance(with_.release, without.release) / s.method.privacy.clip_norm
            pairs.append(Pair(ratio, without.trace == with_.trace, without.trace, with_.trace))
    finally:
        s.features = rows
        restore(s.noise.generator.get_state(), rng_states())
    return pairs


def shorten(s: Setup, length: int) -> None:
    """Keep each training row's last ``length`` tokens (its supervised answer), so a replay of a tiny model runs
    in seconds; the rows stay real rows of the suite."""
    s.features = [{k: v[-length:] for k, v in row.items()} for row in s.features]


def extra_row(case: str, s: Setup, cutoff_len: int) -> dict[str, list[int]]:
    """The row ``x`` of ``case`` (:data:`CASES`) for the setup's rows. ``non_finite`` also sets the frozen input
    embedding of one token that no row uses to +inf (on a copy, untied from the LM head), which only ``x`` reads:
    every other row's loss and gradient are what they were."""
    rows = s.features
    if case == "real":
        return copy.deepcopy(rows[0])
    if case == "duplicate":
        return copy.deepcopy(rows[1])
    if case == "longest":
        longest = max(rows, key=lambda r: len(r["input_ids"]))
        reps = -(-cutoff_len // len(longest["input_ids"]))
        return {k: (v * reps)[:cutoff_len] for k, v in longest.items()}
    if case == "non_finite":
        embedding = s.model.get_input_embeddings()
        used = {t for r in rows for t in r["input_ids"]}
        token = max(set(range(embedding.weight.shape[0])) - used)
        weight = embedding.weight.detach().clone()  # untied from a tied LM head, whose logits stay as they were
        weight[token] = math.inf
        embedding.weight = torch.nn.Parameter(weight, requires_grad=False)
        row = copy.deepcopy(rows[0])
        row["input_ids"][0] = token
        return row
    raise ValueError(f"unknown neighbour case {case!r}; choose from {', '.join(CASES)}")


def table(results: dict[tuple[str, str], list[Pair]], cases: Sequence[str],
          mark: Callable[[str, str], str]) -> list[str]:
    """Markdown rows method × case of the largest ``‖S(D') − S(D)‖ / C``, each cell with ``trace≠`` where a
    pair's traces differed and ``mark(method, case)`` appended."""
    lines = ["| method | " + " | ".join(cases) + " |", "|---|" + "---:|" * len(cases)]
    for method in dict.fromkeys(m for m, _ in results):
        cells = []
        for case in cases:
            pairs = results[method, case]
            cell = f"{max(p.ratio for p in pairs):.7f}" + ("" if all(p.same_trace for p in pairs) else " trace≠")
            cells.append(cell + mark(method, case))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines
