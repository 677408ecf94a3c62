"""Methods behind one interface (:class:`prism.methods.base.Method`), chosen by ``method.name``
through the registry (:mod:`prism.methods.registry`).

Importing the package loads no torch (:mod:`prism.methods.schema` is read by the pre-run
validator); ``Method`` and ``PrivacySpec`` load :mod:`prism.methods.base` on first use."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from prism.methods import registry
from prism.methods.schema import MethodConfig

if TYPE_CHECKING:
    from torch import nn

    from prism.methods.base import Method, PrivacySpec


def build_method(cfg: MethodConfig | DictConfig | Mapping[str, Any], params: Mapping[str, nn.Parameter],
                 privacy: PrivacySpec | None) -> Method:
    """The method ``cfg.name`` over ``params``: its registered class given its config dataclass (``cfg`` itself,
    or built and checked from a ``conf/method/*.yaml`` node)."""
    config = cfg if isinstance(cfg, MethodConfig) else registry.check(cfg)
    return registry.lookup(cfg)(config, params, privacy)


def __getattr__(name: str) -> Any:
    if name in ("Method", "PrivacySpec"):
        from prism.methods import base

        return getattr(base, name)
    raise AttributeError(f"module 'prism.methods' has no attribute {name!r}")


__all__ = ["Method", "PrivacySpec", "build_method", "registry"]
