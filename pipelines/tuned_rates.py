"""Learning rates chosen by the sweep of :mod:`pipelines.tune`, read when a config is composed.

Every method yaml sets ``lr: ${method_lr:<Table 8's rate of the suite family × train.lr_multiplier>}``;
:func:`method_lr` returns, in this order:

1. in a tuning run (the config has ``tune.lr_factor``, ``conf/experiment/tune.yaml``): the default
   rate × that factor — a sweep never reads earlier tuned rates, so rerunning it gives the same grid;
2. the tuned rate of the run's cell, when a file ``conf/tuned/<scale>.yaml`` written by
   ``make tune`` has an entry whose fields (:data:`MATCH`: method, suite, ε, backbone, LoRA layers,
   steps, batch) all equal the run's — a rate tuned for one budget is never applied to another. The
   LoRA rank is not matched: the rates tuned at Table 2's r = 16 serve Table 4's ranks too, as Table 8
   gives one rate per method, so its rows differ in the rank only;
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
}


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


def entries(folder: Path | None = None) -> list[tuple[Path, dict]]:
    """Every (file, entry) of the tuned-rate files in ``folder`` (default :func:`tuned_dir`)."""
    out = []
    for path in sorted((folder or tuned_dir()).glob("*.yaml")):
        out += [(path, e) for e in _load(str(path), path.stat().st_mtime_ns)]
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return (math.isinf(a) and math.isinf(b)) or a == b
    return a == b


def cell_fields(cfg: DictConfig) -> dict[str, Any]:
    """The :data:`MATCH` fields of a config (what a tuned entry is keyed by)."""
    return {name: OmegaConf.select(cfg, dotted, default=None) for name, dotted in MATCH.items()}


def lookup(cfg: DictConfig, folder: Path | None = None) -> tuple[float, Path] | None:
    """The tuned rate of ``cfg``'s cell and its file, or None; two files with the cell are an error."""
    fields = cell_fields(cfg)
    found = [(float(e["lr"]), path) for path, e in entries(folder)
             if all(_same(e.get(k), v) for k, v in fields.items())]
    if len(found) > 1:
        raise ValueError(f"tuned rates for the same cell in {', '.join(str(p) for _, p in found)}: keep one "
                         f"(rerun `make tune` for that scale, or delete the stale file)")
    return found[0] if found else None


def method_lr(default: float, *, _root_: DictConfig) -> float:
    """Resolver ``${method_lr:<default rate>}`` (see the module docstring)."""
    factor = OmegaConf.select(_root_, "tune.lr_factor", default=None)
    if factor is not None:
        return float(f"{float(default) * float(factor):.6g}")
    hit = lookup(_root_)
    return hit[0] if hit else float(default)
