"""The peft adapter name, lookups of the LoRA-wrapped model and config-field access shared by loading,
wiring, init and export."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from peft.tuners.lora import LoraLayer
from torch import nn

ADAPTER = "default"
"""The peft adapter name used throughout."""

NON_LANGUAGE_MODULES = r".*(vision_tower|vision_model|multi_modal_projector).*"
"""peft ``exclude_modules`` regex: never put LoRA on a multimodal checkpoint's vision side."""


def _field(cfg: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from a mapping (dict / OmegaConf) or an attribute object."""
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def is_lora_parameter(name: str) -> bool:
    """Whether a ``named_parameters`` name is one of peft's LoRA factors (``lora_A`` / ``lora_B``)."""
    return ".lora_A." in name or ".lora_B." in name


def lora_modules(peft_model: nn.Module) -> dict[str, LoraLayer]:
    """LoRA-wrapped layers by module name (the names :func:`prism.mechanism.lora.lora_pairs` reports)."""
    return {name: module for name, module in peft_model.named_modules()
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A}


def trainable_parameters(peft_model: nn.Module) -> dict[str, nn.Parameter]:
    """Name → parameter for every parameter with ``requires_grad`` (names of ``named_parameters``)."""
    return {name: param for name, param in peft_model.named_parameters() if param.requires_grad}
