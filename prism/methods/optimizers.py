"""The factor-space baselines: :class:`~prism.methods.factor.FactorDPMethod` with the update rule each
applies to its privatised gradient (docs/DECISIONS.md D23–D27, Table 8). Every hyper-parameter is read
explicitly from the method's config dataclass (:mod:`prism.methods.schema`), never a library default, so
a library upgrade cannot silently change a baseline.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from prism.methods.factor import FactorDPMethod
from prism.methods.lora_rite import LoRARite
from prism.methods.schema import AdamWConfig, LambConfig, LoraPlusConfig, LoraRiteConfig


def loraplus_param_groups(
    params: Mapping[str, nn.Parameter], lr: float, ratio: float, weight_decay: float
) -> list[dict[str, Any]]:
    """LoRA+ (Hayou et al. 2024) groups: peft ``lora_A`` (paper B) at ``lr``, peft ``lora_B`` (paper A) at
    ``lr·ρ``, as ``peft.optimizers.create_loraplus_optimizer`` builds them (it needs the whole peft model)."""
    other = [n for n in params if ".lora_A." not in n and ".lora_B." not in n]
    if other:
        raise ValueError(f"loraplus splits learning rates over LoRA factors only; {other[0]} is neither lora_A nor lora_B")
    return [{"params": [p for n, p in params.items() if f".{factor}." in n], "lr": rate, "weight_decay": weight_decay}
            for factor, rate in (("lora_A", lr), ("lora_B", lr * ratio))]


class AdamWMethod(FactorDPMethod):
    """DP-AdamW: ``torch.optim.AdamW`` (D23)."""

    name, label, config_class = "adamw", "AdamW", AdamWConfig

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(list(self.params.values()), **self.config.options())


class FFAMethod(AdamWMethod):
    """FFA (Sun et al. 2024): AdamW on peft ``lora_B`` only, the random peft ``lora_A`` frozen (D24)."""

    name, label, factors = "ffa", "FFA", ("lora_B",)


class LoraPlusMethod(FactorDPMethod):
    """LoRA+: AdamW over :func:`loraplus_param_groups` (D25)."""

    name, label, config_class = "loraplus", "LoRA+", LoraPlusConfig

    def build_optimizer(self) -> torch.optim.Optimizer:
        kw = self.config.options()
        groups = loraplus_param_groups(self.params, kw.pop("lr"), kw.pop("loraplus_lr_ratio"), kw.pop("weight_decay"))
        return torch.optim.AdamW(groups, **kw)


class LambMethod(FactorDPMethod):
    """LAMB: ``pytorch_optimizer.Lamb`` (You et al. 2020, D26) with its global-norm gradient rescaling
    switched off (``pre_norm: false``, ``max_grad_norm: 0``, which the config refuses to change) so the
    privatised gradient reaches the moments unchanged; the layer-wise trust ratio stays on (``adam: false``)."""

    name, label, config_class = "lamb", "LAMB", LambConfig

    def build_optimizer(self) -> torch.optim.Optimizer:
        from pytorch_optimizer import Lamb  # about a second to import: only for a LAMB run

        return Lamb(list(self.params.values()), **self.config.options())


class LoraRiteMethod(FactorDPMethod):
    """LoRA-RITE: :class:`prism.methods.lora_rite.LoRARite` (D27); the released HF recipe does not clip it."""

    name, label, config_class, hf_clips = "lora_rite", "RITE", LoraRiteConfig, False

    def build_optimizer(self) -> torch.optim.Optimizer:
        return LoRARite(self.params, **self.config.options())
