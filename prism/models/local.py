"""``backbone=local``: a causal LM from a ``save_pretrained`` folder, and which speed paths a model takes.

The folder (``backbone.path``) holds ``config.json``, ``*.safetensors`` and ``tokenizer.json``; nothing is
downloaded. Its LoRA targets and rank are checked against the safetensors headers before loading
(:func:`prism.backbones.local_problem`) and on the loaded model (:func:`prism.models.wiring.validate_lora`);
its dtype is ``backbone.dtype``. The speed paths are exact where they run and switch themselves off
elsewhere; :func:`speed_paths` says which run, for the run log.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

from prism.fastpath import grouped_attention, top_layer


def load_local(path: str | Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The model and fast tokenizer saved in ``path`` (local files only), eager attention, in ``dtype``."""
    folder = Path(str(path)).expanduser()
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager",
                                                     local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise RuntimeError(f"backbone.path={path}: transformers cannot load a causal LM from it "
                           f"({type(error).__name__}: {' '.join(str(error).split())[:200]}); save the model with "
                           "AutoModelForCausalLM.save_pretrained(DIR) and its tokenizer with tokenizer.save_pretrained(DIR)") from None
    if not getattr(tokenizer, "is_fast", False):
        raise RuntimeError(f"backbone.path={path}: the tokenizer is not a fast tokenizer (no tokenizer.json); "
                           "save a fast tokenizer (AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained(DIR))")
    return model, tokenizer


def speed_paths(model: nn.Module, prefix_mode: str) -> str:
    """One line for the run log: whether the frozen-prefix cache (training) and frozen prompt cache
    (evaluation), the top-layer path and grouped attention run for ``model`` (LoRA attached), and why not."""
    from prism.fastpath.prefix import _decoder, _unwrap, prefix_depth

    base = _unwrap(model)
    depth = prefix_depth(model)
    decoder = _decoder(model)
    if prefix_mode == "off":
        prefix = "off (train.prefix_cache=off)"
    elif depth is not None:
        prefix = f"on (layers below {depth} computed once)"
    elif decoder is None:
        prefix = f"off ({type(base).__name__} is not a decoder verified to replay exactly)"
    else:
        prefix = "off (LoRA or a trainable/stochastic module in the first layer)"
    top = "off (needs the frozen-prefix cache)" if depth is None or prefix_mode == "off" else (
        "on" if top_layer.supported(decoder) else f"off ({type(decoder.layers[-1]).__name__} is not a Llama layer)")
    model_type = getattr(base.config, "model_type", "?")
    grouped = "on" if model_type in grouped_attention.MODEL_TYPES else f"off (model_type {model_type})"
    return f"speed paths: frozen-prefix cache {prefix}; top-layer path {top}; grouped attention {grouped}"


def describe(model: Any) -> str:
    """Architecture, decoder depth and parameter count of a loaded model (run log)."""
    from prism.fastpath.prefix import _unwrap

    base = _unwrap(model)
    n = sum(p.numel() for p in base.parameters())
    return f"{type(base).__name__}, {base.config.get_text_config().num_hidden_layers} layers, {n / 1e6:.1f}M parameters"
