"""Methods behind one interface (:class:`prism.methods.base.Method`), chosen by ``method.name``."""
from __future__ import annotations

from collections.abc import Mapping

from omegaconf import DictConfig
from torch import nn

from prism.methods.base import Method, PrivacySpec

METHODS = ("prism", "prism_paper", "adamw", "loraplus", "lamb", "ffa", "lora_rite")


def build_method(
    cfg: DictConfig, params: Mapping[str, nn.Parameter], privacy: PrivacySpec | None
) -> Method:
    """Build the method named ``cfg.name`` (a ``conf/method/*.yaml`` node, ``cfg.lr`` a float)."""
    if cfg.name in ("prism", "prism_paper"):
        from prism.methods.prism import PrismMethod

        return PrismMethod(cfg, params, privacy)
    if cfg.name in ("adamw", "loraplus", "lamb", "ffa", "lora_rite"):
        from prism.methods.factor import FactorDPMethod

        return FactorDPMethod(cfg, params, privacy)
    raise ValueError(f"unknown method {cfg.name!r}; choose one of {', '.join(METHODS)}")


__all__ = ["METHODS", "Method", "PrivacySpec", "build_method"]
