"""One-run empirical privacy audit of whole training runs (``make audit-run``); docs/audit.md explains it.

For each method × privacy level, the normal training loop (:func:`prism.train.build`,
:func:`prism.train.train_step`) trains with ``m`` white-box gradient canaries (:mod:`prism.audit.canaries`)
that a secret fair coin includes; each step's privatised release is projected on every canary, a canary's
score is :func:`prism.audit.one_run.filtered_scores` of its projections, and the auditor guesses "in" for
the ``k⁺`` highest (default ``m/4``) and "out" for the ``k⁻`` lowest (default 0), fixed before any score is
seen (``--split``: chosen on one half of the canaries, the other half audited). The correct guesses give
two ε lower bounds at 95 %: Steinke, Nasr & Jagielski (2023) and the f-DP audit of Mahloujifar, Melis &
Chaudhuri (2025); beside them, what an ideal run gives (:func:`prism.audit.one_run.expected_bounds`).
``--expected-only`` prints those expectations for the planned runs without training.

Rows: every method at every ε; per method and ε a broken-noise control (the same run with every noise
draw times :data:`BROKEN_NOISE_SCALE`, σ, accountant and claimed ε unchanged: :class:`BrokenNoise`, which
exists only here and is never exported); a non-private control per method. Exit 1 if a genuine row's
bound exceeds its claimed ε, or if a broken control's bounds both stay at or below it. Output:
``results/tables/audit_run.<scale>.md`` and ``.csv``. ``python -m pipelines audit-run --help`` lists the
arguments (:func:`main`).
"""
from __future__ import annotations

import csv
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from pipelines.config.grids import NUMBERS, comma_list
from pipelines.runs.runner import PRINT
from prism.audit.canaries import CanaryMethod, Space, draw_directions
from prism.audit.one_run import OneRunAudit, audit, expected_bounds, split_audit
from prism.audit.step import gdp_epsilon
from prism.methods import registry
from prism.privacy.noise import NoiseSource

SCALES = ("embedded", "smoke")
COLUMNS = ("method", "row", "claimed_epsilon", "canaries", "guesses", "correct", "epsilon_lower_95",
           "epsilon_fdp_lower_95", "mu_gdp_lower_95", "epsilon_gdp_lower_95", "ideal_epsilon_lower", "config_hash")
GENUINE, BROKEN, NONPRIVATE = "DP run", "control: noise ÷ 10", "control: non-private"
BROKEN_NOISE_SCALE = 0.1  # the broken control's noise draws, relative to the run's own


class BrokenNoise:
    """Audit-only noise source: the run's own unit normals times :data:`BROKEN_NOISE_SCALE`, so the run
    adds a tenth of the noise its σ and ε claim (a broken mechanism the audit must catch)."""

    def __init__(self, inner: NoiseSource) -> None:
        self.inner = inner

    def normal(self, shape: tuple[int, ...], device: torch.device) -> Tensor:
        return BROKEN_NOISE_SCALE * self.inner.normal(shape, device)


@dataclass(frozen=True)
class AuditRow:
    """One audited run; ``row`` is :data:`GENUINE`, :data:`BROKEN` or :data:`NONPRIVATE`;
    ``claimed_epsilon`` is ``inf`` for a non-private control."""

    method: str
    row: str
    claimed_epsilon: float
    canaries: int
    guesses: int
    correct: int
    epsilon_lower_95: float  # Steinke, Nasr & Jagielski 2023
    epsilon_fdp_lower_95: float  # f-DP audit against the (ε, δ) curve; NaN unless k⁻ = 0
    mu_gdp_lower_95: float  # NaN unless k⁻ = 0
    epsilon_gdp_lower_95: float  # the ε at δ of the rejected μ-GDP curve
    ideal_epsilon_lower: str  # "mean ± sd" of ideal runs; "" for a non-private control
    config_hash: str

    @property
    def bound(self) -> float:
        """The larger of the two ε lower bounds (for a correct run, above ε with probability ≤ 10 %)."""
        return max(self.epsilon_lower_95, self.epsilon_fdp_lower_95)  # max keeps its first argument over a NaN


def split_candidates(half: int) -> list[tuple[int, int]]:
    """``(k⁺, k⁻)`` pairs :func:`split_audit` chooses from on a half of ``half`` canaries."""
    ks = sorted({k for k in (half // 100, half // 40, half // 20, half // 10, half // 5, half // 2) if k >= 1})
    return [(k, 0) for k in ks] + [(k, k) for k in ks if 2 * k <= half]


def audit_method(method, space: Space, canaries: int, k_pos: int, k_neg: int, sample_rate: float, steps: int,
                 step_fn: Callable[[CanaryMethod], None], delta: float, seed: int, split: bool = False,
                 report: Callable[[str], None] = PRINT, filtered: bool = False) -> tuple[OneRunAudit, CanaryMethod]:
    """Train ``steps`` logical steps of ``method`` with canaries (``step_fn`` runs one step of the loop on
    the wrapped method) and audit them with fixed ``(k⁺, k⁻)``, or with ``split`` by :func:`split_audit`.
    Returns the audit and the wrapped method."""
    rng = np.random.default_rng(seed)
    included = rng.random(canaries) < 0.5  # the secret coins
    directions = draw_directions(space, method.params, canaries, seed + 1)
    wrapped = CanaryMethod(method, directions, included, sample_rate, seed + 2, filtered)
    tic = time.perf_counter()
    for t in range(steps):
        step_fn(wrapped)
        if (t + 1) % max(1, steps // 10) == 0 or t + 1 == steps:
            report(f"  step {t + 1}/{steps} ({time.perf_counter() - tic:.0f} s)")
    scores = wrapped.scores.numpy()
    if split:
        return split_audit(scores, included, split_candidates(canaries // 2), delta), wrapped
    return audit(scores, included, k_pos, k_neg, delta), wrapped


def job_config(method_name: str, epsilon: float, scale: str):
    """The validated job config of ``method × ε`` at ``scale`` (what ``pipelines.runs.runner`` would train)."""
    from pipelines.config.grids import privacy_overrides
    from pipelines.config.validate import load_job

    return load_job([f"method={method_name}", f"scale={scale}", *privacy_overrides(epsilon)])


def audit_training_run(cfg, canaries: int, k_pos: int, k_neg: int, split: bool, seed: int,
                       broken: bool = False) -> AuditRow:
    """Build the run of ``cfg`` (:func:`job_config`) and train it with canaries; with ``broken`` (a DP
    ``cfg`` only) the run's noise source is wrapped in :class:`BrokenNoise`: the broken-noise control."""
    from pipelines.config.identity import run_hash
    from prism.train import build, total_steps, train_step

    method_name, epsilon = str(cfg.method.name), float(cfg.privacy.epsilon)
    s = build(cfg)
    if broken:
        if not s.method.dp:
            raise ValueError("the broken-noise control needs a DP run")
        s.noise = BrokenNoise(s.noise)
    steps = total_steps(cfg)

    def step_fn(wrapped: CanaryMethod) -> None:
        s.method = wrapped
        train_step(s, cfg)

    space: Space = "tangent" if registry.lookup(method_name).tangent else "factor"  # where the method clips
    result, _ = audit_method(s.method, space, canaries, k_pos, k_neg, s.sampler.sample_rate, steps, step_fn,
                             float(cfg.privacy.delta), seed, split, filtered=True)
    ideal = ""
    if s.method.dp:
        sigma = s.sigma * (BROKEN_NOISE_SCALE if broken else 1.0)
        mean, sd, _ = expected_bounds(result.canaries, result.k_pos, result.k_neg, sigma, s.sampler.sample_rate,
                                      steps, delta=float(cfg.privacy.delta), seed=seed, fdp=result.k_neg == 0,
                                      filtered=True)
        ideal = f"{mean:.2f} ± {sd:.2f}"
    row = BROKEN if broken else GENUINE if s.method.dp else NONPRIVATE
    mu = result.mu_lower
    mu_eps = mu if math.isnan(mu) or mu == 0 else gdp_epsilon(mu, float(cfg.privacy.delta))  # ε at δ of the μ-GDP curve
    return AuditRow(method_name, row, epsilon, result.canaries, result.guesses, result.correct, result.epsilon_lower,
                    result.epsilon_fdp_lower, mu, mu_eps, ideal, run_hash(cfg))


def training_rows(cfg) -> int:
    """Training-set size of an embedded/smoke suite from its config (``train_per_task``: per task or one count)."""
    per_task = cfg.suite.get("embedded", {}).get("train_per_task") if "embedded" in cfg.suite else None
    if per_task is None:
        raise ValueError(f"suite {cfg.suite.name} at scale {cfg.suite.scale} has no suite.embedded.train_per_task; "
                         "--expected-only needs an embedded or smoke suite")
    return int(sum(per_task.values())) if hasattr(per_task, "values") else int(per_task) * len(cfg.suite.embedded.tasks)


def expected_lines(configs, rows: Sequence[str], canaries: int, k_pos: int, k_neg: int, seed: int) -> list[str]:
    """One line per DP config (``rows[i]``: :data:`GENUINE` or :data:`BROKEN`): σ, q, T and what an ideal run's
    audit gives (:func:`expected_bounds`; the broken control at σ × :data:`BROKEN_NOISE_SCALE`)."""
    from prism.privacy.accounting import calibrate_for_run
    from prism.train import total_steps

    lines = ["| method | row | claimed ε | σ of the noise added | q | T | m | k⁺ | k⁻ | Steinke ε bound | "
             "f-DP ε bound | μ-GDP bound |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for cfg, row in zip(configs, rows):
        epsilon = float(cfg.privacy.epsilon)
        if math.isinf(epsilon):
            continue
        q, steps = cfg.train.batch_size / training_rows(cfg), total_steps(cfg)
        sigma = calibrate_for_run(epsilon, float(cfg.privacy.delta), q, steps, cfg.privacy.calibration)
        sigma *= BROKEN_NOISE_SCALE if row == BROKEN else 1.0
        cells = []
        for fdp in (False, True):
            if fdp and k_neg:
                cells.append("–")
                continue
            mean, sd, mu = expected_bounds(canaries, k_pos, k_neg, sigma, q, steps, delta=float(cfg.privacy.delta),
                                           seed=seed, fdp=fdp, filtered=True)
            cells.append(f"{mean:.2f} ± {sd:.2f}")
        lines.append(f"| {cfg.method.name} | {row} | {epsilon:g} | {sigma:.4f} | {q:.4g} | {steps} | {canaries} | "
                     f"{k_pos} | {k_neg} | {' | '.join(cells)} | {'–' if math.isnan(mu) else f'{mu:.2f}'} |")
    return lines


def write_table(rows: Sequence[AuditRow], scale: str, out_dir: Path) -> tuple[Path, Path]:
    """``audit_run.<scale>.md`` (people) and ``.csv`` (machines) under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path = out_dir / f"audit_run.{scale}.md", out_dir / f"audit_run.{scale}.csv"
    with csv_path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    header = ("| method | row | claimed ε | m | guesses | correct | ε lower bound (95 %, Steinke) "
              "| ε lower bound (95 %, f-DP) | μ-GDP lower bound (ε at δ) | ideal run's ε bound | verdict | config |\n"
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|\n")
    body = "".join(
        f"| {r.method} | {r.row} | {'∞ (non-private)' if math.isinf(r.claimed_epsilon) else f'{r.claimed_epsilon:g}'} | "
        f"{r.canaries} | {r.guesses} | {r.correct} | {r.epsilon_lower_95:.2f} | {_cell(r.epsilon_fdp_lower_95)} | "
        f"{_gdp_cell(r)} | {r.ideal_epsilon_lower or '–'} | {verdict(r)} | `{r.config_hash}` |\n" for r in rows)
    note = ("\nOne-run audit with white-box gradient canaries: lower bounds on ε at 95 % confidence, loose by design, "
            "from Steinke, Nasr & Jagielski (2023) and from the f-DP audit of Mahloujifar, Melis & Chaudhuri (2025) "
            "against the (ε, δ) trade-off curve ('in' guesses only). 'Ideal run's bound' is the f-DP bound a mechanism "
            "with the same σ, q, T, m and guesses gives when canaries do not interfere (mean ± sd of 20 simulated runs). "
            "A bound above the claimed ε of a DP run is a privacy defect. The 'noise ÷ 10' controls are the same runs "
            "with a tenth of the noise their σ and ε claim (built by the audit only, never exported): the audit has "
            "power when their bound exceeds the claimed ε. The μ-GDP column rejects Gaussian-shaped trade-off curves: "
            "it speaks of the μ-GDP hypothesis, not of (ε, δ)-DP.\n")
    md.write_text(f"# One-run privacy audit ({scale} scale)\n\n" + header + body + note)
    return md, csv_path


def verdict(r: AuditRow) -> str:
    """``pass``/``DEFECT`` for a DP run, ``caught``/``MISSED`` for a broken control, ``–`` for a non-private one."""
    if r.row == NONPRIVATE:
        return "–"
    above = r.bound > r.claimed_epsilon
    if r.row == BROKEN:
        return "caught" if above else "MISSED"
    return "DEFECT" if above else "pass"


def _cell(x: float) -> str:
    return "–" if math.isnan(x) else f"{x:.2f}"


def _gdp_cell(r: AuditRow) -> str:
    if math.isnan(r.mu_gdp_lower_95):
        return "–"
    return f"{r.mu_gdp_lower_95:.2f} ({r.epsilon_gdp_lower_95:.2f})"


def _epsilons(text: str) -> list[float]:
    values = comma_list(text, "epsilons", NUMBERS)
    if not all(0 < v < math.inf for v in values):
        raise ValueError(f"epsilons={text!r}: each ε must be finite and > 0 (the non-private control is its own row)")
    return values


def _out_folder(out: str) -> Path:
    """``out=`` as a folder the tables can be written into, checked before any training: the path itself or
    its nearest existing parent is a writable folder (a file there would fail only after the last run)."""
    folder = Path(out).expanduser()
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p.is_symlink())
    if not existing.is_dir():
        raise ValueError(f"out={out}: {existing} is {'a file' if existing.is_file() else 'not a folder'}, point out= "
                         f"at a folder (the tables go to <out>/audit_run.<scale>.md), e.g. out=results/tables")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"out={out}: {existing} is not writable, point out= at a writable folder")
    return folder


def main(*, scale: str = "embedded", methods: str = "prism,adamw", epsilons: str = "6,3", canaries: int = 30000,
         k_pos: int = -1, k_neg: int = 0, seed: int = 0, out: str = "results/tables", split: bool = False,
         no_control: bool = False, no_broken_control: bool = False, expected_only: bool = False) -> int:
    """Train every method at every ε (scale embedded|smoke), its broken-noise control (unless
    ``--no-broken-control``) and a non-private control per method (unless ``--no-control``) with
    ``canaries`` canaries, guess ``k_pos`` in (-1: m/4) / ``k_neg`` out (``--split``: chosen on one half,
    audited on the other; ``seed``: the coins and directions) and write the table to ``out``;
    ``--expected-only``: print what correct runs give, without training. Exit 1 on a DP run's lower bound
    above its ε or a missed control; bad arguments raise a one-line ``ValueError`` before any model load."""
    k_pos = canaries // 4 if k_pos == -1 else k_pos
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r}; choose one of {', '.join(SCALES)}")
    method_names = comma_list(methods, "methods", choices=registry.names())
    budgets = _epsilons(epsilons)
    if canaries < 2:
        raise ValueError(f"canaries={canaries} must be ≥ 2 (30000 for the audit)")
    if min(k_pos, k_neg) < 0 or not 1 <= k_pos + k_neg <= canaries:
        raise ValueError(f"k_pos={k_pos} k_neg={k_neg}: each must be ≥ 0, their sum in [1, canaries = {canaries}]")
    if 2 * canaries * 1e-5 > 1:
        raise ValueError(f"canaries={canaries}: at most 50000 (the bound needs 2·m·δ ≤ 1 at δ = 1e-5)")
    kinds = [GENUINE] + ([] if no_broken_control else [BROKEN])
    plan = [(m, e, k) for m in method_names for e in budgets for k in kinds]
    plan += [] if no_control else [(m, math.inf, NONPRIVATE) for m in method_names]
    configs = [job_config(m, e, scale) for m, e, _ in plan]  # every config checked before any model load
    if expected_only:
        PRINT("\n".join(expected_lines(configs, [k for *_, k in plan], canaries, k_pos, k_neg, seed)))
        return 0
    out_folder = _out_folder(out)  # before the first run trains
    from pipelines.runs.runner import quiet_third_party_warnings, setup_logging

    quiet_third_party_warnings()
    setup_logging()
    tic = time.perf_counter()
    rows = []
    for i, ((method_name, epsilon, kind), cfg) in enumerate(zip(plan, configs), 1):
        PRINT(f"[{i}/{len(plan)}] {method_name} at ε = {epsilon:g} ({kind}): training with {canaries} canaries")
        r = audit_training_run(cfg, canaries, k_pos, k_neg, split, seed, broken=kind == BROKEN)
        rows.append(r)
        PRINT(f"  {r.correct}/{r.guesses} correct guesses: ε ≥ {r.epsilon_lower_95:.2f} (Steinke), "
              f"{_cell(r.epsilon_fdp_lower_95)} (f-DP) at 95 %; ideal run {r.ideal_epsilon_lower or '–'}")
    md, csv_path = write_table(rows, scale, out_folder)
    PRINT(md.read_text())
    defects = [r for r in rows if verdict(r) == "DEFECT"]
    missed = [r for r in rows if verdict(r) == "MISSED"]
    PRINT(f"{len(rows)} runs in {time.perf_counter() - tic:.0f} s; tables: {md}, {csv_path}; "
          + (f"DEFECT: {len(defects)} lower bound(s) above the claimed ε; " if defects else "no DP run's bound above its ε; ")
          + (f"NO POWER: {len(missed)} broken control(s) not caught" if missed else "every broken control caught"))
    return 1 if defects or missed else 0

