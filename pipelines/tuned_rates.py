"""Learning rates chosen by the sweep of :mod:`pipelines.tune`, read when a config is composed.

Every method yaml sets ``lr: ${method_lr:<Table 8's rate of the suite family × train.lr_multiplier>}``;
:func:`method_lr` returns, in this order:

1. in a tuning run (the config has ``tune.lr_factor``, ``conf/experiment/tune.yaml``): the default
   rate × that factor — a sweep never reads earlier tuned rates, so rerunning it gives the same grid;
2. the tuned rate of the run's cell, when a file written by ``make tune`` has an entry whose fields
   (:data:`MATCH`: method, suite, ε, backbone, LoRA layers, steps, batch, and for a user's task the
   training file's sha256 and the model folder) all equal the run's — a rate tuned for one budget,
   task or model is never applied to another. The files are ``conf/tuned/<scale>.yaml`` (the paper
   suites) and ``<results_dir>/tuned/*.yaml`` (``make tune TASK=...``: a user's task, kept beside its
   runs). The LoRA rank is not matched: the rates tuned at Table 2's r = 16 serve Table 4's ranks too,
   as Table 8 gives one rate per method, so its rows differ in the rank only;
3. else the default rate (Table 8 × ``train.lr_multiplier``; docs/embedded-scale.md).

No tuned file is committed by hand: each is written whole by ``make tune`` and records the commit
and command that produced it. ``PRISM_TUNED_DIR`` points the lookup at another folder (tests).
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

TUNED_DIR = Path(__file__).resolve().parents[1] / "conf" / "tuned"
MATCH = {  # entry field -> config field it must equal
    "method": "method.name", "suite": "suite.name", "scale": "suite.scale", "epsilon": "privacy.epsilon",
    "backbone": "backbone.name", "lora_layers": "backbone.lora_layers",
    "steps": "train.steps", "batch_size": "train.batch_size",
    "task_sha256": "suite.custom.train_sha256", "model_path": "backbone.path",
}
OPTIONAL = ("task_sha256", "model_path")
"""Fields that only a user's task or model has: left out of an entry (and so never matched) when null."""


def tuned_dir() -> Path:
    """Where tuned-rate files are read from (``PRISM_TUNED_DIR`` or ``conf/tuned``)."""
    return Path(os.environ.get("PRISM_TUNED_DIR") or TUNED_DIR)


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int) -> tuple[dict, ...]:
    del mtime_ns  # part of the cache key only: a rewritten file is read again
    data = yaml.safe_load(Path(path).read_text()) or {}
    rates = data.get("rates") if isinstance(data, Mapping) else None
    if not isinstance(rates, list):
        raise ValueError(f"{path}: no `rates:` list; regenerate it with `make tune`")
    return tuple(dict(r) for r in rates)


def entries(*folders: Path) -> list[tuple[Path, dict]]:
    """Every (file, entry) of the tuned-rate files in ``folders`` (default :func:`tuned_dir`)."""
    out = []
    for folder in folders or (tuned_dir(),):
        for path in sorted(folder.glob("*.yaml")):
            out += [(path, e) for e in _load(str(path), path.stat().st_mtime_ns)]
    return out


def user_tuned_dir(results_dir: str | os.PathLike[str]) -> Path:
    """Where ``make tune TASK=...`` writes a user's task's rates: ``<results_dir>/tuned``."""
    return Path(results_dir) / "tuned"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return (math.isinf(a) and math.isinf(b)) or a == b
    return a == b


def cell_fields(cfg: DictConfig) -> dict[str, Any]:
    """The :data:`MATCH` fields of a config (what a tuned entry is keyed by), the :data:`OPTIONAL` ones
    only when set."""
    fields = {name: OmegaConf.select(cfg, dotted, default=None) for name, dotted in MATCH.items()}
    return {k: v for k, v in fields.items() if k not in OPTIONAL or v is not None}


def lookup(cfg: DictConfig, folder: Path | None = None) -> tuple[float, Path] | None:
    """The tuned rate of ``cfg``'s cell and its file, or None; two files with the cell are an error.
    Read from ``folder`` if given, else :func:`tuned_dir` and the run's :func:`user_tuned_dir`."""
    fields = cell_fields(cfg)
    fields.update({k: None for k in OPTIONAL if k not in fields})  # a paper-suite run matches no user entry
    results = OmegaConf.select(cfg, "results_dir", default=None)
    folders = (folder,) if folder else (tuned_dir(), *([user_tuned_dir(str(results))] if results else []))
    found = [(float(e["lr"]), path) for path, e in entries(*folders)
             if all(_same(e.get(k), v) for k, v in fields.items())]
    if len(found) > 1:
        raise ValueError(f"tuned rates for the same cell in {', '.join(str(p) for _, p in found)}: keep one "
                         f"(rerun `make tune` for that scale, or delete the stale file)")
    return found[0] if found else None


def uses_tuned_rate(config: Mapping[str, Any]) -> bool:
    """Whether a run's resolved config (``config.yaml``) trained at its cell's tuned rate."""
    cfg = OmegaConf.create(dict(config))
    hit = lookup(cfg)
    lr = OmegaConf.select(cfg, "method.lr", default=None)
    return hit is not None and isinstance(lr, (int, float)) and math.isclose(hit[0], lr, rel_tol=1e-9)


TUNING_COST = ("ε covers one training run per cell, not the rate tuning: {n} private run(s) here use rates "
               "`make tune` chose after one DP run per candidate rate (5 or more) on the same training rows, "
               "by un-noised validation scores (docs/PRIVACY.md, \"What ε does not cover\").")
"""The one line every table, CSV and figure built from tuned private runs carries (``{n}``: their count)."""


def method_lr(default: float, *, _root_: DictConfig) -> float:
    """Resolver ``${method_lr:<default rate>}`` (see the module docstring)."""
    factor = OmegaConf.select(_root_, "tune.lr_factor", default=None)
    if factor is not None:
        return float(f"{float(default) * float(factor):.6g}")
    hit = lookup(_root_)
    return hit[0] if hit else float(default)
