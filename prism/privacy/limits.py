"""What the PRV accountant can calibrate, decided without running it (no torch, no Opacus).

:func:`prism.privacy.accounting.calibrate_sigma` searches σ with Opacus' PRV accountant, which
discretises the privacy-loss distribution on a grid of ``2L / h`` points, ``h = ε_err /
sqrt(T log(12/δ_err) / 2)``, ``L`` from an RDP tail bound (Gopi et al. 2021, Remark 5.6). That
search fails, or never ends, in three ways, each predicted here before any model is loaded:

* ε so large that σ would fall below :data:`SIGMA_FLOOR`: the grid grows without bound as σ → 0 (ε = 1e9
  never returns); :func:`rdp_epsilon` at the floor, an upper bound of the PRV value, refuses only targets
  the accountant (one evaluation at the floor) would refuse too.
* ε within half the PRV estimate's own error ``ε_err`` (:data:`EPS_ERROR`) of 0: no σ meets the target
  (just above, the accountant says in one line when its search finds no σ below its cap of 10⁶).
* δ so small that float rounding over the grid (machine ε of ``long double`` × grid points) exceeds it
  ("Floating point errors will dominate"), or a grid too large for memory (many steps):
  :func:`prv_grid_points` × :data:`BYTES_PER_POINT`.

:func:`rdp_epsilon` is the Rényi-DP bound of ``T`` Poisson-subsampled Gaussian steps at integer
orders (Mironov, Talwar and Zhang 2019, Thm 4 / eq. 3: ``A_α = Σ_k C(α,k) (1−q)^(α−k) q^k
exp((k²−k)/(2σ²))``), converted to (ε, δ) as Opacus does (Balle et al. 2020, Thm 21).
"""
from __future__ import annotations

import functools
import math

import numpy as np

SIGMA_FLOOR = 0.3       # smallest σ calibration may need: below it one PRV evaluation costs minutes
EPS_ERROR = 0.01
"""The PRV accountant's numerical error bound on ε, and the calibration's tolerance: Opacus' bisection
(:func:`prism.privacy.accounting.calibrate_sigma`) stops at a σ whose ε lies in ``[target − EPS_ERROR, target]``."""
CALIBRATED_BELOW = 3 * EPS_ERROR
"""How far below its target the ε of a σ calibrated for exactly its steps may fall: the bisection's
tolerance plus the numerical error of the two ε evaluations compared (the calibration's and the one
checked), each at most :data:`EPS_ERROR`. A lower ε means a larger σ than the calibration gives: a
run over-noised for its row."""


def is_calibrated(spent: float, target: float) -> bool:
    """Whether ``spent`` is the ε of a σ calibrated to ``target`` for exactly its steps:
    ``target − CALIBRATED_BELOW ≤ spent ≤ target``."""
    return target - CALIBRATED_BELOW <= spent <= target
BYTES_PER_POINT = 67    # peak bytes per grid point of one PRV evaluation (tracemalloc, Opacus 1.5)
ORDERS = tuple(range(2, 64))


def rdp_epsilon(sigma: float, sample_rate: float, steps: int, delta: float) -> float:
    """Upper bound on ε of ``steps`` Poisson-subsampled Gaussian steps (noise multiplier σ, rate q)."""
    return float(np.min(rdp_to_epsilon(steps * rdp_curve(sigma, sample_rate), delta)))


def rdp_to_epsilon(rdp: np.ndarray, delta: float) -> np.ndarray:
    """Balle et al. 2020, Thm 21, at each order (Opacus' ``get_privacy_spent``)."""
    return rdp - (math.log(delta) + np.log(_ALPHA)) / (_ALPHA - 1) + np.log((_ALPHA - 1) / _ALPHA)


_ALPHA = np.array(ORDERS, dtype=np.float64)
_K = np.arange(ORDERS[-1] + 1, dtype=np.float64)[None, :]
_LOG_BINOM = np.array([[math.lgamma(a + 1) - math.lgamma(k + 1) - math.lgamma(a - k + 1) if k <= a else -np.inf
                        for k in range(ORDERS[-1] + 1)] for a in ORDERS])


def rdp_curve(sigma: float, q: float) -> np.ndarray:
    """One step's Rényi divergence at every order of :data:`ORDERS` (log-sum-exp of eq. 3's terms)."""
    if q >= 1.0:
        return _ALPHA / (2 * sigma**2)
    terms = (_LOG_BINOM + (_ALPHA[:, None] - _K) * math.log1p(-q) + _K * math.log(q)
             + (_K * _K - _K) / (2 * sigma**2))
    top = terms.max(axis=1, keepdims=True)
    return (top[:, 0] + np.log(np.exp(terms - top).sum(axis=1))) / (_ALPHA - 1)


def rdp_sigma(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The σ whose :func:`rdp_epsilon` is ``epsilon`` (bisection; an upper bound of the PRV σ)."""
    lo, hi = SIGMA_FLOOR / 2, 2.0
    while rdp_epsilon(hi, sample_rate, steps, delta) > epsilon and hi < 1e7:
        lo, hi = hi, 2 * hi
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rdp_epsilon(mid, sample_rate, steps, delta) > epsilon else (lo, mid)
    return hi


def prv_grid_points(sigma: float, sample_rate: float, steps: int, delta: float) -> int:
    """Grid points of one PRV evaluation at σ (Opacus' domain with ``δ_err = δ/1000``, with the
    RDP bound at integer orders for ``L``)."""
    delta_error = delta / 1000
    one = rdp_curve(sigma, sample_rate)
    tail = float(np.min(rdp_to_epsilon(steps * one, delta_error / 4)))
    single = float(np.min(rdp_to_epsilon(one, delta_error / (8 * steps))))
    half_width = max(tail, single, EPS_ERROR) + 3
    return int(2 * half_width / _mesh(steps, delta_error)) + 2


def _mesh(steps: int, delta_error: float) -> float:
    return EPS_ERROR / math.sqrt(steps * math.log(12 / delta_error) / 2)


@functools.lru_cache(maxsize=256)
def calibration_problem(epsilon: float, delta: float, sample_rate: float, steps: int,
                        memory_bytes: float) -> str | None:
    """Why σ cannot be calibrated for (ε, δ) over ``steps`` steps at rate ``sample_rate``, or None."""
    if math.isinf(epsilon):
        return None
    if math.isnan(epsilon) or epsilon <= 0:
        return f"privacy.epsilon={epsilon:g} must be > 0 (or inf for a non-private run)"
    if epsilon <= EPS_ERROR / 2:
        return (f"privacy.epsilon={epsilon:g} is within the accountant's error ({EPS_ERROR:g}) of 0, no σ reaches it; "
                f"use privacy.epsilon > {EPS_ERROR:g}")
    fewest = int(2 * (3 + EPS_ERROR) / _mesh(steps, delta / 1000)) + 2  # grid points of any σ (L ≥ 3 + ε_err)
    if np.finfo(np.longdouble).eps * fewest > delta * 0.999:
        return (f"privacy.delta={delta:g} is below what the PRV accountant resolves over {steps} steps (float "
                "rounding on its grid dominates), use privacy.delta >= 1e-12 (the paper: 1e-5)")
    ceiling = rdp_epsilon(SIGMA_FLOOR, sample_rate, steps, delta)
    if epsilon > ceiling:
        return (f"privacy.epsilon={epsilon:g} is beyond what σ calibration can reach: it would need σ < {SIGMA_FLOOR} "
                f"(ε ≤ {ceiling:.4g} at this q = {sample_rate:.3g}, T = {steps}); lower privacy.epsilon, "
                "or use privacy=nondp for a non-private run")
    # the largest grid of Opacus' σ search (get_noise_multiplier): its first evaluation is at σ = 20 and its
    # bisection goes no lower than half the answer (estimated by rdp_sigma)
    lowest = rdp_sigma(epsilon, delta, sample_rate, steps) / 2
    needed = BYTES_PER_POINT * max(prv_grid_points(sigma, sample_rate, steps, delta) for sigma in (20.0, lowest))
    if needed > memory_bytes:
        return (f"σ calibration for train.steps={steps} would need about {needed / 2**30:.0f} GiB for the PRV "
                f"accountant's grid, more than the {memory_bytes / 2**30:.0f} GiB of this machine; lower train.steps")
    return None
