"""Backbones (registry in :mod:`prism.backbones`, readable without torch; loading, embedded GGUF cache,
tiny test models), LoRA wiring (paper Table 7), the spectral-residual initialisation and adapter export.

Notation: paper ``A`` (m×r) is peft ``lora_B.weight``, paper ``Bᵀ`` (r×n) is peft ``lora_A.weight``; the
conversion goes through :mod:`prism.mechanism.lora` only.
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
