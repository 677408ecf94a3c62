"""Step-level empirical privacy audit of every method (``make audit``).

For each method and canary case, one logical step is released many times from a fixed start
point on neighbouring batches ``D`` (three ordinary examples) and ``D' = D ∪ {canary}``, each
release with fresh noise. The canary's gradient is huge (clipped to C) and placed in a worst-case
direction:

* ``random``   — a random intrinsic gradient ``G``;
* ``vertical`` — ``G`` inside span(A)×span(B), where the lift of eq. 14 puts half of it into the
  r×r vertical (gauge) block of the factor pair;
* ``gauge``    — factor gradients ``(AΩ, −BΩᵀ)`` along a gauge direction (no ``G`` gives them);
* ``near_rank_deficient`` — factors with condition number 2,500 (inside the float32 rank check)
  and ``G`` along their weakest singular directions, scaled to 1e12;
* ``balanced_gauge`` — balanced factors (``AᵀA = BᵀB``, as the retraction returns them, κ = 2,890) and
  a commuting gauge pair ``(AΩ, −BΩᵀ)`` (``MΩ = ΩN``): its lift's image is exactly zero;
* ``balanced_gauge_outside`` — the same plus a ``10⁻⁶``-relative part outside span(A): the image is
  that part alone, which a norm taken as a difference of squares loses (docs/DECISIONS.md D70).

Statistics of each release: the projection of the update ``Z⁺ − Z`` on the canary's image, of the
privatised direction (the noised lift for PRISM, the noised factor gradient for the baselines) on
the canary's, and of its span(A) block on the canary's. :func:`prism.audit.step.threshold_audit`
picks the statistic, threshold and tail on one half of the draws and bounds μ and ε on the other
with Clopper–Pearson intervals (95 % family-wise: Bonferroni over the audited method × case pairs).
One step of a correct mechanism is μ-GDP with μ = 1/σ, so the audit fails (exit 1) if any μ lower
bound exceeds 1/σ. It measures the mechanism alone: no model, tiny factors, the method classes.

A second section replays one real training step of the six shipped methods on a tiny random model on
neighbouring datasets ``D`` and ``D ∪ {x}`` under both protocols (:mod:`prism.audit.neighbours`) and prints the
table method × case of ``max ‖S(D') − S(D)‖ / C``; it fails (exit 1) when a ``corrected`` row exceeds 1 or
takes other branches with ``x`` (``released`` rows are shown, their known defects marked).

    python -m pipelines audit [draws=2000] [sigma=0.6] [methods=prism,adamw] [cases=vertical] [workers=2]
                              [neighbour_draws=1]
"""
from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from pipelines.config.grids import comma_list
from pipelines.runs.runner import PRINT
from prism.audit.step import ThresholdAudit, gdp_epsilon, snr, threshold_audit
from prism.mechanism import geometry
from prism.methods import Method, PrivacySpec, build_method, registry

CASES = ("random", "vertical", "gauge", "near_rank_deficient", "balanced_gauge", "balanced_gauge_outside")
CONF = Path(__file__).resolve().parents[2] / "conf" / "method"
M, N, R = 8, 6, 2
CLIP, DENOMINATOR, DELTA = 1.0, 4.0, 1e-5
A_NAME, B_NAME = "x.lora_B.default.weight", "x.lora_A.default.weight"  # paper A, paper Bᵀ (prism.mechanism.lora)


@dataclass(frozen=True)
class Case:
    """Start factors and per-example factor gradients ``g_A`` [k, m, r], ``g_B`` [k, n, r] of ``D``
    and of the canary (paper notation, float64)."""

    A: Tensor
    B: Tensor
    base: tuple[Tensor, Tensor]
    canary: tuple[Tensor, Tensor]
    imaged: tuple[Tensor, Tensor] | None = None  # the canary's non-gauge part (its whole image), when known


def method_config(name: str) -> DictConfig:
    """``conf/method/<name>.yaml`` with a fixed float lr (the yaml's lr interpolates the suite)."""
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    cfg.lr = 1e-2
    return cfg


def _conditioned(rows: int, kappa: float, g: torch.Generator) -> Tensor:
    Q, _ = torch.linalg.qr(torch.randn(rows, R, generator=g, dtype=torch.float64))
    P, _ = torch.linalg.qr(torch.randn(R, R, generator=g, dtype=torch.float64))
    return (Q * torch.logspace(0.0, -math.log10(kappa), R, dtype=torch.float64)) @ P.T


def _factor_grads(A: Tensor, B: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """``g_A = G B``, ``g_B = Gᵀ A`` for intrinsic gradients ``G`` [k, m, n]."""
    return G @ B, G.mT @ A


def balanced_factors(kappa: float, g: torch.Generator,
                     shape: tuple[int, int, int] = (M, N, R)) -> tuple[Tensor, Tensor, Tensor]:
    """``A = Q_A S W``, ``B = Q_B S W`` (so ``AᵀA = BᵀB = WᵀS²W``, singular values 1 … 1/κ) and ``W``, of
    ``shape`` (m, n, r)."""
    m, n, r = shape
    QA, _ = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))
    QB, _ = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))
    W, _ = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=torch.float64))
    S = torch.logspace(0.0, -math.log10(kappa), r, dtype=torch.float64)
    return QA @ torch.diag(S) @ W, QB @ torch.diag(S) @ W, W


def make_case(name: str, seed: int = 0) -> Case:
    """The start point, the batch ``D`` and the canary of one audit case (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    kappa = 2500.0 if name == "near_rank_deficient" else 3.0
    A, B = _conditioned(M, kappa, g), _conditioned(N, kappa, g)
    base = _factor_grads(A, B, 0.3 * torch.randn(3, M, N, generator=g, dtype=torch.float64))
    UA = torch.linalg.svd(A, full_matrices=True).U
    UB = torch.linalg.svd(B, full_matrices=True).U
    if name == "random":
        canary = _factor_grads(A, B, 1e6 * torch.randn(1, M, N, generator=g, dtype=torch.float64))
    elif name == "vertical":
        W = torch.randn(R, R, generator=g, dtype=torch.float64)
        canary = _factor_grads(A, B, 1e6 * (UA[:, :R] @ W @ UB[:, :R].T)[None])
    elif name == "gauge":
        Omega = 1e6 * torch.randn(R, R, generator=g, dtype=torch.float64)
        canary = ((A @ Omega)[None], (-B @ Omega.T)[None])
    elif name == "near_rank_deficient":
        canary = _factor_grads(A, B, 1e12 * torch.outer(UA[:, R - 1], UB[:, R - 1])[None])
    elif name.startswith("balanced_gauge"):
        A, B, W = balanced_factors(2890.0, g)
        base = _factor_grads(A, B, 0.3 * torch.randn(3, M, N, generator=g, dtype=torch.float64))
        Omega = 1e6 * W.T @ torch.diag(torch.randn(R, generator=g, dtype=torch.float64)) @ W  # commutes with M = N
        gauge = ((A @ Omega)[None], (-B @ Omega.T)[None])
        if name == "balanced_gauge":
            return Case(A=A, B=B, base=base, canary=gauge)
        QA = torch.linalg.qr(A).Q
        Y = torch.randn(M, R, generator=g, dtype=torch.float64)
        outside = (Y - QA @ (QA.T @ Y)) * (1e-6 * float((A @ Omega).norm()) / float(Y.norm()))
        imaged = (outside[None], torch.zeros_like(gauge[1]))
        return Case(A=A, B=B, base=base, canary=(gauge[0] + imaged[0], gauge[1]), imaged=imaged)
    else:
        raise ValueError(f"unknown audit case {name!r}; choose from {', '.join(CASES)}")
    return Case(A=A, B=B, base=base, canary=canary)


def _params(case: Case) -> dict[str, nn.Parameter]:
    return {B_NAME: nn.Parameter(case.B.T.float().clone()), A_NAME: nn.Parameter(case.A.float().clone())}


def _peft_grads(gA: Tensor, gB: Tensor) -> dict[str, Tensor]:
    return {A_NAME: gA.float(), B_NAME: gB.mT.float()}


def _capture(method: Method, sink: list) -> None:
    """Record each step's :class:`~prism.methods.base.Release` (PRISM: the noised, horizontalised lift per
    module; baselines: the noised factor gradients), the one object the update reads, without changing it."""
    inner = method.add_noise

    def recorded(*args, **kwargs):
        out = inner(*args, **kwargs)
        sink.append(out.tensors)
        return out
    method.add_noise = recorded


def release(
    method_name: str, case: Case, with_canary: bool, draws: int, sigma: float, seed: int
) -> dict[str, np.ndarray]:
    """``draws`` one-step releases with noise multiplier ``sigma``; returns each statistic per draw."""
    cfg = method_config(method_name)
    privacy = PrivacySpec(sigma=sigma, clip_norm=CLIP)
    grads = _peft_grads(*(torch.cat([b, c]) if with_canary else b for b, c in zip(case.base, case.canary)))
    spec = registry.lookup(method_name)
    prism = spec.tangent
    gA, gB = (x[0] for x in case.canary)
    if prism:  # the canary's contribution to the privatised direction, up to its clip factor
        cA, cB = geometry.lift(case.A, case.B, gA, gB)
    else:
        cA, cB = gA, (gB if "lora_A" in spec.factors else torch.zeros_like(gB))  # paper B = peft lora_A
    c_norm = math.sqrt(float(cA.square().sum() + cB.square().sum()))
    image = cA @ case.B.T + case.A @ cB.T
    if prism and case.imaged is not None:  # the gauge part's image is exactly zero: take the rest's
        iA, iB = geometry.lift(case.A, case.B, *(x[0] for x in case.imaged))
        image = iA @ case.B.T + case.A @ iB.T
        image = image / image.norm()
    else:
        image = image / image.norm() if image.norm() > 1e-9 * c_norm else None
    QA = torch.linalg.qr(case.A).Q
    span_c = QA @ (QA.T @ cA)
    span_c = span_c / span_c.norm() if span_c.norm() > 1e-9 * c_norm else None
    noise = torch.Generator().manual_seed(seed)
    out: dict[str, list[float]] = {"update": [], "privatised": [], "span(A)": []}
    params = _params(case)
    start = {name: p.detach().clone() for name, p in params.items()}
    method = build_method(cfg, params, privacy)
    fresh = copy.deepcopy(method.state_dict())
    captured: list = []
    _capture(method, captured)
    Z0 = start[A_NAME].double() @ start[B_NAME].double()
    for _ in range(draws):  # the same step from the same start point: parameters and state reset
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(start[name])
        method.load_state_dict(fresh)  # copied into the live state, never aliased
        captured.clear()
        method.zero_accumulators()
        method.accumulate(grads)
        method.step(DENOMINATOR, noise)
        released = captured[0]  # as paper factors (Δ_A, Δ_B), zeros for a factor it lacks
        dA = released[A_NAME].double()
        dB = released[B_NAME].double().T if B_NAME in released else torch.zeros_like(case.B)
        if prism and image is not None:  # intrinsic projection: the tangent noise is isotropic there (eq. 19)
            out["privatised"].append(float(((dA @ case.B.T + case.A @ dB.T) * image).sum()))
        elif not prism:  # the factor noise is isotropic in factor space (eq. 3)
            out["privatised"].append(float((dA * cA).sum() + (dB * cB).sum()) / c_norm)
        if image is not None:
            Z1 = params[A_NAME].detach().double() @ params[B_NAME].detach().double()
            out["update"].append(float(((Z1 - Z0) * image).sum()))
        if span_c is not None:
            out["span(A)"].append(float((dA * span_c).sum()))
    return {k: np.asarray(v) for k, v in out.items() if v}


@dataclass(frozen=True)
class Row:
    """One audited (method, case) pair: the privatised statistic's SNR and the chosen test's bounds."""

    method: str
    case: str
    snr: float
    statistic: str
    result: ThresholdAudit
    cpu_seconds: float


def audit_one(method_name: str, case_name: str, draws: int, sigma: float, confidence: float) -> Row:
    """Both sides of one (method, case) pair and its bounds (the best statistic by the first half)."""
    tic = time.process_time()
    case = make_case(case_name)
    seed = 1000 * registry.names().index(method_name) + 10 * CASES.index(case_name)
    without = release(method_name, case, False, draws, sigma, seed + 1)
    with_ = release(method_name, case, True, draws, sigma, seed + 2)
    picks = {stat: threshold_audit(without[stat][: draws // 2], with_[stat][: draws // 2], DELTA, confidence)
             for stat in without}
    best = max(picks, key=lambda stat: picks[stat].mu_lower)  # the first of equals, in the order of ``without``
    result = threshold_audit(without[best], with_[best], DELTA, confidence)
    ratio = snr(without["privatised"], with_["privatised"]) if "privatised" in without else math.nan
    return Row(method_name, case_name, ratio, best, result, time.process_time() - tic)


def run_audit(methods: Sequence[str], cases: Sequence[str], draws: int, sigma: float, workers: int) -> list[Row]:
    """Audit every (method, case) pair; prints one line per pair as it finishes."""
    pairs = [(m, c) for m in methods for c in cases]
    confidence = 1.0 - 0.05 / len(pairs)
    mu, per_step_eps = 1.0 / sigma, gdp_epsilon(1.0 / sigma, DELTA)
    PRINT(f"σ = {sigma}, μ = 1/σ = {mu:.3f}, per-step ε(δ={DELTA:g}) = {per_step_eps:.3f}; {draws} draws per side; "
          f"Clopper–Pearson {100 * confidence:.2f} % per pair (95 % over {len(pairs)} pairs)")
    PRINT(f"{'method':<12}{'case':<24}{'SNR':>7}{'1/σ':>7}  {'statistic':<11}{'TPR':>7}{'FPR':>7}"
          f"{'μ_lb':>7}{'μ':>7}{'ε_lb':>7}{'ε_step':>8}  verdict")
    rows = []
    args = [(m, c, draws, sigma, confidence) for m, c in pairs]
    with ExitStack() as stack:  # one worker: in this process
        pool = stack.enter_context(ProcessPoolExecutor(max_workers=workers)) if workers > 1 else None
        for row in (pool.map if pool else map)(audit_one, *zip(*args)):
            rows.append(row)
            r = row.result
            verdict = "FAIL" if r.mu_lower > mu else "ok"
            PRINT(f"{row.method:<12}{row.case:<24}{row.snr:>7.3f}{mu:>7.3f}  {row.statistic:<11}{r.tpr:>7.3f}"
                  f"{r.fpr:>7.3f}{r.mu_lower:>7.3f}{mu:>7.3f}{r.epsilon_lower:>7.3f}{per_step_eps:>8.3f}  {verdict}")
    return rows


REPLAYED = ("prism", "adamw", "loraplus", "lamb", "ffa", "lora_rite")
PROTOCOLS = ("corrected", "released")
TINY_STEP = ("backbone=tiny-llama", "suite=glue8", "suite.cutoff_len=1024", "suite.embedded.train_per_task=16", "train.batch_size=8",
             "train.micro_batch_size=4", "train.steps=3", "train.prefix_cache=off", "logging=disabled", "privacy=eps6")
ROW_TOKENS, LONGEST = 48, 96  # tokens kept per training row, and the extreme row's length


def run_neighbours(draws: int) -> int:
    """The record-and-replay section: prints one table per protocol; returns the number of failing
    ``corrected`` cells (a difference above C, or other branches with ``x``)."""
    from pipelines.config.compose import compose_config, resolve
    from prism.audit import neighbours as nb
    from prism.train import build

    failed = 0
    for protocol in PROTOCOLS:
        results = {}
        for method in REPLAYED:
            cfg = resolve(compose_config([*TINY_STEP, f"method={method}", f"protocol={protocol}"]))
            setup = build(cfg)
            nb.shorten(setup, ROW_TOKENS)
            for case in nb.CASES:
                results[method, case] = nb.neighbours(setup, cfg, nb.extra_row(case, setup, LONGEST), draws)
        bad = [k for k, pairs in results.items() if any(p.ratio > 1.0 or not p.same_trace for p in pairs)]
        if protocol == "corrected":
            failed += len(bad)
        flag = " FAIL" if protocol == "corrected" else " (known defect)"
        mark = functools.partial(lambda m, c, bad, flag: flag if (m, c) in bad else "", bad=set(bad), flag=flag)
        PRINT(f"\nneighbouring datasets, protocol={protocol}: max ‖S(D ∪ {{x}}) − S(D)‖ / C over {draws} draw(s)")
        for line in nb.table(results, nb.CASES, mark):
            PRINT(line)
    return failed


def main(*, draws: int = 2000, sigma: float = 0.6, methods: str = ",".join(registry.names()), cases: str = ",".join(CASES),
         workers: int = 2, neighbour_draws: int = 1) -> int:
    """Audit ``methods`` × ``cases`` (comma-separated) with ``draws`` noise draws per side at noise
    multiplier ``sigma`` on ``workers`` processes, then the neighbouring-datasets replay (``neighbour_draws`` per
    cell, 0: skipped); exit 1 if a μ lower bound exceeds 1/σ or a corrected replay cell fails. Bad arguments
    raise a one-line ``ValueError`` before any draw."""
    method_names = comma_list(methods, "methods", choices=registry.names())
    case_names = comma_list(cases, "cases", choices=CASES)
    if draws < 8:
        raise ValueError(f"draws={draws} is too few; use at least 8 (2000 for the audit)")
    if not sigma > 0:
        raise ValueError(f"sigma={sigma} must be > 0")
    if workers < 1:
        raise ValueError(f"workers={workers} must be ≥ 1")
    if neighbour_draws < 0:
        raise ValueError(f"neighbour_draws={neighbour_draws} must be ≥ 0 (0 skips the replay)")
    torch.set_num_threads(1)
    tic = time.perf_counter()
    rows = run_audit(method_names, case_names, draws, sigma, workers)
    failed = [r for r in rows if r.result.mu_lower > 1.0 / sigma]
    cpu = sum(r.cpu_seconds for r in rows)
    print(f"{len(rows)} pairs in {time.perf_counter() - tic:.0f} s ({cpu:.0f} CPU-s in the workers); "
          + (f"FAILED: {len(failed)} μ lower bound(s) above 1/σ" if failed else "no μ lower bound above 1/σ"))
    tic = time.perf_counter()
    replay_failed = run_neighbours(neighbour_draws) if neighbour_draws > 0 else 0
    print(f"neighbouring datasets in {time.perf_counter() - tic:.0f} s; "
          + (f"FAILED: {replay_failed} corrected cell(s) above C or on other branches" if replay_failed
             else "every corrected cell ≤ C on the same branches"))
    return 1 if failed or replay_failed else 0

