"""Each method's config: one dataclass, the object the method receives (docs/DECISIONS.md D78).

``conf/method/<name>.yaml`` gives the values; the dataclass says which values are valid. A field
carries its type (``Literal`` for the choices, ``X | None`` where ``null`` is allowed, ``tuple[float,
float]`` for a pair), its default (none: the yaml must give it) and, in ``metadata``, its ``help`` and
the ``range`` of a number (``"[0, 1)"``, ``"(0, inf)"``; a pair bounds each entry), which
:meth:`MethodConfig.__post_init__` checks, one :class:`SchemaError` line per bad value. The keys every
method node carries (``name``, ``lr``, ``init``, and the protocol's ``init_svd``, ``noise_damping``,
``pinv_rcond``, D4–D6) are declared once in :class:`MethodConfig`. ``Dnn`` in a help text is the
entry of docs/DECISIONS.md.

No torch here: the pre-run validator (:mod:`pipelines.config_rules`) calls :func:`check` and reports a
bad value in about a second; :func:`prism.methods.build_method` builds the same dataclass.
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
           "SchemaError", "check"]


class SchemaError(ValueError):
    """A method key with a value its dataclass refuses; one line naming ``method.<key>`` and the fix."""


@dataclass(frozen=True, kw_only=True)
class MethodConfig:
    """The keys of every method node; a method's own keys come in a subclass."""

    name: str = field(metadata={"help": "the method, chosen by method=<name>"})
    lr: float = field(metadata={"help": "learning rate, Table 8", "range": "(0, inf)"})
    init: Literal["peft", "spectral"] = field(default="peft", metadata={
        "help": "LoRA init: peft (B = 0) or spectral residual (docs/DECISIONS.md D14)"})
    init_svd: Literal["auto", "randomized"] = field(default="auto", metadata={
        "help": "SVD of the spectral init: exact up to 1024, randomized above (auto) or always randomized"})
    noise_damping: float | None = field(default=None, metadata={
        "help": "released protocol's (N + δI)^-1/2 whitening, null for exact (PRISM only)", "range": "[0, inf)"})
    pinv_rcond: float | None = field(default=None, metadata={
        "help": "released protocol's eigen-cut pseudo-inverses in the lift, null for exact (PRISM only)",
        "range": "[0, 1)"})

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
        for key in plain:
            if key not in keys:
                raise SchemaError(f"unknown key method.{key} for method {plain.get('name')}, "
                                  f"its keys are {', '.join(keys)}")
        missing = [f.name for f in fields(cls) if f.name not in plain and f.default is MISSING]
        if missing:
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

    init: Literal["spectral"] = field(default="spectral", metadata={
        "help": "PRISM needs full-rank factors, and peft's B = 0 has rank 0: use the spectral init (D14)"})
    preconditioner: Literal["floor", "ridge", "none"] = field(default="floor", metadata={
        "help": "rank-space preconditioner: released floor, eq. 25 ridge, or none"})
    beta1: float = field(default=0.9, metadata={"help": "first-moment decay", "range": "[0, 1)"})
    beta2: float = field(default=0.999, metadata={"help": "second-moment decay", "range": "[0, 1)"})
    eps: float = field(default=1e-8, metadata={"help": "moment offset", "range": "[0, inf)"})
    floor_mode: Literal["scalar", "geometry"] = field(default="scalar", metadata={
        "help": "eigenvalue floor: released scalar or eq. 26 geometry"})
    floor_factor: float = field(default=0.5, metadata={"help": "floor / ridge constant (eq. 26)", "range": "[0, inf)"})
    cond_max: float | None = field(default=1e4, metadata={
        "help": "condition-number clamp, null for none", "range": "[1, inf)"})
    debias: bool = field(default=False, metadata={"help": "eq. 50 noise debias of the second moment (App. A.26)"})
    bias_correction: bool = field(default=True, metadata={"help": "Adam-style bias correction of the moments"})
    horizontalize: Literal["both", "pre_retract", "none"] = field(default="both", metadata={
        "help": "horizontal projection of the lift: both, pre_retract or none"})
    rank_fallback: Literal["floor"] | None = field(default=None, metadata={
        "help": "a rank-deficient Gram matrix: null (an error, D20) or floor its spectrum"})
    compute_dtype: Literal["float32", "float64"] = field(default="float32", metadata={
        "help": "dtype of snapshots, rank check and moments"})


BETAS = {"help": "Adam's moment decays", "range": "[0, 1)"}


@dataclass(frozen=True, kw_only=True)
class AdamWConfig(MethodConfig):
    """``adamw`` / ``ffa``: ``torch.optim.AdamW``'s arguments, every one explicit (D23, D24)."""

    betas: tuple[float, float] = field(metadata=BETAS)
    eps: float = field(metadata={"help": "Adam's denominator offset", "range": "(0, inf)"})
    weight_decay: float = field(metadata={"help": "decoupled weight decay", "range": "[0, inf)"})
    amsgrad: bool = field(metadata={"help": "AMSGrad variant"})


@dataclass(frozen=True, kw_only=True)
class LoraPlusConfig(AdamWConfig):
    """``loraplus``: AdamW with peft ``lora_B``'s rate multiplied (D25)."""

    loraplus_lr_ratio: float = field(metadata={"help": "LoRA+'s ρ, Table 8", "range": "(0, inf)"})


def _lamb_flag(flag: str) -> Any:
    return field(metadata={"help": f"pytorch-optimizer Lamb's {flag}"})


RESCALING = "LAMB may not rescale the privatised gradient (D26)"


@dataclass(frozen=True, kw_only=True)
class LambConfig(MethodConfig):
    """``lamb``: pytorch-optimizer ``Lamb``'s arguments, every one explicit (D26)."""

    betas: tuple[float, float] = field(metadata=BETAS)
    eps: float = field(metadata={"help": "LAMB's denominator offset", "range": "(0, inf)"})
    weight_decay: float = field(metadata={"help": "weight decay", "range": "[0, inf)"})
    weight_decouple: bool = _lamb_flag("weight_decouple")
    fixed_decay: bool = _lamb_flag("fixed_decay")
    rectify: bool = _lamb_flag("rectify")
    degenerated_to_sgd: bool = _lamb_flag("degenerated_to_sgd")
    grad_averaging: bool = _lamb_flag("grad_averaging")
    adam: bool = _lamb_flag("adam")
    adam_debias: bool = _lamb_flag("adam_debias")
    adanorm: bool = _lamb_flag("adanorm")
    foreach: bool = _lamb_flag("foreach")
    maximize: bool = _lamb_flag("maximize")
    n_sma_threshold: int = field(metadata={"help": "RAdam's SMA threshold (rectify only)", "range": "[0, inf)"})
    max_grad_norm: Literal[0.0] = field(metadata={"help": f"must stay 0: {RESCALING}"})
    pre_norm: Literal[False] = field(metadata={"help": f"must stay false: {RESCALING}"})


@dataclass(frozen=True, kw_only=True)
class LoraRiteConfig(MethodConfig):
    """``lora_rite``: :class:`prism.methods.lora_rite.LoRARite`'s arguments (D27)."""

    betas: tuple[float, float] = field(metadata=BETAS)
    eps: float = field(metadata={"help": "denominator offset", "range": "(0, inf)"})
    update_skipping: float = field(metadata={
        "help": "zero an update whose RMS exceeds this, 0 disables (D27)", "range": "[0, inf)"})
    clip_unmagnified_grad: float = field(metadata={
        "help": "clip the unmagnified gradients to this norm, 0 disables (D27)", "range": "[0, inf)"})


def check(node: Mapping[str, Any]) -> None:
    """Raise :class:`SchemaError` for the first key of a method node that its method's dataclass refuses
    (an unknown or missing key included)."""
    from prism.methods import registry  # the registry names the dataclass; it imports this module

    registry.config_class(node).from_node(node)


# ------------------------------------------------------------------------------ field checks
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


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
    if kind is bool and not isinstance(value, bool):
        return f"must be true or false ({doc})"
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        return f"must be an integer ({doc})"
    if kind is float and not _is_number(value):
        return f"must be a number ({doc})"
    if kind is str and not isinstance(value, str):
        return f"must be a string ({doc})"
    if choices is not None and value not in choices:
        names = ", ".join(_shown(c) for c in choices)
        return f"must be {'one of ' if len(choices) > 1 else ''}{names} ({doc})"
    if kind in (int, float):
        bad = _range(meta.get("range"), float(value))
        return None if bad is None else f"must be {bad} ({doc})"
    return None


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


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
