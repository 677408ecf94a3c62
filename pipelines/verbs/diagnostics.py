"""Experiment ``diagnostics``: the paper's mechanism claims measured (Table 1, Figs. 1–4, 8–15).

    python -m pipelines diagnostics [scale=paper] [overrides...]
    make reproduce-diagnostics [SCALE=paper]

One job (``experiment=diagnostics`` and the overrides) is one run folder of :func:`pipelines.runs.runner.execute`
whose trainer, :func:`measure`, drives :mod:`prism.train` and :mod:`prism.audit.diagnostics`: every step of
every short run is a line of ``metrics.jsonl``, the raw series go to ``diagnostics.json``, and
:func:`pipelines.tables.diagnostics.render` turns that file into ``results/figures/*.png`` and
``results/tables/diagnostics.md``.

Items (the config node ``train.diagnostics`` sets their budgets; conf/diagnostics/*.yaml):

* Table 1 — Monte-Carlo ``E_Z`` of DP-LoRA (both factors), one-sided FFA and PRISM on the LoRA
  shapes of the backbone vs eqs. 8–9, 32 and 20–21.
* Gauge sweep ``(cA, c⁻¹B)`` at step 1 (Figs. 8–9) and over a short run (Figs. 2, 10–11).
* Noise energy along training (Figs. 1, 3), optimal gauge (Figs. 12–13, eq. 34), ε sweep
  (Figs. 4, 14–15: realised σ and ``‖P^{-1/2}ξ‖/‖ξ‖``).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from pipelines.config.compose import CONF_DIR, compose_config, resolve
from pipelines.config.validate import ConfigError, check
from pipelines.runs import store
from pipelines.runs.runner import execute, setup_logging
from pipelines.tables.diagnostics import render
from prism.audit import diagnostics as dg
from prism.mechanism import geometry
from prism.mechanism.lora import lora_pairs, read_pair
from prism.methods import PrivacySpec, build_method
from prism.methods.factor import OPACUS_NORM_EPS
from prism.privacy import Accountant, PoissonSampler, calibrate_sigma, calibration_steps
from prism.privacy.accounting import is_private

LogFn = Callable[[dict[str, Any]], None]
DATA_FILE = "diagnostics.json"
MC_CHUNK = 128  # Monte-Carlo draws per batched call (bounds memory at paper shapes)


# ------------------------------------------------------------------------------------------ config
PROTOCOL_METHOD_KEYS = ("noise_damping", "pinv_rcond", "init_svd")  # set in the method node by conf/protocol/*.yaml
def method_node(cfg: DictConfig, name: str) -> dict[str, Any]:
    """``conf/method/<name>.yaml`` resolved against ``cfg`` (its lr interpolation reads the suite and scale),
    with the protocol's method keys of ``cfg`` (D4-D6: conf/protocol/*.yaml)."""
    path = CONF_DIR / "method" / f"{name}.yaml"
    if not path.exists():
        raise ConfigError(f"train.diagnostics names method {name!r}, which has no conf/method/{name}.yaml")
    root = OmegaConf.create(OmegaConf.to_container(cfg))
    protocol = {key: cfg.method[key] for key in PROTOCOL_METHOD_KEYS if key in cfg.method}
    root.method = OmegaConf.merge(OmegaConf.load(path), protocol)
    return OmegaConf.to_container(root.method, resolve=True)


def sub_config(cfg: DictConfig, method: str, epsilon: float, steps: int,
               method_overrides: dict[str, Any] | None = None) -> DictConfig:
    """The resolved config of one short run: ``cfg`` with another method (fields overridden), ε and step count."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["method"] = {**method_node(cfg, method), **(method_overrides or {})}
    plain["privacy"] = {**plain["privacy"], "epsilon": float(epsilon), "name": f"eps{epsilon:g}"}
    plain["train"] = {**plain["train"], "steps": int(steps)}
    return OmegaConf.create(plain)


def validate_diagnostics(cfg: DictConfig) -> None:
    """What the diagnostics need beyond the schema (:class:`prism.job.DiagnosticsConfig`
    checks the budgets): the ``train.diagnostics`` node, a finite ε and the methods it names."""
    d = cfg.train.get("diagnostics")
    if d is None:
        raise ConfigError("train.diagnostics is missing; run with experiment=diagnostics")
    if not is_private(cfg):
        raise ConfigError("privacy.epsilon must be finite for the diagnostics (they measure DP noise); use privacy=eps6")
    for name in (d.baseline, d.one_sided, d.prism):
        method_node(cfg, str(name))


# ------------------------------------------------------------------------------------------ measurement
class Lab:
    """Short runs of the training loop at chosen (method, gauge c, ε, steps), sharing one built model per method."""

    def __init__(self, cfg: DictConfig, log_fn: LogFn) -> None:
        self.cfg, self.d, self.log_fn = cfg, cfg.train.diagnostics, log_fn
        self.eps0 = float(cfg.privacy.epsilon)
        self._setups: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}
        self.runs: dict[tuple, dict[str, Any]] = {}
        self._sigmas: dict[tuple[float, int], float] = {}  # (ε, steps) → σ: PRV calibration costs seconds
        self._line = 0

    def setup(self, method: str) -> tuple[Any, dict[str, torch.Tensor]]:
        """``prism.train.build`` once per method (its LoRA init), with a copy of the initial factors."""
        from prism.train import build

        if method not in self._setups:
            s = build(sub_config(self.cfg, method, self.eps0, int(self.d.gauge_steps)))
            self._sigmas[(self.eps0, int(self.d.gauge_steps))] = s.sigma
            self._setups[method] = (s, {n: p.detach().clone() for n, p in s.params.items()})
        return self._setups[method]

    def fresh(self, method: str, c: float, epsilon: float, steps: int,
              method_overrides: dict[str, Any] | None = None) -> tuple[Any, DictConfig]:
        """A Setup at the initial factors rescaled to ``(cA, c⁻¹B)`` with a new method, sampler, accountant
        and noise stream (seeded as :func:`prism.train.build` seeds them) and σ calibrated for ``steps``."""
        s, initial = self.setup(method)
        sub = sub_config(self.cfg, method, epsilon, steps, method_overrides)
        with torch.no_grad():
            for n, p in s.params.items():
                p.copy_(initial[n])
        dg.apply_gauge(s.params, lora_pairs(s.params), c)
        torch.manual_seed(sub.seed)
        sampler = PoissonSampler(len(s.suite.train), sub.train.batch_size, generator_seed=sub.seed + 1)
        q = sampler.sample_rate
        if (epsilon, steps) not in self._sigmas:
            calib = calibration_steps(steps, q, sub.privacy.calibration)
            self._sigmas[(epsilon, steps)] = calibrate_sigma(epsilon, sub.privacy.delta, q, calib)
        sigma = self._sigmas[(epsilon, steps)]
        privacy = PrivacySpec(sigma=sigma, clip_norm=float(sub.privacy.clip_norm))
        return dataclasses.replace(
            s, method=build_method(sub.method, s.params, privacy), sampler=sampler, accountant=Accountant(),
            noise=torch.Generator(device=s.device).manual_seed(sub.seed + 2), sigma=sigma,
        ), sub

    def step1_norms(self, s: Any, sub: DictConfig) -> dict[str, list[float]]:
        """Per-example factor and intrinsic norms on the first Poisson batch (the sampler is rewound)."""
        from prism.train import micro_batch

        state = s.sampler.state_dict()
        indices = s.sampler.sample()
        s.sampler.load_state_dict(state)
        names, pairs = list(s.params), lora_pairs(s.params)
        factor, intrinsic = [], []
        for chunk in indices.split(sub.train.micro_batch_size):
            _, grads = s.gradients(micro_batch(s, chunk.tolist()))
            factor.append(dg.factor_example_norms(grads, names))
            if sub.method.init == "spectral":  # the intrinsic norm needs full-rank factors (peft init has A = 0)
                intrinsic.append(dg.intrinsic_example_norms(pairs, s.params, grads))
        out = {"factor": torch.cat(factor).tolist()}
        if intrinsic:
            out["intrinsic"] = torch.cat(intrinsic).tolist()
        return out

    def run(self, part: str, method: str, c: float, epsilon: float, steps: int, discard: int = 0,
            method_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """A short run; per step: ``S_t`` (before the step), ``‖ΔZ_t‖_F``, the method's statistics and
        the noise amplification after the step (memoised per (method, overrides, c, ε, steps))."""
        from prism.train import train_step

        key = (method, float(c), float(epsilon), int(steps), tuple(sorted((method_overrides or {}).items())))
        if key in self.runs:
            return self.runs[key]
        s, sub = self.fresh(method, c, epsilon, steps, method_overrides)
        pairs = lora_pairs(s.params)
        tau = s.sigma * float(sub.privacy.clip_norm) / sub.train.batch_size
        result: dict[str, Any] = {"method": method, "c": c, "epsilon": epsilon, "sigma": s.sigma, "tau": tau,
                                  "step1_norms": self.step1_norms(s, sub) if part == "gauge" else {}, "steps": []}
        amp_gen = torch.Generator(device=s.device).manual_seed(int(sub.seed) + 3)
        for t in range(1, steps + 1):
            before = {n: p.detach().clone() for n, p in s.params.items()}
            S = dg.factor_sum(pairs, before)
            stats = train_step(s, sub)
            row = {k: float(v) for k, v in stats.items()}
            row.update(run_step=t, S_t=sum(S.values()), delta_z=dg.delta_z_norm(pairs, before, s.params))
            if t > discard and row.get("batch_size", 0) > 0:
                if hasattr(s.method, "adaptive"):
                    factors = {p.module: tuple(x.detach().float() for x in read_pair(s.params, p)) for p in pairs}
                    row["amplification"] = dg.prism_amplification(s.method.adaptive, factors, tau, amp_gen)
                elif hasattr(s.method, "optimizer"):
                    row["amplification"] = dg.adam_amplification(s.method.optimizer, amp_gen)
            result["steps"].append(row)
            self._line += 1
            self.log_fn({"step": self._line, "run_steps": steps, "part": part, "method": method, "c": c,
                         "epsilon": epsilon, **row})
        final = {n: p.detach().clone() for n, p in s.params.items()}
        result["final_S"] = dg.factor_sum(pairs, final)
        result["_final"] = {p.module: tuple(t.detach().double() for t in read_pair(final, p)) for p in pairs}
        self.runs[key] = result
        return result


def table1(lab: Lab) -> dict[str, Any]:
    """Monte-Carlo ``E_Z`` vs closed forms on every LoRA module of the last adapted layer (PRISM's init)."""
    s, initial = lab.setup(str(lab.d.prism))
    tau = s.sigma * float(lab.cfg.privacy.clip_norm) / lab.cfg.train.batch_size
    pairs = lora_pairs(initial)
    last = pairs[-1].module.rsplit(".", 1)[0].rsplit(".", 1)[0]  # e.g. ...layers.29
    gen = torch.Generator(device=s.device).manual_seed(int(lab.cfg.seed) + 4)
    draws = int(lab.d.table1_draws)
    chunks = [min(MC_CHUNK, draws - i) for i in range(0, draws, MC_CHUNK)]
    rows = []

    def sample(fn: Callable[[int], torch.Tensor]) -> torch.Tensor:
        return torch.cat([fn(k) for k in chunks])

    for pair in pairs:
        if not pair.module.startswith(last):
            continue
        A, B = (t.detach().double() for t in read_pair(initial, pair))
        (m, r), n = A.shape, B.shape[0]
        both = [dg.factor_noise_draws(A, B, tau, k, gen) for k in chunks]
        first, bil, total = (torch.cat(parts) for parts in zip(*both))  # FactorNoise's fields, over the chunks
        one = sample(lambda k: dg.factor_noise_draws(A, B, tau, k, gen, noised="A").total)  # noqa: B023
        prism = sample(lambda k: dg.prism_noise_draws(A, B, tau, k, gen))  # noqa: B023
        e8, e9 = geometry.factor_noise_energy(A, B, tau), geometry.bilinear_noise_energy(m, n, r, tau)
        entries = [
            ("DP-LoRA first order (eq. 8)", dg.effective_noise(first), math.sqrt(e8)),
            ("DP-LoRA bilinear (eq. 9)", dg.effective_noise(bil), math.sqrt(e9)),
            ("DP-LoRA total (eqs. 8+9)", dg.effective_noise(total), math.sqrt(e8 + e9)),
            ("FFA one-sided (eq. 32)", dg.effective_noise(one),
             math.sqrt(geometry.one_sided_noise_energy(A, B, tau, "A"))),
            ("PRISM (eq. 21)", dg.effective_noise(prism), geometry.prism_effective_noise(m, n, r, tau)),
        ]
        for name, mc, closed in entries:
            rows.append({"module": pair.module.rsplit(".", 1)[-1], "m": m, "n": n, "r": r, "mechanism": name,
                         "mc": mc, "closed": closed, "rel_err": abs(mc - closed) / closed})
    # Cor. 2.3: along the gauge orbit the first-order E_Z of DP-LoRA is unbounded (eq. 33), PRISM's fixed.
    A, B = (t.detach().double() for t in read_pair(initial, pairs[-1]))
    orbit = [{"c": c, "dp_lora": math.sqrt(geometry.gauge_noise_energy(A, B, tau, c)),
              "prism": geometry.prism_effective_noise(A.shape[0], B.shape[0], A.shape[1], tau)}
             for c in (1e-3, 1e-1, 1.0, 1e1, 1e3)]
    return {"tau": tau, "sigma": s.sigma, "draws": draws, "rows": rows, "orbit": orbit, "layer": last}


def gauge_sweep(lab: Lab) -> dict[str, Any]:
    """Figs. 2, 8–11: a short run per gauge for the baseline and PRISM (step 1 is the first step of each)."""
    C, out = float(lab.cfg.privacy.clip_norm), {}
    for method in (str(lab.d.baseline), str(lab.d.prism)):
        runs = [lab.run("gauge", method, float(c), lab.eps0, int(lab.d.gauge_steps)) for c in lab.d.gauges]
        step1 = []
        for run in runs:
            row = {"c": run["c"], "method_clip_fraction": run["steps"][0].get("clip_fraction", float("nan")),
                   "norms": run["step1_norms"]}
            for kind, eps in (("factor", OPACUS_NORM_EPS), ("intrinsic", 0.0)):
                if kind in run["step1_norms"]:
                    norms = torch.tensor(run["step1_norms"][kind])
                    row[f"{kind}_clip_fraction"], row[f"{kind}_coef_mean"] = dg.clip_stats(norms, C, eps)
            step1.append(row)
        clip = np.array([[r.get("clip_fraction", np.nan) for r in run["steps"]] for run in runs])
        out[method] = {"gauges": [run["c"] for run in runs], "step1": step1, **_spread(runs),
                       "clip_fraction": clip.tolist()}
    return out


def plain_prism_sweep(lab: Lab) -> dict[str, Any] | None:
    """The gauge sweep of PRISM without the adaptive transform (``preconditioner: none``): the update is
    the privatised tangent vector itself, so Thm. 3.3 makes ‖ΔZ_t‖ equal across gauges path by path."""
    steps = int(lab.d.plain_steps)
    if steps == 0:
        return None
    runs = [lab.run("gauge_plain", str(lab.d.prism), float(c), lab.eps0, steps, method_overrides={"preconditioner": "none"})
            for c in lab.d.gauges]
    return {"gauges": [run["c"] for run in runs], **_spread(runs)}


def _spread(runs: list[dict[str, Any]]) -> dict[str, list]:
    """``‖ΔZ_t‖_F`` per gauge and step, ``ρ_t = max_c − min_c`` and ``ρ_t`` over the mean across gauges."""
    dz = np.array([[r["delta_z"] for r in run["steps"]] for run in runs])
    rho = dz.max(0) - dz.min(0)
    return {"delta_z": dz.tolist(), "rho": rho.tolist(), "rho_rel": (rho / dz.mean(0)).tolist()}


def noise_along_training(lab: Lab) -> dict[str, Any]:
    """Figs. 1, 3: per-step ‖N_Z‖ ratio baseline/PRISM at c = 1, and baseline ‖N_Z‖² against ``S_t``."""
    base = lab.run("gauge", str(lab.d.baseline), 1.0, lab.eps0, int(lab.d.gauge_steps))
    prism = lab.run("gauge", str(lab.d.prism), 1.0, lab.eps0, int(lab.d.gauge_steps))
    nb = [r.get("noise_norm", np.nan) for r in base["steps"]]
    npr = [r.get("noise_norm", np.nan) for r in prism["steps"]]
    points = [(r["S_t"], r["noise_norm"] ** 2, run["c"]) for key, run in lab.runs.items()
              if key[0] == str(lab.d.baseline) and key[2] == lab.eps0 and key[3] == int(lab.d.gauge_steps)
              for r in run["steps"] if "noise_norm" in r]
    S, N2, cs = zip(*points)
    a, b, r2 = dg.linear_fit(S, N2)
    own = [(r["S_t"], r["noise_norm"] ** 2) for r in base["steps"] if "noise_norm" in r]
    _, _, r2_own = dg.linear_fit(*zip(*own)) if len(own) > 2 else (0, 0, float("nan"))
    return {"ratio": (np.array(nb) / np.array(npr)).tolist(), "noise_base": nb, "noise_prism": npr,
            "tau": base["tau"], "S": list(S), "N2": list(N2), "c": list(cs), "slope": a, "intercept": b,
            "r2": r2, "r2_c1": r2_own, "prism_N2": [x**2 for x in npr]}


def optimal_gauge(lab: Lab) -> dict[str, Any]:
    """Figs. 12–13: the gauge scan on the baseline's module with the largest ``S`` at the end of its c = 1 run."""
    base = lab.run("gauge", str(lab.d.baseline), 1.0, lab.eps0, int(lab.d.gauge_steps))
    module = max(base["final_S"], key=base["final_S"].get)
    A, B = base["_final"][module]
    sc = lab.d.scan
    log_c = np.linspace(float(sc.log10_min), float(sc.log10_max), int(sc.points))
    scan = dg.gauge_scan(A, B, base["tau"], (10.0**log_c).tolist(), int(sc.draws),
                      torch.Generator(device=A.device).manual_seed(int(lab.cfg.seed) + 5))
    total, first, bil = (x.clamp_min(0).sqrt().cpu().numpy() for x in (scan.total, scan.first, scan.bilinear))
    med = np.median(total, 1)
    (m, r), n = A.shape, B.shape[0]
    closed = [math.sqrt(geometry.gauge_noise_energy(A, B, base["tau"], float(10.0**x))
                        + geometry.bilinear_noise_energy(m, n, r, base["tau"])) for x in log_c]
    return {"module": module, "m": m, "n": n, "r": r, "log10_c": log_c.tolist(), "median": med.tolist(),
            "q10": np.quantile(total, 0.1, 1).tolist(), "q90": np.quantile(total, 0.9, 1).tolist(),
            "first_median": np.median(first, 1).tolist(), "bilinear_median": np.median(bil, 1).tolist(),
            "closed": closed, "c_star_empirical": float(10.0 ** log_c[int(np.argmin(med))]),
            "c_star_eq34": geometry.optimal_gauge(A, B)}


def eps_sweep(lab: Lab) -> dict[str, Any]:
    """Figs. 4, 14–15: realised σ and median amplification ``‖P^{-1/2}ξ‖/‖ξ‖`` (after ``eps_discard`` steps)."""
    rows = []
    for eps in lab.d.epsilons:
        for method in (str(lab.d.baseline), str(lab.d.prism)):
            run = lab.run("eps", method, 1.0, float(eps), int(lab.d.eps_steps), int(lab.d.eps_discard))
            amps = [r["amplification"] for r in run["steps"][int(lab.d.eps_discard):] if "amplification" in r]
            rows.append({"epsilon": float(eps), "method": method, "sigma": run["sigma"],
                         "amplification": float(np.median(amps)) if amps else float("nan"),
                         "amp_min": float(min(amps)) if amps else float("nan"),
                         "amp_max": float(max(amps)) if amps else float("nan")})
    return {"rows": rows}


def measure(cfg: DictConfig, folder: Path, log_fn: LogFn) -> dict[str, Any]:
    """The job's trainer: every item, raw series to ``<folder>/diagnostics.json``; returns the summary."""
    lab = Lab(cfg, log_fn)
    data: dict[str, Any] = {"backbone": str(cfg.backbone.name), "paper_backbone": str(cfg.backbone.get("paper_name")),
                            "suite": str(cfg.suite.name), "scale": str(cfg.suite.scale),
                            "epsilon": lab.eps0, "clip_norm": float(cfg.privacy.clip_norm),
                            "batch_size": int(cfg.train.batch_size), "lora_r": int(cfg.lora.r)}
    data["table1"] = table1(lab)
    data["gauge"] = gauge_sweep(lab)
    data["gauge_plain"] = plain_prism_sweep(lab)
    data["noise"] = noise_along_training(lab)
    data["scan"] = optimal_gauge(lab)
    data["eps"] = eps_sweep(lab)
    store.write_json_atomic(Path(folder) / DATA_FILE, data)
    return summary(data, lab)


def summary(data: dict[str, Any], lab: Lab) -> dict[str, Any]:
    """Scalars for ``final.json`` / the W&B summary."""
    base, prism = str(lab.d.baseline), str(lab.d.prism)
    g = data["gauge"]
    out = {"table1_max_rel_err": max(r["rel_err"] for r in data["table1"]["rows"]),
           "fit_r2": data["noise"]["r2"], "fit_slope_over_tau2": data["noise"]["slope"] / data["noise"]["tau"] ** 2,
           "c_star_empirical": data["scan"]["c_star_empirical"], "c_star_eq34": data["scan"]["c_star_eq34"],
           "rho_rel_max_" + base: max(g[base]["rho_rel"]), "rho_rel_max_" + prism: max(g[prism]["rho_rel"])}
    for method, norm in ((base, "factor"), (prism, "intrinsic")):
        for row in g[method]["step1"]:
            out[f"step1_clip_{method}_c{row['c']:g}"] = row[f"{norm}_clip_fraction"]
    return out


# ------------------------------------------------------------------------------------------ entry point
def main(overrides: Sequence[str]) -> int:
    """Measure Table 1 and the mechanism figures in one run folder (``experiment=diagnostics`` with the
    overrides, e.g. ``scale=paper suite=math10k``; skipped when finished) and render them to
    ``results/figures`` and ``results/tables/diagnostics.md``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = compose_config(["experiment=diagnostics", *overrides])
    setup_logging()
    return reproduce(cfg)


def reproduce(cfg: DictConfig) -> int:
    """Validate, run the job through :func:`pipelines.runs.runner.execute` (skipped when finished), render."""
    try:
        validate_diagnostics(resolve(cfg))
        cfg = check(resolve(cfg))
        state = execute(cfg, trainer=measure)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if state == "busy":
        print("error: the diagnostics run folder is locked by another process; wait for it to finish", file=sys.stderr)
        return 1
    folder = store.run_dir(cfg)
    final = store.read_json(folder / "final.json")
    paths = render(store.read_json(folder / DATA_FILE), Path(cfg.results_dir), store.RunBlock.from_final(final).wall_time_s)
    for path in paths:
        print(path)
    return 0

