"""The last decoder layer computed only where its output is read (Llama decoder layers).

In the last decoder layer every position's output feeds only the final norm and the LM head at that
position, so a forward that reads a few positions needs the keys and values of every position but the
query, attention, output projection and MLP only at the read positions. Two uses: :func:`read_positions`,
training from cached frozen-prefix states (:mod:`prism.fastpath.prefix`: the loss reads ~2–5 supervised
positions of ~100 tokens, and the LM head then runs on those alone), and :func:`keys_values_only`, the
prompt prefill of :class:`prism.fastpath.prompt_cache.FrozenPrompts` (only the keys and values).

Every LoRA module of the layer is still called once per forward (Opacus' per-example hooks see it), and
the arithmetic is the layer's own (RMSNorm, rotary embedding, HF eager attention's softmax in at least
float32, MLP): outputs equal the full layer's at the read positions up to float rounding
(``tests/test_top_layer.py``). Other layer classes keep the full forward (:func:`supported` is false).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import repeat_kv, rotate_half

SUPPORTED_LAYERS = ("LlamaDecoderLayer",)


def supported(decoder: nn.Module) -> bool:
    """Whether the decoder's last layer is a Llama layer without attention dropout or activation
    checkpointing (the forms whose arithmetic :class:`_ReadPositions` reproduces)."""
    layer = decoder.layers[-1]
    return (type(layer).__name__ in SUPPORTED_LAYERS and not getattr(layer, "gradient_checkpointing", False)
            and not getattr(decoder.config, "attention_dropout", 0.0))


def _rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF Llama's rotary embedding of ``x`` ``[k, heads, n, head_dim]`` with ``cos``/``sin`` ``[k, n, head_dim]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


def _heads(x: Tensor, head_dim: int) -> Tensor:
    """``[k, n, heads·head_dim]`` → ``[k, heads, n, head_dim]``."""
    return x.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def _keys_values(layer: nn.Module, normed: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    attn = layer.self_attn
    keys = _rotary(_heads(attn.k_proj(normed), attn.head_dim), cos, sin)
    return keys, _heads(attn.v_proj(normed), attn.head_dim)


class _ReadPositions(nn.Module):
    """Stands in for the last decoder layer: its output at ``positions`` ``[k, P]`` of a right- or
    left-padded batch whose real tokens are ``mask`` ``[k, T]`` (causal attention over them)."""

    def __init__(self, layer: nn.Module, positions: Tensor, mask: Tensor, keep: Tensor | None) -> None:
        super().__init__()
        self.layer, self.positions, self.mask, self.keep = layer, positions, mask, keep

    def forward(self, hidden_states: Tensor, *args: Any, position_embeddings: tuple[Tensor, Tensor],
                **kwargs: Any) -> Tensor:
        layer, attn, pos = self.layer, self.layer.self_attn, self.positions
        k, length, width = hidden_states.shape
        cos, sin = (t.expand(k, -1, -1) for t in position_embeddings)
        normed = layer.input_layernorm(hidden_states)
        keys, values = _keys_values(layer, normed, cos, sin)
        rows = pos.unsqueeze(-1)
        query = _heads(attn.q_proj(normed.gather(1, rows.expand(-1, -1, width))), attn.head_dim)
        query = _rotary(query, cos.gather(1, rows.expand(-1, -1, cos.shape[-1])),
                        sin.gather(1, rows.expand(-1, -1, sin.shape[-1])))
        keys, values = repeat_kv(keys, attn.num_key_value_groups), repeat_kv(values, attn.num_key_value_groups)
        scores = torch.matmul(query, keys.transpose(2, 3)) * attn.scaling  # [k, heads, P, T]
        allowed = (torch.arange(length, device=pos.device) <= rows) & (self.mask.unsqueeze(1) != 0)
        scores = scores.masked_fill(~allowed.unsqueeze(1), torch.finfo(scores.dtype).min)
        weights = nn.functional.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        weights = weights.to(query.dtype)
        context = torch.matmul(weights, values).transpose(1, 2).reshape(k, pos.shape[1], -1)
        hidden = hidden_states.gather(1, rows.expand(-1, -1, width)) + attn.o_proj(context)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden if self.keep is None else hidden[self.keep].unsqueeze(0)


class _KeysValuesOnly(nn.Module):
    """Stands in for the last decoder layer in a prefill: writes its keys and values to the cache and
    returns its input (which nothing reads)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states: Tensor, *args: Any, position_embeddings: tuple[Tensor, Tensor],
                cache: Any = None, **kwargs: Any) -> Tensor:
        k = hidden_states.shape[0]
        cos, sin = (t.expand(k, -1, -1) for t in position_embeddings)
        keys, values = _keys_values(self.layer, self.layer.input_layernorm(hidden_states), cos, sin)
        cache.update(keys, values, self.layer.self_attn.layer_idx)
        return hidden_states


@contextmanager
def swapped_layers(decoder: nn.Module, layers: list[nn.Module]) -> Iterator[None]:
    """While active, the decoder runs ``layers`` instead of its own (restored on exit)."""
    own = decoder.layers
    decoder.layers = nn.ModuleList(layers)
    try:
        yield
    finally:
        decoder.layers = own


@contextmanager
def read_positions(decoder: nn.Module, positions: Tensor, mask: Tensor, keep: Tensor | None = None) -> Iterator[None]:
    """While active, the decoder returns its final-normed hidden states at ``positions`` ``[k, P]``
    only (``[k, P, hidden]``), or with ``keep`` ``[k, P]`` (bool) the kept entries alone, row by row,
    as ``[1, n_kept, hidden]``; ``mask`` ``[k, T]`` marks the real tokens. Requires :func:`supported`."""
    with swapped_layers(decoder, [*decoder.layers[:-1], _ReadPositions(decoder.layers[-1], positions, mask, keep)]):
        yield


@contextmanager
def keys_values_only(decoder: nn.Module) -> Iterator[None]:
    """While active, the decoder's last layer only fills the KV cache. Requires :func:`supported`."""
    with swapped_layers(decoder, [*decoder.layers[:-1], _KeysValuesOnly(decoder.layers[-1])]):
        yield
