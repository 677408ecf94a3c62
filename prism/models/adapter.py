"""The peft adapter name and lookups of the LoRA-wrapped model shared by wiring, init and export."""
from __future__ import annotations

from peft.tuners.lora import LoraLayer
from torch import nn

ADAPTER = "default"
"""The peft adapter name used throughout."""


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
