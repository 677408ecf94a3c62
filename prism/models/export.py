"""Adapter export: a peft adapter directory that loads on the original, unmodified backbone."""
from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file
from torch import Tensor

from prism.mechanism.lora import lora_pairs, peft_factors, read_pair
from prism.models.adapter import ADAPTER, is_lora_parameter


def rebased_factors(A: Tensor, B: Tensor, A0: Tensor, B0: Tensor) -> tuple[Tensor, Tensor]:
    """Rank-2r paper factors ``A' = [A, −A0]``, ``B' = [B, B0]``: ``A'B'ᵀ = ABᵀ − A0B0ᵀ``, so on the original ``W``
    the trained weight ``W_res + s·ABᵀ = W + s(ABᵀ − A0B0ᵀ)`` is reproduced at the same scaling ``s``."""
    return torch.cat([A, -A0.to(A)], dim=1), torch.cat([B, B0.to(B)], dim=1)


def export_adapter(peft_model: PeftModel, path: str | os.PathLike[str]) -> Path:
    """A peft adapter directory that loads on the original, unmodified backbone with
    ``PeftModel.from_pretrained(original, path)`` and reproduces ``peft_model``'s outputs: ``save_pretrained``
    after peft init; after spectral init rank ``2r``, ``lora_alpha' = s·2r`` and :func:`rebased_factors`."""
    path = Path(path)
    init_factors = getattr(peft_model, "prism_init_factors", None)
    if not init_factors:
        peft_model.save_pretrained(path)
        return path
    config = copy.deepcopy(peft_model.peft_config[ADAPTER])
    scaling = config.lora_alpha / config.r
    config.r, config.lora_alpha = 2 * config.r, scaling * 2 * config.r
    state = get_peft_model_state_dict(peft_model, adapter_name=ADAPTER)
    # only the LoRA factors reach the host in fp32: the frozen base is never read (a 4B base would
    # be ≈17 GB of host memory), the rebase needs nothing but (A, B) and the stored (A0, B0)
    params = {name: param.detach().float().cpu() for name, param in peft_model.named_parameters()
              if is_lora_parameter(name)}
    for pair in lora_pairs(params):
        A, B = read_pair(params, pair)
        lora_A_weight, lora_B_weight = peft_factors(*rebased_factors(A, B, *init_factors[pair.module]))
        for side, weight in (("lora_A", lora_A_weight), ("lora_B", lora_B_weight)):
            key = f"{pair.module}.{side}.weight"
            if key not in state:
                raise RuntimeError(f"peft state dict has no {key}; cannot rebase the spectral adapter")
            state[key] = weight.contiguous()
    state = {key: value.detach().cpu().contiguous() for key, value in state.items()}
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    save_file(state, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path
