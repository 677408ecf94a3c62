"""Accounting of a private learning-rate selection (Papernot & Steinke 2022; Liu & Talwar 2019).

A selection draws a random number of candidates ``K``, runs each as an independent DP algorithm
(DP-SGD training at a rate drawn from a public grid, then a noised count of correct validation
rows), and publishes only the candidate with the best noised score. Its privacy cost grows with
``log E[K]``, not with ``K``:

* :func:`candidate_event` is one candidate: ``T`` Poisson-subsampled Gaussian steps composed with one
  Gaussian count of sensitivity 1;
* :func:`selection_epsilon` is the whole selection's ε at δ: ``dp_accounting``'s
  ``RepeatAndSelectDpEvent`` (Papernot & Steinke Thm 2 for ``K`` truncated negative binomial of shape
  ``η``, geometric at ``η = 1``, logarithmic at ``η = 0``; Thm 6 for ``K`` Poisson, ``η = inf``) composed
  by its ``RdpAccountant``; :func:`calibrate_candidate_sigma` finds the smallest training σ whose
  selection meets a target;
* :func:`draw_candidate_count` draws ``K`` from its law and :func:`noised_count` is the score a
  candidate publishes.

The bounds are in Rényi DP at the integer orders of :data:`prism.privacy.limits.ORDERS`; PRV
accounting (the single-run default) has no repeat-and-select composition.
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from prism.privacy.limits import ORDERS

if TYPE_CHECKING:  # torch-free at import: the light verbs read this module before any model is built
    from prism.privacy.noise import OsGenerator

POISSON = math.inf
SEEDED_PLAN = "a measurement: K and the rates follow from the printed seed; not a release"
"""What a table of selections planned from the table seed (``privacy.noise_source=seeded``) is (docs/PRIVACY.md,
"ε includes tuning"): its header and its ``dp_guarantee`` say so; under ``noise_source=os`` the plan is secret."""


def tnb_gamma(mean: float, shape: float) -> float:
    """The success probability ``γ`` of the truncated negative binomial of shape ``η`` with mean ``μ``.

    ``E[K] = η(1 − γ) / (γ(1 − γ^η))`` (``η > 0``; ``1/γ`` at ``η = 1``) and
    ``(1 − γ) / (γ log(1/γ))`` at ``η = 0``; ``E[K]`` falls with ``γ``, so bisection finds it. The
    smaller end is returned: a smaller ``γ`` is a larger ``log(1/γ)`` in Thm 2, the safe side.
    """
    _check_mean_shape(mean, shape)
    if shape == 1:
        return 1.0 / mean
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _tnb_mean(mid, shape) > mean else (lo, mid)
    return lo


def _tnb_mean(gamma: float, shape: float) -> float:
    if gamma >= 1:
        return 1.0
    if shape == 0:
        return (1 - gamma) / (gamma * math.log(1 / gamma))
    return shape * (1 - gamma) / (gamma * -math.expm1(shape * math.log(gamma)))


def _check_mean_shape(mean: float, shape: float) -> None:
    if not mean >= 1:
        raise ValueError(f"the mean number of candidates must be >= 1, got {mean}")
    if not shape >= 0:
        raise ValueError(f"the shape of the candidate count must be >= 0 (inf: Poisson), got {shape}")


def candidate_event(sigma: float, sample_rate: float, steps: int, score_sigma: float) -> Any:
    """One candidate as a ``dp_accounting`` event: ``T`` subsampled Gaussian steps, then a count of
    sensitivity 1 with Gaussian noise ``score_sigma``, composed."""
    from dp_accounting import dp_event

    if not score_sigma > 0:
        raise ValueError(f"the score's noise must be > 0, got {score_sigma}")
    return dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(sample_rate, dp_event.GaussianDpEvent(sigma)),
                                     steps),
        dp_event.GaussianDpEvent(score_sigma)])


def selection_epsilon(sigma: float, sample_rate: float, steps: int, delta: float, *, score_sigma: float,
                      mean: float, shape: float) -> float:
    """ε at ``δ`` of the whole selection: ``dp_accounting``'s RDP accountant composes the candidate's
    repeat-and-select (Thm 2, Thm 6 for a Poisson ``K``) and converts it at the best order of
    :data:`~prism.privacy.limits.ORDERS` (Balle et al. 2020, Thm 21)."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    _check_mean_shape(mean, shape)
    accountant = rdp_privacy_accountant.RdpAccountant(orders=[float(a) for a in ORDERS])
    accountant.compose(dp_event.RepeatAndSelectDpEvent(candidate_event(sigma, sample_rate, steps, score_sigma),
                                                       mean, shape))
    return float(accountant.get_epsilon(delta))


@functools.lru_cache(maxsize=64)  # every candidate of a cell asks for the same σ
def calibrate_candidate_sigma(epsilon: float, delta: float, sample_rate: float, steps: int, *,
                              score_sigma: float, mean: float, shape: float, tolerance: float = 1e-6) -> float:
    """The smallest training σ (to ``tolerance``, rounded up) whose selection is (ε, δ)-DP."""
    cost = functools.partial(selection_epsilon, sample_rate=sample_rate, steps=steps, delta=delta,
                             score_sigma=score_sigma, mean=mean, shape=shape)
    floor = cost(1e6)
    if epsilon <= floor:
        raise ValueError(f"ε = {epsilon:g} is out of reach of this selection: its score and candidate count alone "
                         f"cost ε = {floor:.3g}; raise the score's noise or lower the mean candidate count")
    lo, hi = 0.05, 1.0
    while cost(hi) > epsilon:
        lo, hi = hi, 2 * hi
    while hi - lo > tolerance * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cost(mid) > epsilon else (lo, mid)
    return hi


def draw_candidate_count(rng: np.random.Generator | OsGenerator, mean: float, shape: float) -> int:
    """One draw of ``K`` by inverting :func:`_count_cdf` at one uniform ``rng.random()``: Poisson(μ) at
    ``η = inf`` (``K ≥ 0``), else the truncated negative binomial (``K ≥ 1``)."""
    _check_mean_shape(mean, shape)
    return int(np.searchsorted(_count_cdf(mean, shape), rng.random(), side="right")) + (shape != POISSON)


@functools.lru_cache(maxsize=32)
def _count_cdf(mean: float, shape: float) -> np.ndarray:
    """``P(K ≤ k)`` for ``k = 0, 1, …`` (Poisson) or ``k = 1, 2, …`` until the tail is below 1e-12:
    ``P(K = k) ∝ μ^k / k!`` (Poisson), ``∝ C(k + η − 1, k)(1 − γ)^k`` (``∝ (1 − γ)^k / k`` at ``η = 0``,
    the logarithmic law)."""
    gamma = 0.0 if shape == POISSON else tnb_gamma(mean, shape)
    if gamma >= 1:
        return np.ones(1)
    k = np.arange(1, 64, dtype=np.float64)
    while True:
        if shape == POISSON:
            k0 = np.concatenate([[0.0], k])
            log_w = k0 * math.log(mean) - np.array([math.lgamma(i + 1) for i in k0])
        elif shape == 0:
            log_w = k * math.log1p(-gamma) - np.log(k)
        else:
            log_w = np.array([math.lgamma(i + shape) - math.lgamma(i + 1) - math.lgamma(shape) for i in k]) \
                + k * math.log1p(-gamma)
        w = np.exp(log_w - log_w.max())
        if w[-1] < 1e-12 * w.sum():
            return np.cumsum(w) / w.sum()
        k = np.arange(1, 2 * k.size + 1, dtype=np.float64)


def noised_count(correct: np.ndarray, score_sigma: float, rng: np.random.Generator) -> float:
    """The published score: the number of correct validation rows plus ``N(0, σ_s²)`` noise.

    Each row adds 0 or 1, so adding or removing one row moves the count by at most 1 (sensitivity 1).
    """
    correct = np.asarray(correct)
    if correct.size and not np.isin(correct, (0, 1)).all():
        raise ValueError("each validation row's correctness must be 0 or 1")
    return float(correct.sum()) + float(rng.normal(0.0, score_sigma))
