"""Statistics of an empirical privacy audit: membership tests on neighbouring releases → lower bounds.

A mechanism run on neighbouring inputs ``D`` (without the canary) and ``D'`` (with it) gives two
samples of a scalar statistic. A threshold test "statistic beyond ``t`` ⇒ canary present" has a
false-positive rate (on ``D``) and a true-positive rate (on ``D'``). Any (ε, δ)-DP or μ-GDP
mechanism bounds that pair (Dong, Roth & Su 2022; Kairouz et al. 2015):

* μ-GDP: ``TPR ≤ Φ(Φ⁻¹(FPR) + μ)``, so ``μ ≥ Φ⁻¹(TPR) − Φ⁻¹(FPR)``;
* (ε, δ)-DP: ``TPR ≤ e^ε FPR + δ`` and ``1 − FPR ≤ e^ε (1 − TPR) + δ``.

With Clopper–Pearson bounds ``TPR ≥ TPR_lo`` and ``FPR ≤ FPR_hi`` (each two-sided at the given confidence)
the formulas give lower bounds on μ and ε; for a correct mechanism a bound exceeds the true value only if
one of the two one-sided bounds misses, probability ≤ ``1 − confidence``. The threshold and the test's
direction are chosen on one half of the draws and the bounds computed on the other, at no confidence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats


def clopper_pearson(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact two-sided binomial interval: ``Beta(α/2; k, n−k+1)``, ``Beta(1−α/2; k+1, n−k)``."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"need 0 ≤ successes={successes} ≤ trials={trials} and trials ≥ 1")
    alpha = 1.0 - confidence
    lo = 0.0 if successes == 0 else float(stats.beta.ppf(alpha / 2, successes, trials - successes + 1))
    hi = 1.0 if successes == trials else float(stats.beta.ppf(1 - alpha / 2, successes + 1, trials - successes))
    return lo, hi


def gdp_mu_lower_bound(tpr_lo: float, fpr_hi: float) -> float:
    """``Φ⁻¹(TPR_lo) − Φ⁻¹(FPR_hi)`` (0 when the test is no better than chance)."""
    if tpr_lo <= 0.0 or fpr_hi >= 1.0:
        return 0.0
    return max(0.0, float(stats.norm.ppf(tpr_lo) - stats.norm.ppf(fpr_hi)))


def dp_epsilon_lower_bound(tpr_lo: float, fpr_hi: float, delta: float) -> float:
    """Largest ε the two (ε, δ) inequalities force: ``log((TPR−δ)/FPR)``, ``log((1−FPR−δ)/(1−TPR))``."""
    bounds = [0.0]
    if tpr_lo > delta and fpr_hi > 0:
        bounds.append(math.log((tpr_lo - delta) / fpr_hi))
    if 1.0 - fpr_hi > delta and tpr_lo < 1:
        bounds.append(math.log((1.0 - fpr_hi - delta) / (1.0 - tpr_lo)))
    return max(bounds)


def gdp_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of μ-GDP (the Gaussian mechanism): ``Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)``."""
    return float(stats.norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * stats.norm.cdf(-epsilon / mu - mu / 2))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest ε with ``δ(ε) ≤ delta`` for μ-GDP: one step of the Gaussian mechanism with μ = 1/σ."""
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta(mu, hi) > delta:
        hi *= 2.0
    return float(optimize.brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, hi, xtol=1e-12))


@dataclass(frozen=True)
class ThresholdAudit:
    """One threshold test, chosen on the first half of the draws and measured on the second."""

    mu_lower: float
    epsilon_lower: float
    tpr: float
    fpr: float
    threshold: float
    upper_tail: bool  # True: "statistic > threshold ⇒ canary present"


def _rates(without: np.ndarray, with_: np.ndarray, threshold: float, upper_tail: bool) -> tuple[int, int]:
    beyond = np.greater if upper_tail else np.less
    return int(beyond(with_, threshold).sum()), int(beyond(without, threshold).sum())


def _bounds(tp: int, fp: int, n_with: int, n_without: int, confidence: float) -> tuple[float, float]:
    return clopper_pearson(tp, n_with, confidence)[0], clopper_pearson(fp, n_without, confidence)[1]


def threshold_audit(
    without: np.ndarray, with_: np.ndarray, delta: float, confidence: float = 0.95, candidates: int = 200
) -> ThresholdAudit:
    """Split each sample in halves; pick the threshold and tail maximising the μ lower bound on the
    first halves; return the Clopper–Pearson μ and ε lower bounds of that test on the second halves."""
    without, with_ = np.asarray(without, dtype=np.float64), np.asarray(with_, dtype=np.float64)
    if min(len(without), len(with_)) < 4:
        raise ValueError("need at least 4 draws per side")
    h0, h1 = len(without) // 2, len(with_) // 2
    pick_without, test_without = without[:h0], without[h0:]
    pick_with, test_with = with_[:h1], with_[h1:]
    pooled = np.concatenate([pick_without, pick_with])
    thresholds = np.unique(np.quantile(pooled, np.linspace(0.0, 1.0, candidates)))
    best = (-1.0, float(thresholds[0]), True)
    for threshold in thresholds:
        for upper in (True, False):
            tp, fp = _rates(pick_without, pick_with, float(threshold), upper)
            mu = gdp_mu_lower_bound(*_bounds(tp, fp, len(pick_with), len(pick_without), confidence))
            if mu > best[0]:
                best = (mu, float(threshold), upper)
    _, threshold, upper = best
    tp, fp = _rates(test_without, test_with, threshold, upper)
    tpr_lo, fpr_hi = _bounds(tp, fp, len(test_with), len(test_without), confidence)
    return ThresholdAudit(
        mu_lower=gdp_mu_lower_bound(tpr_lo, fpr_hi),
        epsilon_lower=dp_epsilon_lower_bound(tpr_lo, fpr_hi, delta),
        tpr=tp / len(test_with),
        fpr=fp / len(test_without),
        threshold=threshold,
        upper_tail=upper,
    )


def snr(without: np.ndarray, with_: np.ndarray) -> float:
    """``|mean(with) − mean(without)| / std(without)``: 1/σ for the optimal linear statistic."""
    spread = float(np.std(without, ddof=1))
    shift = abs(float(np.mean(with_) - np.mean(without)))
    return math.inf if spread == 0 else shift / spread
