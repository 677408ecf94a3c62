"""The frozen lower layers' KV cache of evaluation prompts, computed once and shared by every run.

Evaluation prompts are fixed per suite, and with LoRA on the last ``K`` decoder layers the layers
below ``d = L − K`` are frozen (:func:`prism.fastpath.prefix.prefix_depth`), so their keys and values for a
prompt, and the hidden state entering layer ``d``, are the same in every run that shares the
backbone. :class:`FrozenPrompts` stores them under ``$PRISM_CACHE/prompts/<key>/`` (the key of
:func:`prism.fastpath.prefix.prefix_key` over the prompts' token ids). For a left-padded generation batch it
assembles the KV cache of all but each prompt's last token: layers ``< d`` from the store, layers
``≥ d`` by running only the trained top layers on the stored states; ``generate`` then feeds the
last prompt token through the whole model and decodes as usual. Greedy tokens equal those of the
plain batched ``generate`` up to float rounding (``tests/test_evaluate.py``). A prompt's prefill
then costs ``K`` layers instead of ``L`` (the last of them only its keys and values,
:func:`prism.fastpath.top_layer.keys_values_only`: nothing reads its output there); decoding is unchanged.
``meta.json`` records the sha256 of the stored tensors; a store whose content no longer matches it
(bytes changed on disk, even at the same size) is rebuilt, and the log says so.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers import DynamicCache

from prism.fastpath import top_layer
from prism.fastpath.prefix import (
    _common_length,
    _decoder,
    _pad,
    _top_layers_only,
    layer_input_capture,
    prefix_depth,
    prefix_key,
    shared_prefix_groups,
)
from prism.fileio import atomic_write, sha256_file, write_text_atomic
from prism.models import cache_root

FORMAT = 2  # 2: meta.json records the tensors' sha256 (1 recorded only their byte count)
_TENSORS, _META = "prompts.safetensors", "meta.json"
log = logging.getLogger(__name__)


@torch.no_grad()
def compute_frozen_prompts(decoder: nn.Module, depth: int, rows: Sequence[Sequence[int]],
                           micro_batch_size: int = 16) -> tuple[list[Tensor], list[Tensor]]:
    """Per row (prompt minus its last token, ``n = len − 1 ≥ 1``): keys and values of layers ``< depth``
    ``[depth, 2, kv_heads, n, head_dim]`` and the hidden states entering layer ``depth`` ``[n, hidden]``.
    Rows sharing leading tokens run them once through the cache (as in
    :func:`prism.fastpath.prefix.compute_prefix_states`); the model's own forward, stopped at ``depth``."""
    device = decoder.embed_tokens.weight.device
    heads = [list(row[:-1]) for row in rows]
    kv: list[Tensor | None] = [None] * len(rows)
    states: list[Tensor | None] = [None] * len(rows)
    with layer_input_capture(decoder, depth) as run:
        for _, members in shared_prefix_groups(heads, min_group=micro_batch_size):
            order = sorted(members, key=lambda i: len(heads[i]))
            for start in range(0, len(order), micro_batch_size):
                chunk = order[start:start + micro_batch_size]
                chunk_rows = [heads[i] for i in chunk]
                shared = _common_length(chunk_rows)
                cache = DynamicCache()  # full layers: every key kept, sliding windows come from the mask
                head_states = None
                if shared > 0:
                    head_ids = torch.tensor([chunk_rows[0][:shared]], dtype=torch.long, device=device)
                    head_states = run(head_ids, torch.ones_like(head_ids), cache)[0]
                    cache.batch_repeat_interleave(len(chunk))
                ids = _pad([r[shared:] for r in chunk_rows], 0, device)
                mask = torch.cat([torch.ones(len(chunk), shared, dtype=torch.long, device=device),
                                  _pad([[1] * (len(r) - shared) for r in chunk_rows], 0, device)], 1)
                hidden = run(ids, mask, cache)
                for b, i in enumerate(chunk):
                    n = len(heads[i])
                    tail = hidden[b, :n - shared]
                    states[i] = (torch.cat([head_states, tail]) if head_states is not None else tail).cpu().clone()
                    kv[i] = torch.stack([torch.stack([cache.layers[layer].keys[b, :, :n],
                                                      cache.layers[layer].values[b, :, :n]])
                                         for layer in range(depth)]).cpu().clone()
    return [t for t in kv if t is not None], [t for t in states if t is not None]


class FrozenPrompts:
    """Stored frozen-layer KV and states of a fixed list of prompts (token rows of ≥ 2 tokens)."""

    def __init__(self, decoder: nn.Module, depth: int, path: Path, lengths: list[int],
                 build_seconds: float = 0.0) -> None:
        self.decoder, self.depth, self.path, self.lengths = decoder, depth, path, lengths
        self.offsets = [0]
        for n in lengths:
            self.offsets.append(self.offsets[-1] + n)
        self.build_seconds = build_seconds

    @classmethod
    def build(cls, model: nn.Module, rows: Sequence[Sequence[int]], cache_dir: str | os.PathLike[str] | None = None,
              micro_batch_size: int = 16) -> FrozenPrompts | None:
        """Load (or compute once, under a file lock, and store) the frozen part of ``rows``; ``None`` when
        the model has no exact frozen prefix or a row has fewer than two tokens."""
        depth = prefix_depth(model)
        if depth is None or min((len(r) for r in rows), default=0) < 2:
            return None
        decoder = _decoder(model)
        key = prefix_key(model, depth, rows, "prompts")
        root = (Path(cache_dir) if cache_dir is not None else cache_root() / "prompts")
        root.mkdir(parents=True, exist_ok=True)
        directory = root / key
        lengths = [len(r) - 1 for r in rows]
        seconds = 0.0
        with FileLock(str(root / f"{key}.lock")):
            if (why := _invalid(directory, key, lengths)) is not None:
                if why != "absent":
                    log.warning("prompt cache %s: %s; rebuilding it", directory, why)
                tic = time.perf_counter()
                kv, states = compute_frozen_prompts(decoder, depth, rows, micro_batch_size)
                seconds = time.perf_counter() - tic
                directory.mkdir(parents=True, exist_ok=True)
                tensors = {"kv": torch.cat(kv, dim=3).contiguous(), "states": torch.cat(states).contiguous(),
                           "lengths": torch.tensor(lengths, dtype=torch.long)}
                atomic_write(directory / _TENSORS, lambda tmp: save_file(tensors, str(tmp)))
                meta = {"format": FORMAT, "key": key, "rows": len(rows), "sha256": sha256_file(directory / _TENSORS)}
                write_text_atomic(directory / _META, json.dumps(meta, indent=2))
        return cls(decoder, depth, directory / _TENSORS, lengths, build_seconds=seconds)

    @torch.no_grad()
    def generate_inputs(self, indices: Sequence[int], input_ids: Tensor, attention_mask: Tensor) -> dict[str, Any]:
        """``generate`` inputs for the left-padded batch of prompts ``indices`` (``input_ids`` /
        ``attention_mask`` ``[B, T]``): the same tensors plus the KV cache of their first ``T − 1``
        columns, layers ``< d`` from the store and layers ``≥ d`` from the current top layers."""
        device = input_ids.device
        width = input_ids.shape[1] - 1
        first = next(iter(self.decoder.parameters()))
        kv = first.new_zeros(self.depth, 2, len(indices), self._kv_shape()[0], width, self._kv_shape()[1])
        embeds = first.new_zeros(len(indices), width, self.decoder.config.hidden_size)
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

    def _kv_shape(self) -> tuple[int, int]:
        config = self.decoder.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return config.num_key_value_heads, head_dim


def _invalid(directory: Path, key: str, lengths: list[int]) -> str | None:
    """Why the stored prompts cannot be used (None: they can): absent, for other prompts, or with
    content that is not the sha256 recorded when they were built (e.g. bytes changed on disk)."""
    try:
        meta = json.loads((directory / _META).read_text())
    except FileNotFoundError:
        return "absent"
    except (OSError, ValueError) as err:
        return f"unreadable meta.json ({type(err).__name__})"
    if not isinstance(meta, dict) or (meta.get("format"), meta.get("key"), meta.get("rows")) != (FORMAT, key, len(lengths)):
        return "built for other prompts or an older format"
    try:
        if sha256_file(directory / _TENSORS) != meta.get("sha256"):
            return "content does not match the sha256 recorded at build"
        with safe_open(str(directory / _TENSORS), framework="pt") as fh:
            return None if fh.get_tensor("lengths").tolist() == lengths else "row lengths differ"
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        return f"unreadable tensors ({type(err).__name__})"
