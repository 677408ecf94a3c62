"""One-run privacy auditing: guesses about m canaries → an ε lower bound (Steinke, Nasr & Jagielski 2023).

Setting (their §3). Each of ``m`` canaries is included in the training set by an independent fair coin
``S_i ∈ {−1, +1}``. After one run the auditor outputs guesses ``T_i ∈ {−1, 0, +1}`` (``0``: abstain),
``r = Σ|T_i|`` of them, and counts the correct ones ``W = #{i : T_i = S_i}``. Their main theorem: if the
training algorithm is (ε, δ)-DP with respect to each canary, then for every ``v``

    P[W ≥ v] ≤ f_ε(v) + 2mδ · max_{1 ≤ i ≤ v} (f_ε(v − i) − f_ε(v)) / i,
    f_ε(v) = P[Binomial(r, p_ε) ≥ v],  p_ε = e^ε / (1 + e^ε)

(the theorem takes the max over ``1 ≤ i ≤ m``; for ``i ≥ v`` the term is ``(1 − f_ε(v))/i``, largest at
``i = v``). For δ = 0: ``W`` is stochastically dominated by ``Binomial(r, p_ε)``, the correct guesses of
ε-DP randomised response. The right-hand side is a p-value for the hypothesis "(ε, δ)-DP" given the observed
``v``; :func:`epsilon_lower_bound` returns the largest ε it rejects at level β. If the algorithm is (ε, δ)-DP
the returned bound exceeds ε with probability at most β.

Monotonicity, which makes the bisection exact: with ``X ~ Bin(r, p)``, ``Y ~ Bin(r − 1, p)``,
``d/dp P[X ≥ v] = r P[Y = v − 1]`` and ``d/dp P[v − i ≤ X < v] = r (P[Y = v − i − 1] − P[Y = v − 1])``, so the
right-hand side has derivative ``≥ r P[Y = v − 1] (1 − 2mδ/i*) ≥ 0`` whenever ``2mδ ≤ 1``: the p-value is
non-decreasing in ε (the max of the window terms has, almost everywhere, the derivative of one of them)
and {ε : p-value ≤ β} is an interval ``[0, ε_lb]``. :func:`epsilon_lower_bound` requires
``2mδ ≤ 1`` (at δ = 1e-5 up to 50,000 canaries).

The f-DP refinement of Mahloujifar, Melis & Chaudhuri (2025, "Auditing f-differential privacy in one run")
tests a whole trade-off curve instead of one (ε, δ) pair: :func:`fdp_lower_bound` with :func:`gaussian_curve`
rejects "the run is μ-GDP" (Dong, Roth & Su 2022: ``f_μ(α) = Φ(Φ⁻¹(1 − α) − μ)``, one Gaussian mechanism
with sensitivity/σ = μ) from ``v`` right of ``k`` "in" guesses (``k⁻ = 0``), and returns the largest μ
rejected at level β (:func:`prism.audit.step.gdp_epsilon`: its ε at δ). It bounds the run's GDP parameter,
not its (ε, δ): an (ε, δ)-DP run need not be μ-GDP at the μ whose curve passes through (ε, δ).

Guesses must not be chosen by looking at the coins: :func:`top_bottom_guesses` takes ``k⁺``, ``k⁻`` fixed
before the scores are seen; :func:`split_audit` picks them on one half of the canaries and measures the
other half only (the theorem applies to the second half conditionally on the first, whose coins are
independent of it).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import special


def binomial_log_pmf(r: int, log_p: float, log_q: float, ks: np.ndarray) -> np.ndarray:
    """``log P[Bin(r, p) = k]`` for integer ``ks`` in ``[0, r]``, from ``log p`` and ``log(1 − p)``."""
    ks = np.asarray(ks, dtype=np.float64)
    log_comb = special.gammaln(r + 1.0) - special.gammaln(ks + 1.0) - special.gammaln(r - ks + 1.0)
    return log_comb + ks * log_p + (r - ks) * log_q


def _upper_tail(r: int, v: int, log_p: float, log_q: float) -> float:
    """``P[Bin(r, p) ≥ v]`` as a log-space sum of pmf terms."""
    if v <= 0:
        return 1.0
    if v > r:
        return 0.0
    return float(min(1.0, math.exp(special.logsumexp(binomial_log_pmf(r, log_p, log_q, np.arange(v, r + 1))))))


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """The theorem's bound on ``P[W ≥ v]`` for an (ε, δ)-DP algorithm audited with ``m`` canaries and
    ``r`` guesses (module docstring), capped at 1."""
    _check_counts(m, r, v)
    if epsilon < 0 or not 0.0 <= delta <= 1.0:
        raise ValueError(f"need epsilon ≥ 0 and 0 ≤ delta ≤ 1 (got {epsilon}, {delta})")
    log_p = -math.log1p(math.exp(-epsilon))  # log p_ε, and log(1 − p_ε) = log p_ε − ε: accurate for every ε ≥ 0
    log_q = log_p - epsilon
    tail = _upper_tail(r, v, log_p, log_q)
    if delta == 0.0 or v == 0:
        return tail
    below = np.exp(binomial_log_pmf(r, log_p, log_q, np.arange(v - 1, -1, -1)))  # P[X = v−1], P[X = v−2], …
    window = np.cumsum(below) / np.arange(1, v + 1)  # (f(v − i) − f(v)) / i for i = 1..v
    return float(min(1.0, tail + 2.0 * m * delta * window.max()))


def epsilon_lower_bound(m: int, r: int, v: int, delta: float = 1e-5, confidence: float = 0.95,
                        tol: float = 1e-6) -> float:
    """Largest ε with ``p_value(m, r, v, ε, δ) ≤ 1 − confidence`` (0 if none): the one-run ε lower bound, by
    bisection on the non-decreasing p-value (module docstring), never rounded upward. Requires ``2mδ ≤ 1``."""
    _check_counts(m, r, v)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must lie in (0, 1)")
    if 2.0 * m * delta > 1.0:
        raise ValueError(f"2·m·δ = {2 * m * delta:g} > 1: the bound is not monotone in ε; use fewer canaries or a smaller δ")
    beta = 1.0 - confidence
    if p_value(m, r, v, 0.0, delta) > beta:
        return 0.0
    return _largest_rejected(lambda eps: p_value(m, r, v, eps, delta) <= beta, 0.0, tol,
                             f"{v} correct of {r} guesses rejects every ε ≤ 1000 (δ = {delta}): not a DP algorithm")


def _largest_rejected(rejects: Callable[[float], bool], lo: float, tol: float, refusal: str) -> float:
    """Bisection for the largest parameter ``rejects`` holds for (monotone, true at ``lo``), to ``tol``,
    returned at the rejected end; ``refusal`` when it holds beyond 1000."""
    hi = 1.0
    while rejects(hi):
        lo, hi = hi, 2.0 * hi
        if hi > 1e3:
            raise ValueError(refusal)
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if rejects(mid) else (lo, mid)
    return lo


def gaussian_curve(mu: float) -> Callable[[float], float]:
    """``t ↦ f_μ(1 − t) = Φ(Φ⁻¹(t) − μ)``: the μ-GDP trade-off curve read from the right (Dong, Roth & Su 2022)."""
    return lambda t: float(special.ndtr(special.ndtri(t) - mu))


def pure_dp_curve(epsilon: float) -> Callable[[float], float]:
    """``t ↦ f_ε(1 − t)`` for the ε-DP trade-off curve ``f_ε(α) = max(0, 1 − e^ε α, e^{−ε}(1 − α))``."""
    return lambda t: max(0.0, 1.0 - math.exp(epsilon) * (1.0 - t), math.exp(-epsilon) * t)


def approx_dp_curve(delta: float) -> Callable[[float], Callable[[float], float]]:
    """``ε ↦ (t ↦ f_{ε,δ}(1 − t))`` for the (ε, δ)-DP trade-off curve
    ``f_{ε,δ}(α) = max(0, 1 − δ − e^ε α, e^{−ε}(1 − δ − α))`` (Dong, Roth & Su 2022): with
    :func:`fdp_lower_bound`, an (ε, δ) lower bound from the f-DP audit of Mahloujifar, Melis & Chaudhuri (2025)."""
    return lambda epsilon: (lambda t: max(0.0, 1.0 - delta - math.exp(epsilon) * (1.0 - t),
                                          math.exp(-epsilon) * (t - delta)))


def fdp_rejects(m: int, k: int, v: int, curve: Callable[[float], float], beta: float) -> bool:
    """Whether ``v`` right of ``k`` "in" guesses about ``m`` canaries reject "f-DP" at level β (Mahloujifar et
    al.), ``curve(t) = f(1 − t)``: their recursion on the shares of right and wrong guesses (scaled by β/m)
    from ``t = βv/m``, ``w = β(k − v)/m``; for ``i = v − 1, …, 0`` the curve forces ``w ≥ f(1 − t)`` and each
    unit added to ``w`` lifts ``t`` by ``i/(k − i)`` (capped at 1); rejected when the final ``t + w > k/m``."""
    _check_counts(m, k, v)
    right, wrong = beta * v / m, beta * (k - v) / m
    for i in range(v - 1, -1, -1):
        forced = max(wrong, curve(right))
        if forced == wrong:  # nothing moves any more
            break
        right, wrong = min(1.0, right + i / (k - i) * (forced - wrong)), forced
    return right + wrong > k / m


def fdp_lower_bound(m: int, k: int, v: int, family: Callable[[float], Callable[[float], float]],
                    confidence: float = 0.95, tol: float = 1e-6) -> float:
    """Largest parameter of ``family`` (μ for :func:`gaussian_curve`, ε for :func:`pure_dp_curve`) whose curve
    :func:`fdp_rejects` rejects, 0 if none; by bisection (a larger parameter lowers the curve, so rejection
    is monotone in it)."""
    beta = 1.0 - confidence
    if k == 0 or not fdp_rejects(m, k, v, family(tol), beta):
        return 0.0
    return _largest_rejected(lambda param: fdp_rejects(m, k, v, family(param), beta), tol, tol,
                             f"{v} right of {k} guesses rejects every curve parameter ≤ 1000: not a DP algorithm")


def _check_counts(m: int, r: int, v: int) -> None:
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 ≤ correct={v} ≤ guesses={r} ≤ canaries={m}")


def top_bottom_guesses(scores: np.ndarray, k_pos: int, k_neg: int) -> np.ndarray:
    """Guess ``+1`` ("in") for the ``k_pos`` highest scores, ``−1`` ("out") for the ``k_neg`` lowest, 0 else;
    ties are broken by index (a stable sort), never by the coins."""
    scores = np.asarray(scores, dtype=np.float64)
    if k_pos < 0 or k_neg < 0 or k_pos + k_neg > len(scores):
        raise ValueError(f"need k+={k_pos}, k-={k_neg} ≥ 0 with k+ + k- ≤ {len(scores)} canaries")
    order = np.argsort(scores, kind="stable")
    guesses = np.zeros(len(scores), dtype=np.int64)
    guesses[order[: k_neg]] = -1
    guesses[order[len(scores) - k_pos:]] = 1
    return guesses


@dataclass(frozen=True)
class OneRunAudit:
    """The outcome of one audit: canaries audited, guesses made, correct guesses, the ε lower bound
    (Steinke et al.) and, for "in" guesses only (``k⁻ = 0``), the μ-GDP lower bound and the f-DP audit's
    (ε, δ) lower bound (:func:`approx_dp_curve`; NaN otherwise)."""

    canaries: int
    guesses: int
    correct: int
    epsilon_lower: float
    k_pos: int
    k_neg: int
    mu_lower: float = math.nan
    epsilon_fdp_lower: float = math.nan


def audit(scores: np.ndarray, included: np.ndarray, k_pos: int, k_neg: int, delta: float = 1e-5,
          confidence: float = 0.95) -> OneRunAudit:
    """Guess with fixed ``k⁺``, ``k⁻`` (:func:`top_bottom_guesses`) and bound ε (:func:`epsilon_lower_bound`)."""
    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise ValueError(f"scores {scores.shape} and inclusion coins {included.shape} must be equal-length vectors")
    guesses = top_bottom_guesses(scores, k_pos, k_neg)
    truth = np.where(included, 1, -1)
    r = int(np.count_nonzero(guesses))
    v = int(np.count_nonzero(guesses == truth))
    mu = fdp_lower_bound(len(scores), r, v, gaussian_curve, confidence, tol=1e-4) if k_neg == 0 else math.nan
    eps_fdp = fdp_lower_bound(len(scores), r, v, approx_dp_curve(delta), confidence, tol=1e-3) if k_neg == 0 else math.nan
    return OneRunAudit(len(scores), r, v, epsilon_lower_bound(len(scores), r, v, delta, confidence), k_pos, k_neg, mu,
                       eps_fdp)


def split_audit(scores: np.ndarray, included: np.ndarray, candidates: Sequence[tuple[int, int]],
                delta: float = 1e-5, confidence: float = 0.95) -> OneRunAudit:
    """Choose ``(k⁺, k⁻)`` among ``candidates`` (pairs for a half of ``⌊m/2⌋`` canaries) by the bound on the
    first half of the canaries and audit the second half, whose coins the choice never saw, with it. The
    canaries' order must not depend on the coins."""
    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    half = len(scores) // 2
    if half < 1 or not candidates:
        raise ValueError("split_audit needs at least 2 canaries and one (k+, k-) candidate")
    pick = max(candidates, key=lambda k: audit(scores[:half], included[:half], *k, delta, confidence).epsilon_lower)
    return audit(scores[half:], included[half:], *pick, delta, confidence)


def filtered_scores(trace: np.ndarray, block: np.ndarray) -> np.ndarray:
    """Scores ``[m]`` from per-step scores ``trace`` ``[T, m]`` that resist the real examples' interference.

    A hit adds one step's jump to a canary; the real examples add to every canary, every step, their
    gradients' projection, which drifts slowly in time and differs in size between blocks (``block[c]``).
    So each step's scores are high-passed in time (``x_t − (x_{t−1} + x_{t+1})/2``, one-sided at the ends),
    standardised per step and block by the median and the median absolute deviation, and a canary's score
    is its largest standardised step: a scan for the one jump a hit makes, where a sum over steps would add
    up every step's noise and interference. No coin is seen, so the audit stays valid. Needs a sampling
    rate well below ½."""
    x = np.asarray(trace, dtype=np.float64)
    h = np.empty_like(x)
    h[1:-1] = x[1:-1] - 0.5 * (x[:-2] + x[2:])
    h[0], h[-1] = x[0] - x[1], x[-1] - x[-2]
    for b in np.unique(block):
        cols = block == b
        med = np.median(h[:, cols], axis=1, keepdims=True)
        mad = 1.4826 * np.median(np.abs(h[:, cols] - med), axis=1, keepdims=True)
        h[:, cols] = (h[:, cols] - med) / np.where(mad > 0, mad, 1.0)
    return h.max(0)


def dpsgd_canary_scores(included: np.ndarray, sample_rate: float, steps: int, sigma: float,
                        rng: np.random.Generator, filtered: bool = False) -> np.ndarray:
    """White-box scores of an ideal DP-SGD run in units of ``C/B``, ``Σ_t (b_it + σ ξ_it)``: included canary
    ``i`` is in step ``t``'s batch with ``b_it ~ Bernoulli(q)``, ``ξ_it ~ N(0, 1)`` is the noise on its
    orthogonal direction; no interference. With ``filtered``: :func:`filtered_scores` of the per-step scores."""
    included = np.asarray(included, dtype=bool)
    if filtered:
        trace = (rng.random((steps, *included.shape)) < sample_rate) * included
        trace = trace + sigma * rng.standard_normal(trace.shape)
        return filtered_scores(trace, np.zeros(included.shape, dtype=np.int64))
    hits = rng.binomial(steps, sample_rate, size=included.shape) * included
    return hits + sigma * math.sqrt(steps) * rng.standard_normal(included.shape)


def expected_bounds(canaries: int, k_pos: int, k_neg: int, sigma: float, sample_rate: float, steps: int,
                    trials: int = 20, delta: float = 1e-5, confidence: float = 0.95,
                    seed: int = 0, fdp: bool = False, filtered: bool = False) -> tuple[float, float, float]:
    """What a correct DP-SGD run at ``(σ, q, T)`` gives with ``canaries`` ideal white-box canaries
    (:func:`dpsgd_canary_scores`) and guesses ``k⁺``, ``k⁻``: the mean and standard deviation of the ε bound
    and the mean μ-GDP bound (NaN unless ``k⁻ = 0``) over ``trials`` simulated runs; with ``fdp`` the ε bound
    is the f-DP audit's (:attr:`OneRunAudit.epsilon_fdp_lower`, ``k⁻ = 0``); ``filtered``: the scores of
    :func:`dpsgd_canary_scores` with ``filtered``."""
    rng = np.random.default_rng(seed)
    results = []
    for _ in range(trials):  # each run's coins, then its scores, from the one generator
        included = rng.random(canaries) < 0.5
        results.append(audit(dpsgd_canary_scores(included, sample_rate, steps, sigma, rng, filtered), included, k_pos,
                             k_neg, delta, confidence))
    eps = [r.epsilon_fdp_lower if fdp else r.epsilon_lower for r in results]
    return float(np.mean(eps)), float(np.std(eps)), float(np.mean([r.mu_lower for r in results]))
