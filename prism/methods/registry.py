"""The method registry: a method's name → its class (docs/DECISIONS.md D78, docs/ARCHITECTURE.md).

The shipped methods are listed once, in :data:`SHIPPED` (the step audit's seed order), with their
config dataclasses, so the validator reads a node's dataclass without importing torch; their classes
load on first use. A method defined elsewhere names its class in its yaml (``_target_:
package.module.Class``), imported on the first lookup of its name. The shipped yamls carry no
``_target_``: their run hashes (:mod:`pipelines.runs.store`) stayed what they were.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prism.methods.schema import (
    AdamWConfig,
    LambConfig,
    LoraPlusConfig,
    LoraRiteConfig,
    MethodConfig,
    PrismConfig,
    SchemaError,
)

if TYPE_CHECKING:
    from prism.methods.base import Method

TARGET = "_target_"
SHIPPED: dict[str, tuple[str, type[MethodConfig]]] = {  # name → (class, its config dataclass)
    "prism": ("prism.methods.prism.PrismMethod", PrismConfig),
    "prism_paper": ("prism.methods.prism.PrismPaperMethod", PrismConfig),
    "adamw": ("prism.methods.optimizers.AdamWMethod", AdamWConfig),
    "loraplus": ("prism.methods.optimizers.LoraPlusMethod", LoraPlusConfig),
    "lamb": ("prism.methods.optimizers.LambMethod", LambConfig),
    "ffa": ("prism.methods.optimizers.FFAMethod", AdamWConfig),
    "lora_rite": ("prism.methods.optimizers.LoraRiteMethod", LoraRiteConfig),
}
_loaded: dict[str, type[Method]] = {}


def names() -> tuple[str, ...]:
    """The shipped methods, then those loaded from a yaml's ``_target_`` in this process."""
    return (*SHIPPED, *(n for n in _loaded if n not in SHIPPED))


def lookup(node: Mapping[str, Any] | MethodConfig | str) -> type[Method]:
    """The class of method ``node`` (a method node, its dataclass, or a name); :class:`SchemaError` names the fix."""
    if isinstance(node, str | MethodConfig):
        name, target = (node if isinstance(node, str) else node.name), None
    else:
        name, target = str(node.get("name")), node.get(TARGET)
    if name in _loaded:
        return _loaded[name]
    if name in SHIPPED:
        target = SHIPPED[name][0]
    elif target is None:
        raise SchemaError(f"method.name={name!r} is not a method, choose method=<one of {', '.join(names())}> "
                          f"(a method of your own: {TARGET}: package.module.Class in its yaml)")
    module, _, attr = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise SchemaError(f"method.{TARGET}={target} cannot be imported ({type(err).__name__}: {err}), "
                          "give the dotted path of the method's class") from None
    if getattr(cls, "name", None) != name:
        raise SchemaError(f"method.{TARGET}={target} is the method {getattr(cls, 'name', None)!r}, not {name!r}; "
                          "name the class whose name is the yaml's")
    _loaded[name] = cls
    return cls


def config_class(node: Mapping[str, Any] | str) -> type[MethodConfig]:
    """The config dataclass of method ``node``; a shipped method's without importing its class (no torch)."""
    name = node if isinstance(node, str) else str(node.get("name"))
    return SHIPPED[name][1] if name in SHIPPED else lookup(node).config_class


def check(node: Mapping[str, Any]) -> MethodConfig:
    """The config dataclass of a method node; :class:`SchemaError` for its first key that the dataclass
    refuses (an unknown or missing key included)."""
    return config_class(node).from_node(node)
