"""Privacy accounting for Poisson-subsampled Gaussian DP-SGD (docs/DECISIONS.md D1, D21; paper App. B.1).

The paper calibrates the noise multiplier σ with Opacus' PRV accountant (Gopi et al. 2021) for
Poisson sampling at rate ``q = B/N`` over ``T`` steps at ``δ = 1e-5`` (Thm 3.4 assumes exactly this
mechanism). Everything here is a thin, validated layer over Opacus' accountants: σ calibration
(:func:`calibrate_for_run`, for the exact ``T`` or the released code's epoch-rounded steps), ε of a
given σ (:func:`epsilon_spent`) and the running ε of a training run (:class:`Accountant`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from opacus.accountants import PRVAccountant, RDPAccountant, create_accountant
from opacus.accountants.analysis import rdp as rdp_analysis
from opacus.accountants.analysis.prv import Domain
from opacus.accountants.utils import get_noise_multiplier

from prism.fileio import write_text_atomic
from prism.privacy.limits import EPS_ERROR, SIGMA_FLOOR, calibration_problem, is_calibrated

ACCOUNTANTS = ("prv", "rdp", "gdp")
CALIBRATION_MODES = ("exact", "epochs")


def _check(delta: float | None = None, sample_rate: float | None = None, steps: int | None = None,
           accountant: str | None = None) -> None:
    """A one-line error naming the config field for the first of the given arguments that is out of range."""
    if delta is not None and not 0.0 < delta < 1.0:
        raise ValueError(f"delta={delta} must lie in (0, 1); set privacy.delta, e.g. 1e-5")
    if sample_rate is not None and not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate={sample_rate} must lie in (0, 1]; it is q = train.batch_size / #examples, "
                         "so lower train.batch_size or use more training examples")
    if steps is not None and steps < 1:
        raise ValueError(f"steps={steps} must be ≥ 1; set train.steps to a positive integer")
    if accountant is not None and accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}; use one of {ACCOUNTANTS}")


def _epoch_rounded(mode: str) -> bool:
    """Whether calibration ``mode`` is the released code's ``"epochs"`` (else ``"exact"``)."""
    if mode not in CALIBRATION_MODES:
        raise ValueError(f"unknown calibration mode {mode!r}; set privacy.calibration to one of {CALIBRATION_MODES}")
    return mode == "epochs"


@contextmanager
def _quiet_rdp_bound() -> Iterator[None]:
    """PRV sizes its domain from an RDP bound that warns about its alpha grid; that is not about ε."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        yield


def _epsilon_kwargs(accountant: str, eps_error: float) -> dict[str, float]:
    """Only the PRV accountant takes a numerical error bound."""
    return {"eps_error": eps_error} if accountant == "prv" else {}


def calibrate_sigma(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "prv",
                    eps_error: float = EPS_ERROR) -> float:
    """Noise multiplier σ such that ``T = steps`` Poisson-subsampled Gaussian steps are (ε, δ)-DP:
    Opacus' ``get_noise_multiplier`` with the accountant passed explicitly (Opacus defaults to RDP; the
    paper used PRV), within ``eps_error`` below the target. ``epsilon = inf`` (non-DP) gives 0.0."""
    if math.isnan(epsilon) or epsilon <= 0:
        raise ValueError(f"epsilon={epsilon} must be > 0; set privacy.epsilon (use .inf for non-DP)")
    _check(delta, sample_rate, steps, accountant)
    if math.isinf(epsilon):
        return 0.0
    # Bounded search (prism/privacy/limits.py): refuse what Opacus' search cannot finish, i.e. a target
    # reached only below SIGMA_FLOOR (its bisection then stays above SIGMA_FLOOR / 2) or a grid too big.
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    problem = calibration_problem(epsilon, delta, sample_rate, steps, memory) if accountant == "prv" else None
    if problem is None and (floor := epsilon_spent(SIGMA_FLOOR, sample_rate, steps, delta, accountant, eps_error)) < epsilon:
        problem = (f"privacy.epsilon={epsilon:g} is beyond what σ calibration can reach: σ = {SIGMA_FLOOR} already "
                   f"spends only ε = {floor:.4g}; lower privacy.epsilon, or use privacy=nondp for a non-private run")
    if problem is not None:
        raise ValueError(problem)
    with _quiet_rdp_bound():
        try:
            sigma = get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate,
                                         steps=steps, accountant=accountant, epsilon_tolerance=eps_error,
                                         **_epsilon_kwargs(accountant, eps_error))
        except ValueError as err:  # Opacus: σ > 1e6 still spends more ("The privacy budget is too low.")
            raise ValueError(f"privacy.epsilon={epsilon:g} is too small to calibrate: even σ = 1e6 spends more "
                             f"({err}); raise privacy.epsilon") from None
    return float(sigma)


def epsilon_spent(sigma: float, sample_rate: float, steps: int, delta: float, accountant: str = "prv",
                  eps_error: float = EPS_ERROR) -> float:
    """ε after ``steps`` Poisson-subsampled Gaussian steps with noise multiplier σ (upper bound; σ = 0: ∞)."""
    if sigma < 0:
        raise ValueError(f"sigma={sigma} must be ≥ 0")
    _check(delta, sample_rate, steps, accountant)
    if sigma == 0:
        return math.inf
    acc = create_accountant(mechanism=accountant)
    acc.history = [(float(sigma), float(sample_rate), int(steps))]
    with _quiet_rdp_bound():
        return float(acc.get_epsilon(delta=delta, **_epsilon_kwargs(accountant, eps_error)))


def calibration_steps(steps: int, sample_rate: float, mode: str) -> int:
    """The step count σ is calibrated for (docs/DECISIONS.md D1): ``steps`` (``"exact"``) or the released
    code's ``⌈steps / L⌉ · L`` with ``L = ⌈1/q⌉`` Poisson batches per epoch (``"epochs"``, e.g. 310 for 300
    Math-10K steps: a σ slightly larger than needed, so the realised ε falls below the target)."""
    _check(sample_rate=sample_rate, steps=steps)
    if not _epoch_rounded(mode):
        return steps
    batches_per_epoch = _batches_per_epoch(sample_rate)
    return math.ceil(steps / batches_per_epoch) * batches_per_epoch


def calibration_rate(sample_rate: float, mode: str) -> float:
    """The sampling rate σ is calibrated at: ``q = B/N`` (``"exact"``) or the released code's loader
    rate ``1/L``, ``L = ⌈1/q⌉`` (``"epochs"``; Opacus' ``DPDataLoader`` samples at ``1/len(loader)``)."""
    _check(sample_rate=sample_rate)
    return 1.0 / _batches_per_epoch(sample_rate) if _epoch_rounded(mode) else sample_rate


def calibrate_for_run(epsilon: float, delta: float, sample_rate: float, steps: int, mode: str,
                      cache_dir: Path | None = None) -> float:
    """σ of a run of ``steps`` Poisson steps at rate ``sample_rate`` under calibration ``mode`` (:func:`calibration_rate`,
    :func:`calibration_steps`), through :func:`calibrate_sigma_cached` (the same σ, bit for bit) with ``cache_dir``."""
    args = (epsilon, delta, calibration_rate(sample_rate, mode), calibration_steps(steps, sample_rate, mode))
    return calibrate_sigma(*args) if cache_dir is None else calibrate_sigma_cached(*args, cache_dir=cache_dir)


def calibrate_sigma_cached(epsilon: float, delta: float, sample_rate: float, steps: int, *, cache_dir: Path,
                           accountant: str = "prv", eps_error: float = EPS_ERROR) -> float:
    """:func:`calibrate_sigma`, remembered in ``cache_dir`` (one small JSON file per question; a σ is public): a
    stored σ is used only if its file holds exactly these arguments (and this Opacus version) and
    :func:`epsilon_spent` at that σ is calibrated to ``epsilon`` again (:func:`is_calibrated`: neither above
    it, a σ too small, nor more than :data:`~prism.privacy.limits.CALIBRATED_BELOW` below it, a σ too large for the row's ε);
    otherwise σ is recomputed and the file rewritten."""
    question = {"epsilon": float(epsilon), "delta": float(delta), "sample_rate": float(sample_rate),
                "steps": int(steps), "accountant": accountant, "eps_error": float(eps_error),
                "opacus": _opacus_version()}
    key = hashlib.sha256(json.dumps(question, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"{key}.json"
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        stored = json.loads(path.read_text(encoding="utf-8"))
        sigma = float(stored["sigma"])
        if (stored["question"] == question and sigma > 0
                and is_calibrated(epsilon_spent(sigma, sample_rate, steps, delta, accountant, eps_error), epsilon)):
            return sigma
    sigma = calibrate_sigma(epsilon, delta, sample_rate, steps, accountant, eps_error)
    if sigma > 0:
        with contextlib.suppress(OSError):
            write_text_atomic(path, json.dumps({"question": question, "sigma": sigma}, sort_keys=True) + "\n")
    return sigma


def _opacus_version() -> str:
    try:
        return importlib.metadata.version("opacus")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _batches_per_epoch(sample_rate: float) -> int:
    """``L = ⌈1/q⌉`` (rounded first, so ``q = 64/9600`` gives 150, not 151)."""
    return math.ceil(round(1.0 / sample_rate, 9))


@functools.lru_cache(maxsize=64)
def _rdp_curve(sigma: float, sample_rate: float) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian step at Opacus' default orders."""
    return np.asarray(rdp_analysis.compute_rdp(q=sample_rate, noise_multiplier=sigma, steps=1,
                                               orders=RDPAccountant.DEFAULT_ALPHAS))


def _rdp_epsilon(rdp: np.ndarray, delta: float) -> float:
    eps, _ = rdp_analysis.get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)
    return float(eps)


class _RunningPRVAccountant(PRVAccountant):
    """Opacus' PRV accountant whose discretisation domain (bounded with RDP, Gopi et al. 2021, Remark 5.6)
    reuses each (σ, q)'s one-step RDP curve: RDP composes additively, so the domain, hence ε, is unchanged,
    without Opacus' recomputation of the curve, about 3/4 of an ``epsilon`` call."""

    def _get_domain(self, prvs: list[Any], num_self_compositions: list[int], eps_error: float,
                    delta_error: float) -> Domain:
        total = sum(num_self_compositions)
        curves = [_rdp_curve(prv.noise_multiplier, prv.sample_rate) for prv in prvs]
        L = _rdp_epsilon(sum(n * c for n, c in zip(num_self_compositions, curves)), delta_error / 4)
        for curve in curves:
            L = max(L, _rdp_epsilon(curve, delta_error / (8 * total)))
        L = max(L, eps_error) + 3
        mesh_size = eps_error / np.sqrt(total * np.log(12 / delta_error) / 2)
        return Domain.create_aligned(-L, L, mesh_size)


class Accountant:
    """Running privacy loss of one training run (Opacus PRV accountant, docs/DECISIONS.md D21).

    :meth:`step` once per logical step, an empty Poisson batch included. :meth:`epsilon` equals Opacus'
    ``PRVAccountant.get_epsilon`` (~0.1 s at T ≤ 500 with the cached RDP curve, so every step) and is
    cached until the next step; :meth:`state_dict` holds the history, so a resumed run reports the same ε.
    """

    def __init__(self, accountant: str = "prv", eps_error: float = EPS_ERROR) -> None:
        _check(accountant=accountant)
        self._accountant = _RunningPRVAccountant() if accountant == "prv" else create_accountant(mechanism=accountant)
        self._mechanism = accountant
        self._eps_error = eps_error
        self._cache: tuple[tuple[Any, ...], float, float] | None = None

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """``[(σ, q, number of consecutive steps with them), …]`` in Opacus' format."""
        return [tuple(entry) for entry in self._accountant.history]

    @property
    def steps(self) -> int:
        return sum(entry[2] for entry in self._accountant.history)

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Record one logical step of the Poisson-subsampled Gaussian mechanism."""
        if noise_multiplier <= 0:
            raise ValueError(f"noise_multiplier={noise_multiplier} must be > 0; non-DP runs need no accountant")
        _check(sample_rate=sample_rate)
        self._accountant.step(noise_multiplier=float(noise_multiplier), sample_rate=float(sample_rate))

    def epsilon(self, delta: float) -> float:
        """ε spent so far at ``delta`` (0.0 before the first step)."""
        _check(delta=delta)
        if not self._accountant.history:
            return 0.0
        key = tuple(self.history)
        if self._cache is not None and self._cache[0] == key and self._cache[1] == delta:
            return self._cache[2]
        with _quiet_rdp_bound():
            eps = float(self._accountant.get_epsilon(delta=delta, **_epsilon_kwargs(self._mechanism, self._eps_error)))
        self._cache = (key, delta, eps)
        return eps

    def state_dict(self) -> dict[str, Any]:
        return {"mechanism": self._mechanism, "history": [list(entry) for entry in self.history]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["mechanism"] != self._mechanism:
            raise ValueError(f"checkpoint was accounted with {state['mechanism']!r}, this run uses "
                             f"{self._mechanism!r}; resume with the same accountant")
        self._accountant.history = [(float(s), float(q), int(t)) for s, q, t in state["history"]]
        self._cache = None


def is_private(cfg: Any) -> bool:
    """Whether a run is differentially private: a finite ``privacy.epsilon`` (``cfg`` is the run config)."""
    return math.isfinite(float(cfg.privacy.epsilon))
