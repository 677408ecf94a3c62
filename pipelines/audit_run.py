"""One-run empirical privacy audit of whole training runs (``make audit-run``).

For each method × privacy level, the normal training loop (:func:`prism.train.build`,
:func:`prism.train.train_step`: real sampler, backbone, per-example gradients) trains with ``m`` white-box
gradient canaries (:mod:`prism.audit.canaries`): a secret fair coin includes each, included ones are
Poisson-sampled at the run's rate and clipped and noised by the method's own step. Each canary's score is
the sum over steps of the released privatised quantity projected on its direction. The auditor guesses
"in" for the ``k⁺`` highest scores and "out" for the ``k⁻`` lowest, with ``(k⁺, k⁻)`` fixed before any
score is seen (``--split``: chosen on one half of the canaries, the other half audited), and
:func:`prism.audit.one_run.epsilon_lower_bound` turns the correct guesses into an ε lower bound at
95 % (δ of the run). Alongside: the bound an ideal run with the same ``(σ, q, T, m, k⁺, k⁻)`` gives
(:func:`prism.audit.one_run.expected_bounds`, mean ± sd over 20 simulated runs). ``--expected-only``
prints those expectations for the planned runs without training (σ calibrated as the runs would be).

Default ``k⁻ = 0``: when ``qT`` is about 1 (embedded: q = 0.032, T = 30) a third of the included canaries
is never sampled, so its scores look like the excluded ones' and "out" guesses are at best about 70 %
right even without noise, while "in" guesses on the highest scores can all be right.

A lower bound above the claimed ε is a privacy defect (exit 1). Rows: every method at every ε, plus a
non-private control per method (no clipping, no noise: the bound should be the largest ``m`` and ``k``
allow). Output: ``results/tables/audit_run.<scale>.md`` and ``.csv``, printed at the end.
``python -m pipelines audit-run --help`` lists the arguments (:func:`main`).
"""
from __future__ import annotations

import csv
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pipelines.audit import names
from prism.audit.canaries import CanaryMethod, Space, draw_directions
from prism.audit.one_run import OneRunAudit, audit, expected_bounds, split_audit
from prism.methods import registry

PRINT = functools.partial(print, flush=True)
SCALES = ("embedded", "smoke")
COLUMNS = ("method", "claimed_epsilon", "canaries", "guesses", "correct", "epsilon_lower_95", "mu_gdp_lower_95",
           "epsilon_gdp_lower_95", "ideal_epsilon_lower", "config_hash")


def space_of(method_name: str) -> Space:
    """Where the method clips: the tangent space (PRISM), else the flat factor vector."""
    return "tangent" if registry.lookup(method_name).tangent else "factor"


@dataclass(frozen=True)
class AuditRow:
    """One audited run; ``claimed_epsilon`` is ``inf`` for a non-private control."""

    method: str
    claimed_epsilon: float
    canaries: int
    guesses: int
    correct: int
    epsilon_lower_95: float
    mu_gdp_lower_95: float  # NaN unless k⁻ = 0
    epsilon_gdp_lower_95: float  # the ε at δ of the rejected μ-GDP curve
    ideal_epsilon_lower: str  # "mean ± sd" of ideal runs; "" for a non-private control
    config_hash: str


def split_candidates(half: int) -> list[tuple[int, int]]:
    """``(k⁺, k⁻)`` pairs :func:`split_audit` chooses from on a half of ``half`` canaries."""
    ks = sorted({k for k in (half // 100, half // 40, half // 20, half // 10, half // 5, half // 2) if k >= 1})
    return [(k, 0) for k in ks] + [(k, k) for k in ks if 2 * k <= half]


def audit_method(method, space: Space, canaries: int, k_pos: int, k_neg: int, sample_rate: float, steps: int,
                 step_fn: Callable[[CanaryMethod], None], delta: float, seed: int, split: bool = False,
                 report: Callable[[str], None] = PRINT) -> tuple[OneRunAudit, CanaryMethod]:
    """Train ``steps`` logical steps of ``method`` with canaries (``step_fn`` runs one step of the loop on
    the wrapped method) and audit them with fixed ``(k⁺, k⁻)``, or with ``split`` by :func:`split_audit`.
    Returns the audit and the wrapped method."""
    rng = np.random.default_rng(seed)
    included = rng.random(canaries) < 0.5  # the secret coins
    directions = draw_directions(space, method.params, canaries, seed + 1)
    wrapped = CanaryMethod(method, directions, included, sample_rate, seed + 2)
    tic = time.perf_counter()
    for t in range(steps):
        step_fn(wrapped)
        if (t + 1) % max(1, steps // 10) == 0 or t + 1 == steps:
            report(f"  step {t + 1}/{steps} ({time.perf_counter() - tic:.0f} s)")
    scores = wrapped.scores.numpy()
    if split:
        return split_audit(scores, included, split_candidates(canaries // 2), delta), wrapped
    return audit(scores, included, k_pos, k_neg, delta), wrapped


def _privacy_overrides(epsilon: float) -> list[str]:
    if math.isinf(epsilon):
        return ["privacy=nondp"]
    if epsilon in (3.0, 6.0):
        return [f"privacy=eps{epsilon:g}"]
    return ["privacy=eps6", f"privacy.name=eps{epsilon:g}", f"privacy.epsilon={epsilon:g}"]


def job_config(method_name: str, epsilon: float, scale: str):
    """The validated job config of ``method × ε`` at ``scale`` (what ``pipelines.run`` would train)."""
    from pipelines.validate import load_job

    return load_job([f"method={method_name}", f"scale={scale}", *_privacy_overrides(epsilon)])


def audit_training_run(cfg, canaries: int, k_pos: int, k_neg: int, split: bool, seed: int,
                       report: Callable[[str], None] = PRINT) -> AuditRow:
    """Build the run of ``cfg`` (:func:`job_config`) and train it with canaries."""
    from pipelines.store import run_hash
    from prism.train import build, total_steps, train_step

    method_name, epsilon = str(cfg.method.name), float(cfg.privacy.epsilon)
    s = build(cfg)
    steps = total_steps(cfg)

    def step_fn(wrapped: CanaryMethod) -> None:
        s.method = wrapped
        train_step(s, cfg)

    result, _ = audit_method(s.method, space_of(method_name), canaries, k_pos, k_neg, s.sampler.sample_rate, steps,
                             step_fn, float(cfg.privacy.delta), seed, split, report)
    ideal = ""
    if s.method.dp:
        mean, sd, _ = expected_bounds(result.canaries, result.k_pos, result.k_neg, s.sigma, s.sampler.sample_rate,
                                      steps, seed=seed)
        ideal = f"{mean:.2f} ± {sd:.2f}"
    return AuditRow(method_name, epsilon, result.canaries, result.guesses, result.correct, result.epsilon_lower,
                    result.mu_lower, gdp_equivalent(result.mu_lower, float(cfg.privacy.delta)), ideal, run_hash(cfg))


def gdp_equivalent(mu: float, delta: float) -> float:
    """The ε at δ of the μ-GDP curve (0 for μ = 0, NaN for NaN)."""
    from prism.audit.step import gdp_epsilon

    return mu if math.isnan(mu) or mu == 0 else gdp_epsilon(mu, delta)


def training_rows(cfg) -> int:
    """Training-set size of an embedded/smoke suite from its config (``train_per_task``: per task or one count)."""
    per_task = cfg.suite.get("embedded", {}).get("train_per_task") if "embedded" in cfg.suite else None
    if per_task is None:
        raise ValueError(f"suite {cfg.suite.name} at scale {cfg.suite.scale} has no suite.embedded.train_per_task; "
                         "--expected-only needs an embedded or smoke suite")
    return int(sum(per_task.values())) if hasattr(per_task, "values") else int(per_task) * len(cfg.suite.embedded.tasks)


def expected_lines(configs, canaries: int, k_pos: int, k_neg: int, seed: int) -> list[str]:
    """One line per DP config: σ, q, T and what a correct run's audit gives (:func:`expected_bounds`)."""
    from prism.privacy.accounting import calibrate_for_run
    from prism.train import total_steps

    lines = ["| method | claimed ε | σ | q | T | m | k⁺ | k⁻ | ε bound of a correct run | μ-GDP bound |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for cfg in configs:
        epsilon = float(cfg.privacy.epsilon)
        if math.isinf(epsilon):
            continue
        q, steps = cfg.train.batch_size / training_rows(cfg), total_steps(cfg)
        sigma = calibrate_for_run(epsilon, float(cfg.privacy.delta), q, steps, cfg.privacy.calibration)
        mean, sd, mu = expected_bounds(canaries, k_pos, k_neg, sigma, q, steps, delta=float(cfg.privacy.delta),
                                       seed=seed)
        lines.append(f"| {cfg.method.name} | {epsilon:g} | {sigma:.4f} | {q:.4g} | {steps} | {canaries} | {k_pos} | "
                     f"{k_neg} | {mean:.2f} ± {sd:.2f} | {'–' if math.isnan(mu) else f'{mu:.2f}'} |")
    return lines


def write_table(rows: Sequence[AuditRow], scale: str, out_dir: Path) -> tuple[Path, Path]:
    """``audit_run.<scale>.md`` (people) and ``.csv`` (machines) under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path = out_dir / f"audit_run.{scale}.md", out_dir / f"audit_run.{scale}.csv"
    with csv_path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    header = ("| method | claimed ε | m | guesses | correct | ε lower bound (95 %) | μ-GDP lower bound (ε at δ) "
              "| ideal run's ε bound | config |\n|---|---:|---:|---:|---:|---:|---:|---:|---|\n")
    body = "".join(
        f"| {r.method} | {'∞ (non-private)' if math.isinf(r.claimed_epsilon) else f'{r.claimed_epsilon:g}'} | "
        f"{r.canaries} | {r.guesses} | {r.correct} | {r.epsilon_lower_95:.2f} | {_gdp_cell(r)} | {r.ideal_epsilon_lower or '–'} | "
        f"`{r.config_hash}` |\n" for r in rows)
    note = ("\nOne-run audit (Steinke, Nasr & Jagielski 2023) with white-box gradient canaries: a lower bound on ε "
            "at 95 % confidence, loose by design; 'ideal run's bound' is what a correct mechanism with the same "
            "σ, q, T, m and guesses gives when canaries do not interfere (mean ± sd of 20 simulated runs). "
            "A bound above the claimed ε is a privacy defect. The μ-GDP column (Mahloujifar, Melis & Chaudhuri 2025, "
            "'in' guesses only) rejects Gaussian-shaped trade-off curves: it speaks of the μ-GDP hypothesis, "
            "not of (ε, δ)-DP.\n")
    md.write_text(f"# One-run privacy audit ({scale} scale)\n\n" + header + body + note)
    return md, csv_path


def _gdp_cell(r: AuditRow) -> str:
    if math.isnan(r.mu_gdp_lower_95):
        return "–"
    return f"{r.mu_gdp_lower_95:.2f} ({r.epsilon_gdp_lower_95:.2f})"


def _epsilons(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"epsilons={text!r} is not a comma-separated list of numbers; e.g. epsilons=6,3") from None
    if not values or not all(0 < v < math.inf for v in values):
        raise ValueError(f"epsilons={text!r}: each ε must be finite and > 0 (the non-private control is its own row)")
    return values


def main(*, scale: str = "embedded", methods: str = "prism,adamw", epsilons: str = "6,3", canaries: int = 1000,
         k_pos: int = 100, k_neg: int = 0, seed: int = 0, out: str = "results/tables", split: bool = False,
         no_control: bool = False, expected_only: bool = False) -> int:
    """Train every method at every ε (scale embedded|smoke) and a non-private control per method (unless
    ``--no-control``) with ``canaries`` canaries, guess ``k_pos`` in / ``k_neg`` out (``--split``: chosen on
    one half, audited on the other; ``seed``: the coins and directions) and write the table to ``out``;
    ``--expected-only``: print what correct runs give, without training. Exit 1 on a lower bound above
    the claimed ε; bad arguments raise a one-line ``ValueError`` before any model load."""
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r}; choose one of {', '.join(SCALES)}")
    method_names = names(methods, registry.names(), "methods")
    budgets = _epsilons(epsilons)
    if canaries < 2:
        raise ValueError(f"canaries={canaries} must be ≥ 2 (1000 for the audit)")
    if min(k_pos, k_neg) < 0 or not 1 <= k_pos + k_neg <= canaries:
        raise ValueError(f"k_pos={k_pos} k_neg={k_neg}: each must be ≥ 0, their sum in [1, canaries = {canaries}]")
    if 2 * canaries * 1e-5 > 1:
        raise ValueError(f"canaries={canaries}: at most 50000 (the bound needs 2·m·δ ≤ 1 at δ = 1e-5)")
    plan = [(m, e) for m in method_names for e in budgets] + ([] if no_control else [(m, math.inf) for m in method_names])
    configs = [job_config(m, e, scale) for m, e in plan]  # every config checked before any model load
    if expected_only:
        PRINT("\n".join(expected_lines(configs, canaries, k_pos, k_neg, seed)))
        return 0
    from pipelines.run import quiet_third_party_warnings, setup_logging

    quiet_third_party_warnings()
    setup_logging()
    tic = time.perf_counter()
    rows = []
    for i, ((method_name, epsilon), cfg) in enumerate(zip(plan, configs), 1):
        PRINT(f"[{i}/{len(plan)}] {method_name} at ε = {epsilon:g}: training with {canaries} canaries")
        rows.append(audit_training_run(cfg, canaries, k_pos, k_neg, split, seed))
        r = rows[-1]
        PRINT(f"  {r.correct}/{r.guesses} correct guesses: ε ≥ {r.epsilon_lower_95:.2f} (95 %); ideal run {r.ideal_epsilon_lower or '–'}")
    md, csv_path = write_table(rows, scale, Path(out))
    PRINT(md.read_text())
    defects = [r for r in rows if r.epsilon_lower_95 > r.claimed_epsilon]
    PRINT(f"{len(rows)} runs in {time.perf_counter() - tic:.0f} s; tables: {md}, {csv_path}; "
          + (f"DEFECT: {len(defects)} lower bound(s) above the claimed ε" if defects else "no lower bound above the claimed ε"))
    return 1 if defects else 0

