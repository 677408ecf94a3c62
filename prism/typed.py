"""Typed config nodes: the one-line :class:`ConfigError`, the field helpers of the job dataclasses
(:mod:`prism.job`, :mod:`prism.data.config`) and :func:`node_of`, which builds one from a mapping.

A field carries its type, its help (``metadata["help"]``) and, in its class's ``__post_init__``, its
choices and range; ``Optional[...]`` says where ``null`` is allowed (docs/ARCHITECTURE.md, "Resolved
config schema"). No torch, no Hydra.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from typing import Any, TypeVar

from omegaconf import MISSING, DictConfig, OmegaConf

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot run; the message is one line naming the field and the fix."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def positive_int(value: Any, key: str, minimum: int = 1) -> None:
    """``value`` is an integer ≥ ``minimum``, else the one-line error naming ``key``."""
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
            f"{key}={value!r} must be an integer >= {minimum}")


def choice(value: Any, key: str, choices: tuple[Any, ...], extra: str = "") -> None:
    """``value`` is one of ``choices``, else the one-line error naming ``key``."""
    *rest, last = (c if isinstance(c, str) else shown(c) for c in choices)
    require(value in choices, f"{key}={shown(value)} must be {', '.join(rest) + ' or ' if rest else ''}{last}{extra}")


def shown(value: Any) -> str:
    """``value`` as an error line shows it: a string quoted, ``null``/``true``/``false`` as yaml writes them."""
    if isinstance(value, list | tuple):
        return f"[{', '.join(shown(v) for v in value)}]"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value) if isinstance(value, str) else str(value)


def help_field(text: str, default: Any = MISSING) -> Any:
    """A field with its help text; without ``default`` the key is set by a group yaml."""
    return field(default=default, metadata={"help": text})


def node_of(cls: type[T], data: T | Mapping[str, Any], at: str | None = None) -> T:
    """The dataclass ``cls`` of a config node: ``data`` itself when it is one, else the mapping (or
    ``DictConfig``) merged into ``cls``'s structured config (an unknown key, a wrong type or a missing
    required key is refused; an int given for a float becomes that float) and built, so every
    ``__post_init__`` checks its choices and ranges. ``at``: the node's key in the job, merged below it
    so that OmegaConf's errors name the key as the job spells it (``method.lr``)."""
    if isinstance(data, cls):
        return data
    plain = OmegaConf.to_container(data, resolve=True) if isinstance(data, DictConfig) else data
    if at is None:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), plain))
    schema = OmegaConf.structured(cls)
    OmegaConf.set_readonly(schema, None)  # a frozen dataclass's node is merged into below the key, then built
    return OmegaConf.to_object(OmegaConf.merge({at: schema}, {at: plain}))[at]
