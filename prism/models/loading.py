"""Loading a frozen backbone and its tokenizer onto the training device: eager attention (``torch.func``
per-sample gradients need it), ``use_cache=False`` (the evaluator turns it on for ``generate``); the
multimodal Gemma-3 paper checkpoints load as ``Gemma3ForConditionalGeneration`` and are fed text only.
"""
from __future__ import annotations

import copy
import json
import re
import resource
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from prism.backbones import RANDOM_CONFIGS, BackboneSpec, backbone_spec
from prism.models.adapter import NON_LANGUAGE_MODULES, _field
from prism.models.gguf import embedded_checkpoint
from prism.models.tiny import _tiny_model, byte_tokenizer

_RANDOM_SEED = 1234
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def ensure_pad_token(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """Give the tokenizer a pad token when it has none: the EOS token (padding is masked anyway)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("tokenizer has neither a pad nor an eos token; cannot pad batches")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_hub(spec: BackboneSpec, dtype: torch.dtype,
              device: str | torch.device) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A paper backbone by hub id (weights placed straight on ``device``); a one-line error naming
    ``make data`` when it is neither cached nor downloadable."""
    try:
        model = AutoModelForCausalLM.from_pretrained(spec.source, dtype=dtype, attn_implementation="eager",
                                                     device_map=torch.device(device))
        tokenizer = AutoTokenizer.from_pretrained(spec.source)
    except OSError as error:
        raise RuntimeError(
            f"backbone {spec.name} ({spec.source}) is neither in the Hugging Face cache nor reachable "
            f"({type(error).__name__}); fetch it with `make data` (network + accepted Gemma licence) "
            "or use the embedded backbone=smollm2-135m") from None
    return model, tokenizer


def load_backbone(cfg_backbone: Any, device: str | torch.device) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The frozen base model for ``cfg_backbone`` on ``device`` (eager attention, ``use_cache=False``, no vision
    side) and its tokenizer, with a pad token."""
    spec = backbone_spec(_field(cfg_backbone, "name"))
    dtype = _field(cfg_backbone, "dtype", "float32")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown backbone.dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    dtype = _DTYPES[dtype]
    if spec.kind == "tiny":
        tokenizer = byte_tokenizer()
        model = _tiny_model(spec.source, vocab_size=len(tokenizer)).to(dtype)
        model.set_attn_implementation("eager")
    elif spec.kind == "embedded":
        checkpoint = embedded_checkpoint(spec)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="eager")
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    elif spec.kind == "random":
        model, tokenizer = random_model(spec.source, dtype, device), byte_tokenizer()
    elif spec.kind == "local":
        from prism.models.local import load_local

        model, tokenizer = load_local(_field(cfg_backbone, "path"), dtype)
    else:
        model, tokenizer = _load_hub(spec, dtype, device)
    drop_non_language_modules(model)
    model.config.use_cache = False
    model.requires_grad_(False)
    model.eval()
    return model.to(device), ensure_pad_token(tokenizer)


BackboneLoader = Callable[[Any, "str | torch.device"], tuple[PreTrainedModel, PreTrainedTokenizerFast]]


class KeptBackbones:
    """A :data:`BackboneLoader` that loads each backbone once per process and hands out deep copies: a worker
    that runs grid cells one after another pays the load once, and every run starts from the frozen weights."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, str], tuple[PreTrainedModel, PreTrainedTokenizerFast]] = {}

    def __call__(self, cfg_backbone: Any, device: str | torch.device) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
        fields = cfg_backbone.items() if isinstance(cfg_backbone, Mapping) else vars(cfg_backbone).items()
        key = (repr(sorted((str(k), repr(v)) for k, v in fields)), str(torch.device(device)))
        if key not in self._kept:
            self._kept[key] = load_backbone(cfg_backbone, device)
        model, tokenizer = self._kept[key]
        return copy.deepcopy(model), copy.deepcopy(tokenizer)


def random_model(config_file: str, dtype: torch.dtype, device: str | torch.device) -> PreTrainedModel:
    """A randomly initialised model of the architecture in ``conf/gpu_check/<config_file>`` (a Hugging
    Face ``config.json``), built directly on ``device`` in ``dtype`` with a fixed seed (RNG restored)."""
    path = RANDOM_CONFIGS / config_file
    config = AutoConfig.for_model(**json.loads(path.read_text()))
    cuda = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        torch.manual_seed(_RANDOM_SEED)
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")


def drop_non_language_modules(model: nn.Module) -> list[str]:
    """Remove a multimodal checkpoint's vision tower and projector (SigLIP, ≈0.4B parameters at paper
    scale): training and evaluation feed text only, so they would sit unused on the accelerator. The
    language model keeps its module names, so LoRA targets and exported adapters are unchanged; any
    attempt to encode an image fails loudly. Returns the removed module names."""
    dropped = [name for name, _ in model.named_modules()
               if re.fullmatch(NON_LANGUAGE_MODULES, name) and not re.fullmatch(NON_LANGUAGE_MODULES, name.rsplit(".", 1)[0])]
    for name in dropped:
        parent, _, child = name.rpartition(".")
        del model.get_submodule(parent)._modules[child]
    return dropped


def peak_memory_mb(device: str | torch.device) -> float:
    """Peak memory in MiB: CUDA ``max_memory_allocated`` on a CUDA device, else the process's RSS
    high-water mark (``getrusage``; Linux reports KiB)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
