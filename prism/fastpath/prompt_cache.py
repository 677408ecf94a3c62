"""The frozen lower layers' KV cache of evaluation prompts, computed once and shared by every run.

With LoRA on the last ``K`` decoder layers the layers below ``d = L − K`` are frozen
(:func:`prism.fastpath.prefix.prefix_depth`), so their keys and values for a fixed evaluation prompt, and
the hidden state entering layer ``d``, are the same in every run that shares the backbone.
:class:`FrozenPrompts` stores them under ``$PRISM_CACHE/prompts/<key>/`` (the key of
:func:`prism.fastpath.prefix.prefix_key`) and assembles, for a left-padded generation batch, the KV cache
of all but each prompt's last token: layers ``< d`` from the store, layers ``≥ d`` from the trained top
layers run on the stored states (the last one keys and values only). A prefill then costs ``K`` layers
instead of ``L``; greedy tokens equal those of plain ``generate`` up to float rounding
(``tests/test_evaluate.py``). A store whose content no longer matches the sha256 in its ``meta.json`` is
rebuilt, and the log says so.
"""
from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn
from transformers import DynamicCache

from prism.fastpath import top_layer
from prism.fastpath.prefix import (
    _decoder,
    _top_layers_only,
    compute_prefix_states,
    prefix_depth,
    prefix_key,
    stored_tensors,
)
from prism.models import cache_root

FORMAT = 2  # 2: meta.json records the tensors' sha256 (1 recorded only their byte count)
_TENSORS = "prompts.safetensors"
log = logging.getLogger(__name__)


class FrozenPrompts:
    """Stored frozen-layer KV and states of a fixed list of prompts (token rows of ≥ 2 tokens)."""

    def __init__(self, decoder: nn.Module, depth: int, path: Path, lengths: list[int],
                 build_seconds: float = 0.0) -> None:
        self.decoder, self.depth, self.path, self.lengths = decoder, depth, path, lengths
        self.offsets = [0, *itertools.accumulate(lengths)]
        self.build_seconds = build_seconds

    @classmethod
    def build(cls, model: nn.Module, rows: Sequence[Sequence[int]], cache_dir: str | os.PathLike[str] | None = None,
              micro_batch_size: int = 16) -> FrozenPrompts | None:
        """Load (or compute once, under a file lock, and store) the frozen part of ``rows``; ``None`` when
        the model has no exact frozen prefix or a row has fewer than two tokens."""
        depth = prefix_depth(model)
        if depth is None or min((len(r) for r in rows), default=0) < 2:
            return None
        key = prefix_key(model, depth, rows, "prompts")
        root = (Path(cache_dir) if cache_dir is not None else cache_root() / "prompts")
        lengths = [len(r) - 1 for r in rows]

        def compute() -> dict[str, Tensor]:
            # per row (prompt minus its last token): the kv of layers < depth and the states entering layer depth
            kv, states = compute_prefix_states(model, depth, [list(r[:-1]) for r in rows], micro_batch_size,
                                               with_kv=True)
            return {"kv": torch.cat(kv, dim=3).contiguous(), "states": torch.cat(states).contiguous(),
                    "lengths": torch.tensor(lengths, dtype=torch.long)}

        header = {"format": FORMAT, "key": key, "rows": len(rows)}
        rebuilding = functools.partial(log.warning, "prompt cache %s: %s; rebuilding it")
        path, _, seconds = stored_tensors(root, _TENSORS, header, "prompts", lengths, compute, rebuilding)
        return cls(_decoder(model), depth, path, lengths, build_seconds=seconds)

    @torch.no_grad()
    def generate_inputs(self, indices: Sequence[int], input_ids: Tensor, attention_mask: Tensor) -> dict[str, Any]:
        """``generate`` inputs for the left-padded batch of prompts ``indices`` (``input_ids`` /
        ``attention_mask`` ``[B, T]``): the same tensors plus the KV cache of their first ``T − 1``
        columns, layers ``< d`` from the store and layers ``≥ d`` from the current top layers."""
        device = input_ids.device
        width = input_ids.shape[1] - 1
        first, config = next(iter(self.decoder.parameters())), self.decoder.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv = first.new_zeros(self.depth, 2, len(indices), config.num_key_value_heads, width, head_dim)
        embeds = first.new_zeros(len(indices), width, config.hidden_size)
        with safe_open(str(self.path), framework="pt") as fh:
            kv_all, states_all = fh.get_slice("kv"), fh.get_slice("states")
            for b, i in enumerate(indices):
                a, z, n = self.offsets[i], self.offsets[i + 1], self.lengths[i]
                kv[:, :, b, :, width - n:] = kv_all[:, :, :, a:z, :].to(device=device, dtype=kv.dtype)
                embeds[b, width - n:] = states_all[a:z].to(device=device, dtype=embeds.dtype)
        mask = attention_mask[:, :width]
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        cache = DynamicCache(config=self.decoder.config)
        last_kv_only = top_layer.keys_values_only(self.decoder) if top_layer.supported(self.decoder) else nullcontext()
        with _top_layers_only(self.decoder, self.depth), last_kv_only:
            self.decoder(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        for layer in range(self.depth):
            cache.update(kv[layer, 0].contiguous(), kv[layer, 1].contiguous(), layer)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "cache": cache}
