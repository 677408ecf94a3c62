"""Backbones, LoRA wiring, the spectral-residual initialisation and adapter export.

Modules, one job each:

* :mod:`prism.backbones` – the registry :data:`BACKBONES` (readable without torch);
* :mod:`~prism.models.gguf` – embedded backbones: GGUF dequantised once into a validated cache;
* :mod:`~prism.models.tiny` – random-config test models and the byte-level tokenizer;
* :mod:`~prism.models.loading` – :func:`load_backbone` onto the training device, peak memory;
* :mod:`~prism.models.adapter` – the peft adapter name, module/parameter lookups, config-field access;
* :mod:`~prism.models.wiring` – the peft ``LoraConfig`` (paper Table 7), validation, :func:`attach_lora`;
* :mod:`~prism.models.spectral` – the spectral-residual initialisation;
* :mod:`~prism.models.export` – an adapter that loads on the original backbone.

Notation: paper ``A`` (m×r) is peft ``lora_B.weight``, paper ``Bᵀ`` (r×n) is peft
``lora_A.weight``; the conversion goes through :mod:`prism.mechanism.lora` only.
"""
from __future__ import annotations

from prism.backbones import BACKBONES, BackboneSpec, backbone_spec
from prism.models.adapter import ADAPTER, NON_LANGUAGE_MODULES, lora_modules, trainable_parameters
from prism.models.export import export_adapter, rebased_factors
from prism.models.gguf import cache_root, embedded_checkpoint
from prism.models.loading import (
    BackboneLoader,
    KeptBackbones,
    ensure_pad_token,
    load_backbone,
    peak_memory_mb,
)
from prism.models.spectral import (
    EXACT_SVD_MAX_DIM,
    RSVD_OVERSAMPLING,
    RSVD_POWER_ITERATIONS,
    balanced_factors,
    spectral_residual_init,
    top_r_svd,
)
from prism.models.tiny import byte_tokenizer
from prism.models.wiring import attach_lora, lora_config, validate_lora

__all__ = [
    "ADAPTER", "BACKBONES", "EXACT_SVD_MAX_DIM", "NON_LANGUAGE_MODULES", "RSVD_OVERSAMPLING",
    "RSVD_POWER_ITERATIONS", "BackboneSpec", "attach_lora", "backbone_spec", "balanced_factors",
    "byte_tokenizer", "cache_root", "embedded_checkpoint", "ensure_pad_token", "export_adapter",
    "BackboneLoader", "KeptBackbones", "load_backbone", "lora_config", "lora_modules", "peak_memory_mb", "rebased_factors",
    "spectral_residual_init", "top_r_svd", "trainable_parameters", "validate_lora",
]
