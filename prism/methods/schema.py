"""Each method's config: one dataclass, the object the method receives (docs/DECISIONS.md D78).

A field carries its type (``X | None``: null allowed; ``tuple[float, float]``: a pair), default (none:
the yaml must give it), help, choices and numeric range (:func:`key`). :meth:`MethodConfig.from_node`
types a method node by OmegaConf's structured config of the method's class, as every other job section
(:func:`prism.typed.node_of`); :meth:`MethodConfig.__post_init__` checks the choices and ranges, which
OmegaConf cannot express (one :class:`SchemaError` line per bad value). ``conf/method/<name>.yaml``
gives the values. No torch here: the pre-run validator calls :func:`prism.methods.registry.check`.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue

from prism.typed import ConfigError, choice, node_of, require, shown

__all__ = ["AdamWConfig", "LambConfig", "LoraPlusConfig", "LoraRiteConfig", "MethodConfig", "PrismConfig",
           "SchemaError"]


SchemaError = ConfigError  # a method key its dataclass refuses: every section's one line naming the key and the fix


def key(help: str, default: Any = MISSING, range: str | None = None, choices: tuple[Any, ...] | None = None) -> Any:
    """A config field: its default (none: the yaml must give it), help, numeric ``range`` (``"[0, 1)"``,
    ``inf`` for no bound) and ``choices`` (a ``Literal``'s, which OmegaConf cannot type)."""
    return field(default=default, metadata={"help": help, "range": range, "choices": choices})


@dataclass(frozen=True, kw_only=True)
class MethodConfig:
    """The keys of every method node; a method's own keys come in a subclass."""

    name: str = key("the method, chosen by method=<name>")
    lr: float = key("learning rate, Table 8", range="(0, inf)")
    init: str = key("LoRA init: peft (B = 0) or spectral residual (docs/DECISIONS.md D14)", "peft",
                    choices=("peft", "spectral"))
    init_svd: str = key("SVD of the spectral init: exact up to 1024, randomized above (auto) or always randomized",
                        "auto", choices=("auto", "randomized"))
    noise_damping: float | None = key(
        "released protocol's (N + δI)^-1/2 whitening, null for exact (PRISM only)", None, "[0, inf)")
    pinv_rcond: float | None = key(
        "released protocol's eigen-cut pseudo-inverses in the lift, null for exact (PRISM only)", None, "[0, 1)")

    def __post_init__(self) -> None:
        """Check every field's choices and range (its :func:`key` metadata; the types are OmegaConf's,
        :meth:`from_node`); a pair becomes a tuple."""
        for f in fields(self):
            value, name, doc = getattr(self, f.name), f"method.{f.name}", f" ({f.metadata['help']})"
            if f.metadata.get("choices") is not None:
                choice(value, name, f.metadata["choices"], doc)
            pair = isinstance(value, list | tuple)
            if pair:
                require(len(value) == 2, f"{name}={shown(value)} must be two numbers [a, b]{doc}")
                object.__setattr__(self, f.name, tuple(value))
            for x in value if pair else [value]:
                if isinstance(x, int | float) and not isinstance(x, bool):
                    bound = _outside(f.metadata.get("range"), x)
                    require(bound is None, f"{name}={shown(value)} must be {'two numbers each ' * pair}{bound}{doc}")

    @classmethod
    def from_node(cls, node: Mapping[str, Any]) -> MethodConfig:
        """The dataclass of a method node (a yaml's keys, ``_target_`` aside: the registry reads it) through
        OmegaConf's structured config of ``cls`` (:func:`prism.typed.node_of`): an unknown or missing key,
        a refused choice or range is a :class:`SchemaError` naming ``method.<key>``; a wrong type is OmegaConf's
        ``ValidationError`` (a ``ValueError``) naming it, which the pipeline's validator words as every other
        section's (``pipelines/config/schema.py``)."""
        plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        plain.pop("_target_", None)
        try:
            return node_of(cls, plain, at="method")
        except ConfigKeyError as err:
            raise SchemaError(f"unknown key {err.full_key} for method {plain.get('name')}, "
                              f"its keys are {', '.join(f.name for f in fields(cls))}") from None
        except MissingMandatoryValue as err:
            raise SchemaError(f"{err.full_key} is missing, add it to conf/method/{plain.get('name')}.yaml") from None

    def options(self) -> dict[str, Any]:
        """``lr`` and the method's own keys (those of the subclass): an optimizer's keyword arguments."""
        common = {f.name for f in fields(MethodConfig)} - {"lr"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in common}


@dataclass(frozen=True, kw_only=True)
class PrismConfig(MethodConfig):
    """``prism`` / ``prism_paper``: the rank-space adaptive transform (eqs. 24–26, :mod:`prism.mechanism.adaptive`)
    and the lift; the defaults are the released code's (method ``prism``)."""

    init: str = key("PRISM needs full-rank factors, and peft's B = 0 has rank 0: use the spectral init (D14)",
                    "spectral", choices=("spectral",))
    preconditioner: str = key("rank-space preconditioner: released floor, eq. 25 ridge, or none", "floor",
                              choices=("floor", "ridge", "none"))
    beta1: float = key("first-moment decay", 0.9, "[0, 1)")
    beta2: float = key("second-moment decay", 0.999, "[0, 1)")
    eps: float = key("moment offset", 1e-8, "[0, inf)")
    floor_mode: str = key("eigenvalue floor: released scalar or eq. 26 geometry", "scalar",
                          choices=("scalar", "geometry"))
    floor_factor: float = key("floor / ridge constant (eq. 26)", 0.5, "[0, inf)")
    cond_max: float | None = key("condition-number clamp, null for none", 1e4, "[1, inf)")
    debias: bool = key("eq. 50 noise debias of the second moment (App. A.26)", False)
    bias_correction: bool = key("Adam-style bias correction of the moments", True)
    horizontalize: str = key("horizontal projection of the lift: both, pre_retract or none", "both",
                             choices=("both", "pre_retract", "none"))
    rank_fallback: str | None = key("a rank-deficient Gram matrix: null (an error, D20) or floor its spectrum", None,
                                    choices=("floor", None))
    compute_dtype: str = key("dtype of snapshots, rank check and moments", "float32", choices=("float32", "float64"))


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
    max_grad_norm: float = key(f"must stay 0: {RESCALING}", choices=(0.0,))
    pre_norm: bool = key(f"must stay false: {RESCALING}", choices=(False,))


@dataclass(frozen=True, kw_only=True)
class LoraRiteConfig(MethodConfig):
    """``lora_rite``: :class:`prism.methods.lora_rite.LoRARite`'s arguments (D27)."""

    betas: tuple[float, float] = key(BETAS, range="[0, 1)")
    eps: float = key("denominator offset", range="(0, inf)")
    update_skipping: float = key("zero an update whose RMS exceeds this, 0 disables (D27)", range="[0, inf)")
    clip_unmagnified_grad: float = key("clip the unmagnified gradients to this norm, 0 disables (D27)",
                                       range="[0, inf)")


# ------------------------------------------------------------------------------ ranges
INTERVAL = re.compile(r"([\[(])(\S+), (\S+)([\])])")


def _outside(interval: str | None, x: float) -> str | None:
    """What ``x`` must be when it lies outside ``interval`` (``"[0, 1)"``; ``inf`` for no bound) or is not
    finite, else None."""
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
