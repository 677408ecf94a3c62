"""The keys of each method's config node: type, range, choices and meaning, declared once.

``conf/method/<name>.yaml`` gives the values; this table says which values are valid. Both the
pre-run validator (:mod:`pipelines.config_rules`, before any model load) and the methods
(:func:`prism.methods.build_method`) call :func:`check`, so a key's rule lives in one place.
Keys every method node carries (``lr``, ``init``, and the protocol's ``init_svd``,
``noise_damping``, ``pinv_rcond``, D4–D6) are declared once in :data:`COMMON`. ``Dnn`` in a key's
doc is the entry of docs/DECISIONS.md.

No torch here: the validator reports a bad value in about a second.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SCHEMAS", "Key", "SchemaError", "check", "schema"]


class SchemaError(ValueError):
    """A method key with a value its schema refuses; one line naming ``method.<key>`` and the fix."""


@dataclass(frozen=True)
class Key:
    """One key of a method node.

    ``kind``: ``float`` (an int is accepted), ``int``, ``bool``, ``str`` or ``"pair"`` (two floats);
    ``low``/``high`` bound numbers (``*_open``: the bound itself excluded; a pair bounds each entry);
    ``choices``: the allowed values; ``nullable``: ``null`` allowed."""

    name: str
    kind: Any
    doc: str
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    nullable: bool = False

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is invalid (the fix included), or None."""
        if value is None:
            return None if self.nullable else f"may not be null ({self.doc})"
        if self.kind == "pair":
            ok = isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2 and all(_is_number(v) for v in value)
            if not ok:
                return f"must be two numbers [a, b] ({self.doc})"
            bad = next((self._range(float(v)) for v in value if self._range(float(v))), None)
            return None if bad is None else f"must be two numbers each {bad} ({self.doc})"
        if self.kind is bool and not isinstance(value, bool):
            return f"must be true or false ({self.doc})"
        if self.kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            return f"must be an integer ({self.doc})"
        if self.kind is float and not _is_number(value):
            return f"must be a number ({self.doc})"
        if self.kind is str and not isinstance(value, str):
            return f"must be a string ({self.doc})"
        if self.choices is not None and value not in self.choices:
            names = ", ".join("null" if c is None else str(c).lower() if isinstance(c, bool) else str(c)
                              for c in self.choices)
            return f"must be {'one of ' if len(self.choices) > 1 else ''}{names} ({self.doc})"
        if self.kind in (int, float):
            bad = self._range(float(value))
            return None if bad is None else f"must be {bad} ({self.doc})"
        return None

    def _range(self, x: float) -> str | None:
        if not math.isfinite(x):
            return "a finite number"
        too_low = self.low is not None and (x <= self.low if self.low_open else x < self.low)
        too_high = self.high is not None and (x >= self.high if self.high_open else x > self.high)
        if not (too_low or too_high):
            return None
        lo = "" if self.low is None else f"{'(' if self.low_open else '['}{self.low:g}"
        hi = "" if self.high is None else f"{self.high:g}{')' if self.high_open else ']'}"
        if lo and hi:
            return f"in {lo}, {hi}"
        return f"{'>' if self.low_open else '>='} {self.low:g}" if lo else f"{'<' if self.high_open else '<='} {self.high:g}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _keys(*keys: Key) -> dict[str, Key]:
    return {k.name: k for k in keys}


COMMON = _keys(
    Key("name", str, "the method, chosen by method=<name>"),
    Key("lr", float, "learning rate, Table 8", low=0.0, low_open=True),
    Key("init", str, "LoRA init: peft (B = 0) or spectral residual (docs/DECISIONS.md D14)",
        choices=("peft", "spectral")),
    Key("init_svd", str, "SVD of the spectral init: exact up to 1024, randomized above (auto) or always randomized",
        choices=("auto", "randomized")),
    Key("noise_damping", float, "released protocol's (N + δI)^-1/2 whitening, null for exact (PRISM only)",
        low=0.0, nullable=True),
    Key("pinv_rcond", float, "released protocol's eigen-cut pseudo-inverses in the lift, null for exact (PRISM only)",
        low=0.0, high=1.0, high_open=True, nullable=True),
)
BETAS = Key("betas", "pair", "Adam's moment decays", low=0.0, high=1.0, high_open=True)
ADAMW = _keys(
    BETAS,
    Key("eps", float, "Adam's denominator offset", low=0.0, low_open=True),
    Key("weight_decay", float, "decoupled weight decay", low=0.0),
    Key("amsgrad", bool, "AMSGrad variant"),
)
PRISM = _keys(
    Key("init", str, "PRISM needs full-rank factors, and peft's B = 0 has rank 0: use the spectral init (D14)",
        choices=("spectral",)),
    Key("preconditioner", str, "rank-space preconditioner: released floor, eq. 25 ridge, or none",
        choices=("floor", "ridge", "none")),
    Key("beta1", float, "first-moment decay", low=0.0, high=1.0, high_open=True),
    Key("beta2", float, "second-moment decay", low=0.0, high=1.0, high_open=True),
    Key("eps", float, "moment offset", low=0.0),
    Key("floor_mode", str, "eigenvalue floor: released scalar or eq. 26 geometry", choices=("scalar", "geometry")),
    Key("floor_factor", float, "floor / ridge constant (eq. 26)", low=0.0),
    Key("cond_max", float, "condition-number clamp, null for none", low=1.0, nullable=True),
    Key("debias", bool, "eq. 50 noise debias of the second moment (App. A.26)"),
    Key("bias_correction", bool, "Adam-style bias correction of the moments"),
    Key("horizontalize", str, "horizontal projection of the lift: both, pre_retract or none",
        choices=("both", "pre_retract", "none")),
    Key("rank_fallback", str, "a rank-deficient Gram matrix: null (an error, D20) or floor its spectrum",
        choices=(None, "floor"), nullable=True),
    Key("compute_dtype", str, "dtype of snapshots, rank check and moments", choices=("float32", "float64")),
)
LAMB = _keys(
    BETAS,
    Key("eps", float, "LAMB's denominator offset", low=0.0, low_open=True),
    Key("weight_decay", float, "weight decay", low=0.0),
    *(Key(flag, bool, f"pytorch-optimizer Lamb's {flag}") for flag in (
        "weight_decouple", "fixed_decay", "rectify", "degenerated_to_sgd", "grad_averaging", "adam", "adam_debias",
        "adanorm", "foreach", "maximize")),
    Key("n_sma_threshold", int, "RAdam's SMA threshold (rectify only)", low=0),
    Key("max_grad_norm", float, "must stay 0: LAMB may not rescale the privatised gradient (D26)", choices=(0.0,)),
    Key("pre_norm", bool, "must stay false: LAMB may not rescale the privatised gradient (D26)", choices=(False,)),
)
LORA_RITE = _keys(
    BETAS,
    Key("eps", float, "denominator offset", low=0.0, low_open=True),
    Key("update_skipping", float, "zero an update whose RMS exceeds this, 0 disables (D27)", low=0.0),
    Key("clip_unmagnified_grad", float, "clip the unmagnified gradients to this norm, 0 disables (D27)", low=0.0),
)

SCHEMAS: dict[str, dict[str, Key]] = {
    "prism": {**COMMON, **PRISM},
    "prism_paper": {**COMMON, **PRISM},
    "adamw": {**COMMON, **ADAMW},
    "ffa": {**COMMON, **ADAMW},
    "loraplus": {**COMMON, **ADAMW, **_keys(Key("loraplus_lr_ratio", float, "LoRA+'s ρ, Table 8", low=0.0,
                                                low_open=True))},
    "lamb": {**COMMON, **LAMB},
    "lora_rite": {**COMMON, **LORA_RITE},
}


def schema(name: str) -> dict[str, Key]:
    """The keys of method ``name``; :class:`SchemaError` for a method without a schema."""
    if name not in SCHEMAS:
        raise SchemaError(f"method.name={name!r} is not a method, choose method=<one of {', '.join(SCHEMAS)}>")
    return SCHEMAS[name]


def check(node: Mapping[str, Any]) -> None:
    """Raise :class:`SchemaError` for the first key of a method node that its schema refuses (an
    unknown key included); keys the schema has but the node lacks keep the method's defaults."""
    keys = schema(str(node.get("name")))
    for name, value in node.items():
        if name not in keys:
            raise SchemaError(f"unknown key method.{name} for method {node.get('name')}, "
                              f"its keys are {', '.join(keys)}")
        if (why := keys[name].problem(value)) is not None:
            shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
            raise SchemaError(f"method.{name}={shown} {why}")
