"""A run's identity: the hash that names its folder in the run store (docs/ARCHITECTURE.md,
:mod:`pipelines.runs.store`): the first :data:`HASH_LEN` hex digits of sha256 over the canonical JSON of the
resolved config minus :data:`NON_RESULT_KEYS`."""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

REQUIRED_KEYS = ("seed", "backbone", "suite", "method", "privacy", "lora", "train")
NON_RESULT_KEYS = frozenset({"experiment", "force", "results_dir", "logging", "launcher", "hydra",
                             "suite.decoding.shared_prefix", "suite.decoding.frozen_prefix", "train.lr_source"})
"""Dotted keys of the resolved config that cannot change a result: bookkeeping (``train.lr_source`` records where
``method.lr``, which is hashed, came from), and the evaluation's exact speed-ups (docs/DECISIONS.md D59)."""
HASH_LEN = 12
HASH_RE = re.compile(rf"[0-9a-f]{{{HASH_LEN}}}")


def result_fields(cfg: DictConfig | dict) -> dict[str, Any]:
    """The resolved config minus :data:`NON_RESULT_KEYS`: every field that can change a result."""
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    return _without(plain, NON_RESULT_KEYS, "")


def _without(node: Mapping[str, Any], keys: frozenset[str], prefix: str) -> dict[str, Any]:
    """``node`` without the dotted ``keys`` (``prefix``: the dotted path of ``node``)."""
    return {k: _without(v, keys, f"{prefix}{k}.") if isinstance(v, Mapping) else v
            for k, v in node.items() if f"{prefix}{k}" not in keys}


def hash_payload(cfg: DictConfig | dict) -> dict[str, Any]:
    """:func:`result_fields` of a complete job config (raises on a partial one)."""
    plain = result_fields(cfg)
    missing = [k for k in REQUIRED_KEYS if k not in plain]
    if missing:
        raise ValueError(f"config lacks {missing}; compose it from conf/config.yaml")
    return plain


def canonical(obj: Any) -> str:
    """Canonical JSON: sorted keys, no spaces, ``Infinity`` for ε = ∞."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True)


def run_hash(cfg: DictConfig | dict) -> str:
    """Short sha256 of the canonical JSON of :func:`hash_payload`."""
    return hashlib.sha256(canonical(hash_payload(cfg)).encode()).hexdigest()[:HASH_LEN]
