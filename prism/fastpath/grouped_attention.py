"""HF's eager attention without copying the keys and values once per query head (evaluation only).

With grouped-query attention (SmolLM2: 9 query heads share 3 key/value heads) HF's eager attention
repeats every cached key and value ``n_rep`` times (``repeat_kv``), a copy of the whole KV cache per layer
and new token that costs more than the attention itself. :func:`grouped_eager_attention` stacks the query
heads of a group against their one key/value head instead: the same products and sums, the same greedy
tokens (``tests/test_evaluate.py``). :func:`grouped_eager` switches a model to it for a block (generation).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

NAME = "prism_grouped_eager"
MODEL_TYPES = ("llama",)
"""Models whose eager attention is exactly this arithmetic (Gemma's adds logit soft-capping)."""


def grouped_eager_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                            attention_mask: Tensor | None, scaling: float, dropout: float = 0.0,
                            **kwargs: Any) -> tuple[Tensor, Tensor]:
    """HF eager attention (scores · scaling + additive mask, float32 softmax, weighted values) of
    ``query`` ``[k, heads, q, d]`` against ``key``/``value`` ``[k, kv_heads, T, d]``; returns the
    output ``[k, q, heads, d]`` and the weights ``[k, heads, q, T]``."""
    k, heads, q_len, dim = query.shape
    groups = key.shape[1]
    stacked = query.reshape(k, groups, (heads // groups) * q_len, dim)
    scores = torch.matmul(stacked, key.transpose(2, 3)).view(k, heads, q_len, -1) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights.view(k, groups, -1, weights.shape[-1]), value)
    return output.view(k, heads, q_len, dim).transpose(1, 2).contiguous(), weights


AttentionInterface.register(NAME, grouped_eager_attention)
AttentionMaskInterface.register(NAME, eager_mask)


@contextmanager
def grouped_eager(model: nn.Module) -> Iterator[None]:
    """While active, a :data:`MODEL_TYPES` model configured with ``eager`` attention uses
    :func:`grouped_eager_attention` (other models and implementations are left alone); restored on exit."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in MODEL_TYPES or config._attn_implementation != "eager":
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = "eager"
