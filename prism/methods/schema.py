"""Each method's config: one dataclass, the object the method receives (docs/DECISIONS.md D78).

A field carries its type (``Literal``: the choices; ``X | None``: null allowed; ``tuple[float, float]``:
a pair), default (none: the yaml must give it), help and numeric range (:func:`key`), which
:meth:`MethodConfig.__post_init__` checks (one :class:`SchemaError` line per bad value).
``conf/method/<name>.yaml`` gives the values. No torch here: the pre-run validator calls :func:`check`.
"""
from __future__ import annotations

import functools
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf

__all__ = ["AdamWConfig", "LambConfig", "LoraPlusConfig", "LoraRiteConfig", "MethodConfig", "PrismConfig",
           "SchemaError"]


class SchemaError(ValueError):
    """A method key with a value its dataclass refuses; one line naming ``method.<key>`` and the fix."""


def key(help: str, default: Any = MISSING, range: str | None = None) -> Any:
    """A config field: its default (none: the yaml must give it), help and numeric ``range``."""
    return field(default=default, metadata={"help": help, "range": range})


@dataclass(frozen=True, kw_only=True)
class MethodConfig:
    """The keys of every method node; a method's own keys come in a subclass."""

    name: str = key("the method, chosen by method=<name>")
    lr: float = key("learning rate, Table 8", range="(0, inf)")
    init: Literal["peft", "spectral"] = key("LoRA init: peft (B = 0) or spectral residual (docs/DECISIONS.md D14)",
                                            "peft")
    init_svd: Literal["auto", "randomized"] = key(
        "SVD of the spectral init: exact up to 1024, randomized above (auto) or always randomized", "auto")
    noise_damping: float | None = key(
        "released protocol's (N + δI)^-1/2 whitening, null for exact (PRISM only)", None, "[0, inf)")
    pinv_rcond: float | None = key(
        "released protocol's eigen-cut pseudo-inverses in the lift, null for exact (PRISM only)", None, "[0, 1)")

    def __post_init__(self) -> None:
        """Check every field against its type, choices and range; numbers become floats, pairs tuples."""
        hints = _hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            if (why := _problem(hints[f.name], f.metadata, value)) is not None:
                raise SchemaError(f"method.{f.name}={_shown(value)} {why}")
            if _is_number(value) and _base(hints[f.name])[0] is float:
                object.__setattr__(self, f.name, float(value))
            elif isinstance(value, list | tuple):
                object.__setattr__(self, f.name, tuple(float(v) for v in value))

    @classmethod
    def from_node(cls, node: Mapping[str, Any]) -> MethodConfig:
        """The dataclass of a method node (a yaml's keys, ``_target_`` aside: the registry reads it);
        an unknown or missing key is a :class:`SchemaError`."""
        plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        plain.pop("_target_", None)
        keys = [f.name for f in fields(cls)]
        if unknown := [k for k in plain if k not in keys]:
            raise SchemaError(f"unknown key method.{unknown[0]} for method {plain.get('name')}, "
                              f"its keys are {', '.join(keys)}")
        if missing := [f.name for f in fields(cls) if f.name not in plain and f.default is MISSING]:
            raise SchemaError(f"method.{missing[0]} is missing, add it to conf/method/{plain.get('name')}.yaml")
        return cls(**plain)

    def options(self) -> dict[str, Any]:
        """``lr`` and the method's own keys (those of the subclass): an optimizer's keyword arguments."""
        common = {f.name for f in fields(MethodConfig)} - {"lr"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in common}


@dataclass(frozen=True, kw_only=True)
class PrismConfig(MethodConfig):
    """``prism`` / ``prism_paper``: the rank-space adaptive transform (eqs. 24–26, :mod:`prism.mechanism.adaptive`)
    and the lift; the defaults are the released code's (method ``prism``)."""

    init: Literal["spectral"] = key(
        "PRISM needs full-rank factors, and peft's B = 0 has rank 0: use the spectral init (D14)", "spectral")
    preconditioner: Literal["floor", "ridge", "none"] = key(
        "rank-space preconditioner: released floor, eq. 25 ridge, or none", "floor")
    beta1: float = key("first-moment decay", 0.9, "[0, 1)")
    beta2: float = key("second-moment decay", 0.999, "[0, 1)")
    eps: float = key("moment offset", 1e-8, "[0, inf)")
    floor_mode: Literal["scalar", "geometry"] = key("eigenvalue floor: released scalar or eq. 26 geometry", "scalar")
    floor_factor: float = key("floor / ridge constant (eq. 26)", 0.5, "[0, inf)")
    cond_max: float | None = key("condition-number clamp, null for none", 1e4, "[1, inf)")
    debias: bool = key("eq. 50 noise debias of the second moment (App. A.26)", False)
    bias_correction: bool = key("Adam-style bias correction of the moments", True)
    horizontalize: Literal["both", "pre_retract", "none"] = key(
        "horizontal projection of the lift: both, pre_retract or none", "both")
    rank_fallback: Literal["floor"] | None = key(
        "a rank-deficient Gram matrix: null (an error, D20) or floor its spectrum", None)
    compute_dtype: Literal["float32", "float64"] = key("dtype of snapshots, rank check and moments", "float32")


BETAS = "Adam's moment decays"


@dataclass(frozen=True, kw_only=True)
class AdamWConfig(MethodConfig):
    """``adamw`` / ``ffa``: ``torch.optim.AdamW``'s arguments, every one explicit (D23, D24)."""

    betas: tuple[float, float] = key(BETAS, range="[0, 1)")
    eps: float = key("Adam's denominator offset", range="(0, inf)")
    weight_decay: float = key("decoupled weight decay", range="[0, inf)")
    amsgrad: bool = key("AMSGrad variant")


@dataclass(frozen=True, kw_only=True)
class LoraPlusConfig(AdamWConfig):
    """``loraplus``: AdamW with peft ``lora_B``'s rate multiplied (D25)."""

    loraplus_lr_ratio: float = key("LoRA+'s ρ, Table 8", range="(0, inf)")


LAMB_FLAG = "pytorch-optimizer Lamb's "
RESCALING = "LAMB may not rescale the privatised gradient (D26)"


@dataclass(frozen=True, kw_only=True)
class LambConfig(MethodConfig):
    """``lamb``: pytorch-optimizer ``Lamb``'s arguments, every one explicit (D26)."""

    betas: tuple[float, float] = key(BETAS, range="[0, 1)")
    eps: float = key("LAMB's denominator offset", range="(0, inf)")
    weight_decay: float = key("weight decay", range="[0, inf)")
    weight_decouple: bool = key(LAMB_FLAG + "weight_decouple")
    fixed_decay: bool = key(LAMB_FLAG + "fixed_decay")
    rectify: bool = key(LAMB_FLAG + "rectify")
    degenerated_to_sgd: bool = key(LAMB_FLAG + "degenerated_to_sgd")
    grad_averaging: bool = key(LAMB_FLAG + "grad_averaging")
    adam: bool = key(LAMB_FLAG + "adam")
    adam_debias: bool = key(LAMB_FLAG + "adam_debias")
    adanorm: bool = key(LAMB_FLAG + "adanorm")
    foreach: bool = key(LAMB_FLAG + "foreach")
    maximize: bool = key(LAMB_FLAG + "maximize")
    n_sma_threshold: int = key("RAdam's SMA threshold (rectify only)", range="[0, inf)")
    max_grad_norm: Literal[0.0] = key(f"must stay 0: {RESCALING}")
    pre_norm: Literal[False] = key(f"must stay false: {RESCALING}")


@dataclass(frozen=True, kw_only=True)
class LoraRiteConfig(MethodConfig):
    """``lora_rite``: :class:`prism.methods.lora_rite.LoRARite`'s arguments (D27)."""

    betas: tuple[float, float] = key(BETAS, range="[0, 1)")
    eps: float = key("denominator offset", range="(0, inf)")
    update_skipping: float = key("zero an update whose RMS exceeds this, 0 disables (D27)", range="[0, inf)")
    clip_unmagnified_grad: float = key("clip the unmagnified gradients to this norm, 0 disables (D27)",
                                       range="[0, inf)")


# ------------------------------------------------------------------------------ field checks
_hints = functools.cache(typing.get_type_hints)


def _base(hint: Any) -> tuple[Any, tuple[Any, ...] | None, bool]:
    """``(kind, choices, nullable)`` of a field's type: kind ``float``/``int``/``bool``/``str`` or
    ``"pair"``; choices from a ``Literal`` (``None`` first where ``null`` is allowed)."""
    args = typing.get_args(hint)
    nullable = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if nullable:
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        return type(choices[0]), ((None,) if nullable else ()) + choices, nullable
    return ("pair" if typing.get_origin(hint) is tuple else hint), None, nullable


def _problem(hint: Any, meta: Mapping[str, Any], value: Any) -> str | None:
    """Why ``value`` is invalid for a field (the fix included), or None."""
    kind, choices, nullable = _base(hint)
    doc = meta["help"]
    if value is None:
        return None if nullable else f"may not be null ({doc})"
    if kind == "pair":
        if not (isinstance(value, list | tuple) and len(value) == 2 and all(_is_number(v) for v in value)):
            return f"must be two numbers [a, b] ({doc})"
        bad = next((why for v in value if (why := _range(meta.get("range"), float(v)))), None)
        return None if bad is None else f"must be two numbers each {bad} ({doc})"
    if kind in KINDS and not KINDS[kind][0](value):
        return f"must be {KINDS[kind][1]} ({doc})"
    if choices is not None and value not in choices:
        names = ", ".join(_shown(c) for c in choices)
        return f"must be {'one of ' if len(choices) > 1 else ''}{names} ({doc})"
    if kind in (int, float):
        bad = _range(meta.get("range"), float(value))
        return None if bad is None else f"must be {bad} ({doc})"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


KINDS = {  # a field's kind -> (does a value have it, what a value must be)
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    float: (_is_number, "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
}
INTERVAL = re.compile(r"([\[(])(\S+), (\S+)([\])])")


def _range(interval: str | None, x: float) -> str | None:
    """Why ``x`` lies outside ``interval`` (``"[0, 1)"``; ``inf`` for no bound), or None."""
    if not math.isfinite(x):
        return "a finite number"
    if interval is None:
        return None
    left, low, high, right = INTERVAL.fullmatch(interval).groups()
    lo, hi = float(low), float(high)
    if (x > lo if left == "(" else x >= lo) and (x < hi if right == ")" else x <= hi):
        return None
    if math.isinf(hi):
        return f"{'>' if left == '(' else '>='} {lo:g}"
    return f"in {interval}"


def _shown(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
