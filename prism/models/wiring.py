"""LoRA wiring: the peft config of the paper's Table 7 (never on a multimodal checkpoint's vision tower or
projector), target validation and :func:`attach_lora`.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn
from transformers import PreTrainedModel

from prism.models.adapter import ADAPTER, NON_LANGUAGE_MODULES, _field, is_lora_parameter
from prism.models.spectral import spectral_residual_init


def lora_config(model: nn.Module, cfg_lora: Any, cfg_backbone: Any) -> LoraConfig:
    """The peft ``LoraConfig`` of the paper's Table 7 (r, α, dropout, targets, bias none), restricted
    to the last ``lora_layers`` decoder layers when set and never touching a vision tower."""
    lora_layers = _field(cfg_backbone, "lora_layers")
    n_layers = model.config.get_text_config().num_hidden_layers
    layers = None
    if lora_layers is not None:
        if not 1 <= int(lora_layers) <= n_layers:
            raise ValueError(f"backbone.lora_layers={lora_layers} must be in 1..{n_layers} (or null for all)")
        layers = list(range(n_layers - int(lora_layers), n_layers))
    vision = any(re.fullmatch(NON_LANGUAGE_MODULES, name) for name, _ in model.named_modules())
    return LoraConfig(r=int(_field(cfg_lora, "r")), lora_alpha=float(_field(cfg_lora, "alpha")),
                      lora_dropout=float(_field(cfg_lora, "dropout", 0.0)),
                      target_modules=list(_field(cfg_lora, "targets")), bias="none", task_type="CAUSAL_LM",
                      layers_to_transform=layers, layers_pattern="layers" if layers else None,
                      exclude_modules=NON_LANGUAGE_MODULES if vision else None)


def validate_lora(model: nn.Module, config: LoraConfig) -> list[str]:
    """Check the targets exist and that ``r ≤ min(in, out)`` for every targeted layer; return the
    names of the targeted modules. Errors are one line and name the fix."""
    linears = {name: module for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and not re.fullmatch(NON_LANGUAGE_MODULES, name)}
    available = sorted({name.rsplit(".", 1)[-1] for name in linears})
    unknown = sorted(set(config.target_modules) - set(available))
    if unknown:
        raise ValueError(f"unknown lora.targets {unknown}; this backbone's linear layers are {available}")
    targeted = [name for name in linears if check_target_module_exists(config, name) is True]
    for name in targeted:
        out_features, in_features = linears[name].weight.shape
        if config.r > min(out_features, in_features):
            raise ValueError(f"lora.r={config.r} exceeds min(out, in)={min(out_features, in_features)} of "
                             f"{name} ({out_features}x{in_features}); lower lora.r or drop "
                             f"{name.rsplit('.', 1)[-1]} from lora.targets")
    return targeted


def attach_lora(model: PreTrainedModel, cfg_lora: Any, cfg_backbone: Any, init: str,
                generator: torch.Generator | None, init_svd: str = "auto") -> PeftModel:
    """Wrap ``model`` with LoRA (everything else frozen, LoRA factors in fp32), initialised by peft's default
    (``init="peft"``: paper A = ``lora_B`` = 0) or :func:`spectral_residual_init` (``init="spectral"``)."""
    if init not in ("peft", "spectral"):
        raise ValueError(f"unknown method.init {init!r}; use 'spectral' or 'peft'")
    config = lora_config(model, cfg_lora, cfg_backbone)
    validate_lora(model, config)
    peft_model = get_peft_model(model, config, adapter_name=ADAPTER)
    for name, param in peft_model.named_parameters():
        is_lora = is_lora_parameter(name)
        param.requires_grad_(is_lora)
        if is_lora and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.float()
    if init == "spectral":
        spectral_residual_init(peft_model, generator, init_svd)
    return peft_model
