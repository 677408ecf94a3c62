"""Methods behind one interface (:class:`prism.methods.base.Method`), chosen by ``method.name``.

Importing the package loads no torch (:mod:`prism.methods.schema` is read by the pre-run
validator); ``Method`` and ``PrivacySpec`` load :mod:`prism.methods.base` on first use."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from prism.methods import schema

if TYPE_CHECKING:
    from torch import nn

    from prism.methods.base import Method, PrivacySpec

METHODS = ("prism", "prism_paper", "adamw", "loraplus", "lamb", "ffa", "lora_rite")


def build_method(
    cfg: DictConfig, params: Mapping[str, nn.Parameter], privacy: PrivacySpec | None
) -> Method:
    """Build the method named ``cfg.name`` (a ``conf/method/*.yaml`` node, ``cfg.lr`` a float),
    after checking the node against the method's schema (:mod:`prism.methods.schema`)."""
    schema.check(cfg)
    if cfg.name in ("prism", "prism_paper"):
        from prism.methods.prism import PrismMethod

        return PrismMethod(cfg, params, privacy)
    if cfg.name in ("adamw", "loraplus", "lamb", "ffa", "lora_rite"):
        from prism.methods.factor import FactorDPMethod

        return FactorDPMethod(cfg, params, privacy)
    raise ValueError(f"unknown method {cfg.name!r}; choose one of {', '.join(METHODS)}")


def __getattr__(name: str) -> Any:
    if name in ("Method", "PrivacySpec"):
        from prism.methods import base

        return getattr(base, name)
    raise AttributeError(f"module 'prism.methods' has no attribute {name!r}")


__all__ = ["METHODS", "Method", "PrivacySpec", "build_method"]
