"""An exact, cached frozen prefix: train the top LoRA layers from stored hidden states.

With LoRA on the last ``K`` of ``L`` decoder layers (``backbone.lora_layers``), the embedding and the first
``d = L − K`` decoder layers are frozen and deterministic, so the hidden state entering layer ``d`` is the
same for a training example in every step and every run that shares the backbone and the data (PRISM's
spectral init only rewrites LoRA layers' base weights, all at depth ``≥ d``). :class:`PrefixCache`
computes these states once per example, persists them under ``$PRISM_CACHE/prefix/<key>/`` and replays
micro-batches through the top ``K`` layers only, the lower ones swapped for pass-throughs, so the model's
own code computes masks, rotary embeddings and per-layer attention types at their true layer indices; in
the last (Llama) layer only the keys and values run over every token (:mod:`prism.fastpath.top_layer`).

Exactness (``tests/test_prefix.py``): logits, per-example losses and per-example LoRA gradients equal
those of the full forward up to float rounding. :func:`prefix_depth` returns ``None`` wherever that is
not established, and the loop then runs the full forward.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from filelock import FileLock
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import DynamicCache

from prism.backbones import cache_root
from prism.fastpath import top_layer
from prism.fastpath.transfer import batch_to_device
from prism.fileio import atomic_write, sha256_file, write_text_atomic
from prism.privacy.per_example import (
    IGNORE_INDEX,
    LossFn,
    Positions,
    kept_token_loss,
    mean_token_loss,
    supervised_positions,
)

FORMAT = 1
"""Bump when the stored layout or the key changes."""

SUPPORTED = {"LlamaForCausalLM": "LlamaModel", "Gemma3ForCausalLM": "Gemma3TextModel",
             "Gemma2ForCausalLM": "Gemma2Model"}
"""Causal-LM class → decoder class whose forward was checked to replay exactly from ``inputs_embeds``
(transformers 5.24): the embedding (Gemma's √hidden scaling included) happens before the first
layer, the loop feeds each layer its mask / rotary embedding by its index in ``config.layer_types``."""

MODES = ("auto", "off")
_STATES, _META = "states.safetensors", "meta.json"


# ------------------------------------------------------------------------------------------ depth
def _unwrap(model: nn.Module) -> nn.Module:
    """The Hugging Face causal LM inside an Opacus ``GradSampleModule`` and/or a peft model."""
    while True:
        if hasattr(model, "_module"):  # Opacus
            model = model._module
        elif hasattr(model, "get_base_model"):  # peft
            model = model.get_base_model()
        else:
            return model


def _decoder(model: nn.Module) -> nn.Module | None:
    base = _unwrap(model)
    decoder = getattr(base, "model", None)
    if SUPPORTED.get(type(base).__name__) != type(decoder).__name__:
        return None
    return decoder if isinstance(getattr(decoder, "layers", None), nn.ModuleList) else None


def _supported_decoder(model: nn.Module) -> nn.Module:
    """:func:`_decoder`, or a ``ValueError`` when the model has none."""
    decoder = _decoder(model)
    if decoder is None:
        raise ValueError(f"{type(_unwrap(model)).__name__} has no supported decoder; check prefix_depth first")
    return decoder


def prefix_depth(model: nn.Module) -> int | None:
    """``d``: the first decoder layer holding a trainable parameter (``L − K`` with LoRA on the last ``K``), or
    ``None`` where a cached prefix would not be exact or is not supported: an unverified architecture, nothing
    trainable, a trainable parameter in layer 0 or outside the decoder layers below the final norm, dropout
    below ``d``, or Gemma's bidirectional-attention variant."""
    decoder = _decoder(model)
    if decoder is None:
        return None
    config = decoder.config
    if getattr(config, "use_bidirectional_attention", False) or getattr(config, "attention_dropout", 0.0):
        return None
    trainable = [name for name, p in decoder.named_parameters() if p.requires_grad]
    layer_of = [re.match(r"layers\.(\d+)\.", name) for name in trainable]
    if any(match is None and not name.startswith("norm.") for name, match in zip(trainable, layer_of)):
        return None
    trainable_layers = [int(match.group(1)) for match in layer_of if match is not None]
    if not trainable_layers:
        return None
    depth = min(trainable_layers)
    lower = [decoder.embed_tokens, *decoder.layers[:depth]]
    if depth == 0 or any(isinstance(m, nn.Dropout) and m.p > 0 for module in lower for m in module.modules()):
        return None
    return depth


# ------------------------------------------------------------------------------------------ key
def prefix_key(model: nn.Module, depth: int, input_ids: Sequence[Sequence[int]], name: str = "") -> str:
    """sha256 of everything the cached states depend on: the backbone name and config (attention
    implementation included), the bytes of every frozen-prefix parameter and buffer (embedding,
    layers ``< depth``, rotary tables), the depth, dtype, device type, library versions and the
    token ids of every example (labels are not part of it: states do not depend on them)."""
    decoder = _supported_decoder(model)
    digest = hashlib.sha256()
    header = {"format": FORMAT, "name": name, "class": type(decoder).__name__, "depth": depth,
              "config": decoder.config.to_json_string(use_diff=False),
              "attn": decoder.config._attn_implementation, "dtype": str(decoder.embed_tokens.weight.dtype),
              "device": decoder.embed_tokens.weight.device.type, "torch": torch.__version__,
              "transformers": transformers.__version__}
    digest.update(json.dumps(header, sort_keys=True).encode())
    prefix = re.compile(rf"(embed_tokens|rotary_emb|layers\.({'|'.join(map(str, range(depth)))}))\.")
    for tensors in (decoder.named_parameters(), decoder.named_buffers()):
        for tensor_name, tensor in sorted(tensors):
            if prefix.match(tensor_name):
                digest.update(f"{tensor_name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
                digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    digest.update(json.dumps([list(map(int, ids)) for ids in input_ids]).encode())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------ compute
class _PrefixCapturedError(Exception):
    """Raised by the capture hook: nothing above the prefix needs computing."""


class _PassThrough(nn.Module):
    """Stands in for a frozen lower decoder layer while replaying from cached states."""

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return hidden_states


@contextmanager
def _top_layers_only(decoder: nn.Module, depth: int) -> Iterator[None]:
    """Swap layers ``< depth`` for pass-throughs (indices of the others unchanged); restore on exit."""
    with top_layer.swapped_layers(decoder, [_PassThrough()] * depth + list(decoder.layers[depth:])):
        yield


@contextmanager
def layer_input_capture(decoder: nn.Module, depth: int) -> Iterator[Callable[[Tensor, Tensor, Any], Tensor]]:
    """A function ``run(ids, mask, cache)`` that runs the decoder's own forward (eval mode, restored on
    exit) and stops it at the input of layer ``depth``, returning the hidden states entering that layer
    (on the decoder's device); ``cache`` (a ``DynamicCache`` or ``None``) collects the lower layers' KV."""
    captured: list[Tensor] = []

    def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured.append(args[0] if args else kwargs["hidden_states"])
        raise _PrefixCapturedError

    def run(ids: Tensor, mask: Tensor, cache: Any = None) -> Tensor:
        captured.clear()
        with suppress(_PrefixCapturedError):
            decoder(input_ids=ids, attention_mask=mask, cache=cache, use_cache=cache is not None)
        return captured[0]

    was_training = decoder.training
    handle = decoder.layers[depth].register_forward_pre_hook(capture, with_kwargs=True)
    decoder.eval()
    try:
        yield run
    finally:
        handle.remove()
        decoder.train(was_training)


def _pad(rows: Sequence[Sequence[int]], fill: int, device: torch.device) -> Tensor:
    length = max(len(row) for row in rows)
    return torch.tensor([list(row) + [fill] * (length - len(row)) for row in rows], dtype=torch.long, device=device)


def shared_prefix_groups(input_ids: Sequence[Sequence[int]], min_group: int = 64) -> list[tuple[int, list[int]]]:
    """Partition example indices into groups ``(shared, members)`` whose members all start with the same
    ``shared`` tokens (each keeping at least one token of its own): a group is split by the token
    after its common prefix into subgroups of at least ``min_group`` members (smaller ones stay
    behind), so a template and a task instruction shared by many examples become one group."""
    groups: list[tuple[int, list[int]]] = []
    pending = [list(range(len(input_ids)))] if input_ids else []
    while pending:
        members = pending.pop()
        shared = common_prefix_length([input_ids[i] for i in members])
        by_next: dict[int, list[int]] = {}
        for i in members:
            if len(input_ids[i]) > shared + 1:
                by_next.setdefault(int(input_ids[i][shared]), []).append(i)
        split = [sub for sub in by_next.values() if len(sub) >= min_group and len(sub) < len(members)]
        taken = {i for sub in split for i in sub}
        pending.extend(split)
        rest = [i for i in members if i not in taken]
        if rest:
            groups.append((shared, rest))
    return sorted(groups, key=lambda group: group[1][0])


@torch.no_grad()
def compute_prefix_states(model: nn.Module, depth: int, input_ids: Sequence[Sequence[int]],
                          micro_batch_size: int = 16,
                          with_kv: bool = False) -> list[Tensor] | tuple[list[Tensor], list[Tensor]]:
    """Per example, the hidden states ``[len_i, hidden]`` (CPU, model dtype) entering decoder layer ``depth``
    (the model's own forward in ``eval()``, stopped there); ``with_kv``: ``(kv, states)``, ``kv`` per example the
    keys and values of layers ``< depth`` ``[depth, 2, kv_heads, len_i, head_dim]``. Micro-batches are grouped
    by shared leading tokens (:func:`shared_prefix_groups`) and by length within a group: the common prefix of
    ``shared`` tokens runs once (batch 1, its KV cache then repeated per row), the remainders right-padded
    behind it at positions ``shared..len−1``, which causal attention makes each row's full forward up to float
    rounding."""
    decoder = _supported_decoder(model)
    device = decoder.embed_tokens.weight.device
    states: list[Tensor | None] = [None] * len(input_ids)
    kv: list[Tensor | None] = [None] * len(input_ids)
    with layer_input_capture(decoder, depth) as run:
        for _, members in shared_prefix_groups(input_ids, min_group=micro_batch_size):
            order = sorted(members, key=lambda i: len(input_ids[i]))
            for start in range(0, len(order), micro_batch_size):
                chunk = order[start:start + micro_batch_size]
                rows = [input_ids[i] for i in chunk]
                shared = common_prefix_length(rows)
                # with_kv: every row's KV is kept, full layers (sliding windows come from the mask); else only a
                # shared prefix's KV is reused
                cache = DynamicCache() if with_kv else (DynamicCache(config=decoder.config) if shared else None)
                head: Tensor | None = None
                if shared:
                    head_ids = torch.tensor([list(rows[0][:shared])], dtype=torch.long, device=device)
                    head = run(head_ids, torch.ones_like(head_ids), cache)[0].cpu()
                    cache.batch_repeat_interleave(len(chunk))
                hidden = run(_pad([row[shared:] for row in rows], 0, device),
                             _pad([[1] * len(row) for row in rows], 0, device), cache).cpu()
                for b, i in enumerate(chunk):
                    n = len(input_ids[i])
                    tail = hidden[b, :n - shared]
                    states[i] = torch.cat([head, tail]) if head is not None else tail.clone()
                    if with_kv:
                        kv[i] = torch.stack([torch.stack([cache.layers[layer].keys[b, :, :n],
                                                          cache.layers[layer].values[b, :, :n]])
                                             for layer in range(depth)]).cpu().clone()
    return (kv, states) if with_kv else states


def common_prefix_length(rows: Sequence[Sequence[int]]) -> int:
    """Leading tokens shared by all `rows`, leaving each at least one token of its own."""
    limit = min((len(row) for row in rows), default=1) - 1
    shared = 0
    while shared < limit and all(row[shared] == rows[0][shared] for row in rows[1:]):
        shared += 1
    return shared


# ------------------------------------------------------------------------------------------ storage
def store_problem(directory: Path, name: str, header: dict[str, Any], inputs: str, lengths: list[int]) -> str | None:
    """Why the store of :func:`stored_tensors` in ``directory`` cannot be used (None: it can): absent, built for
    other ``inputs`` or an older format (``header`` differs), content unlike the sha256 recorded at build, or
    other row ``lengths``."""
    try:
        meta = json.loads((directory / _META).read_text())
    except FileNotFoundError:
        return "absent"
    except (OSError, ValueError) as err:
        return f"unreadable meta.json ({type(err).__name__})"
    if not isinstance(meta, dict) or any(meta.get(field) != value for field, value in header.items()):
        return f"built for other {inputs} or an older format"
    try:
        if sha256_file(directory / name) != meta.get("sha256"):
            return "content does not match the sha256 recorded at build"
        with safe_open(str(directory / name), framework="pt") as fh:
            return None if fh.get_tensor("lengths").tolist() == lengths else "row lengths differ"
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        return f"unreadable tensors ({type(err).__name__})"


def stored_tensors(root: Path, name: str, header: dict[str, Any], inputs: str, lengths: list[int],
                   compute: Callable[[], dict[str, Tensor]], rebuilding: Callable[[Path, str], Any] | None = None
                   ) -> tuple[Path, dict[str, Tensor] | None, float]:
    """The safetensors file ``root/<header["key"]>/name`` (its ``lengths`` tensor: ``lengths``), (re)built, once
    under a file lock per key, from ``compute()`` when :func:`store_problem` finds it unusable (a present but
    unusable one is first reported to ``rebuilding(directory, why)``): the tensors go to ``name`` first, then
    ``meta.json``, ``header`` and that file's sha256 (the commit marker). Returns the file, the computed tensors
    (None on a hit) and the seconds spent computing (0 on a hit)."""
    root.mkdir(parents=True, exist_ok=True)
    directory = root / header["key"]
    with FileLock(str(root / f"{header['key']}.lock")):
        why = store_problem(directory, name, header, inputs, lengths)
        if why is None:
            return directory / name, None, 0.0
        if rebuilding is not None and why != "absent":
            rebuilding(directory, why)
        tic = time.perf_counter()
        tensors = compute()
        seconds = time.perf_counter() - tic
        atomic_write(directory / name, lambda tmp: save_file(tensors, str(tmp)))
        write_text_atomic(directory / _META, json.dumps({**header, "sha256": sha256_file(directory / name)}, indent=2))
    return directory / name, tensors, seconds


# ------------------------------------------------------------------------------------------ cache
@dataclass
class PrefixBatch:
    """A :data:`prism.privacy.per_example.LossFn` replaying one right-padded micro-batch from cached
    states: zero states on padding (masked out, so they never reach a real position)."""

    decoder: nn.Module
    depth: int
    inputs_embeds: Tensor
    attention_mask: Tensor
    labels: Tensor
    positions: Positions | None = None
    read_only_supervised: bool = True  # last layer at the supervised positions only (prism/fastpath/top_layer.py)

    def __call__(self, model: nn.Module) -> Tensor:
        return self.losses(model, training=True)

    def losses(self, model: nn.Module, training: bool = True) -> Tensor:
        """Per-example losses ``ℓ_i`` ``[k]`` of the micro-batch with the model in ``train()`` mode
        (the training loss; dropout as configured) or ``eval()`` mode (a held-out loss)."""
        if _decoder(model) is not self.decoder:
            raise ValueError("this prefix batch belongs to another model; build the PrefixCache from the trained model")
        length = self.inputs_embeds.shape[1]
        position_ids = torch.arange(length, device=self.inputs_embeds.device).unsqueeze(0)
        positions, targets = (self.positions if self.positions is not None
                              else supervised_positions(self.labels, self.attention_mask))
        inputs = {"inputs_embeds": self.inputs_embeds, "attention_mask": self.attention_mask,
                  "position_ids": position_ids, "use_cache": False}
        model.train(training)
        with _top_layers_only(self.decoder, self.depth):
            if self.read_only_supervised and top_layer.supported(self.decoder):
                keep = targets != IGNORE_INDEX
                with top_layer.read_positions(self.decoder, positions, self.attention_mask, keep):
                    return kept_token_loss(model(**inputs).logits[0], targets, keep)
            return mean_token_loss(model(**inputs, logits_to_keep=positions).logits, targets)


class PrefixCache:
    """Frozen-prefix hidden states of every training example, and micro-batches replayed from them."""

    def __init__(self, model: nn.Module, depth: int, states: list[Tensor], labels: Sequence[Sequence[int]],
                 build_seconds: float = 0.0) -> None:
        decoder = _supported_decoder(model)
        if len(states) != len(labels):
            raise ValueError(f"{len(states)} cached examples but {len(labels)} label rows")
        self.decoder, self.depth, self.states, self.labels = decoder, depth, states, labels
        self.device = decoder.embed_tokens.weight.device
        self.build_seconds = build_seconds

    @classmethod
    def build(cls, model: nn.Module, features: Sequence[dict], cache_dir: str | os.PathLike[str] | None = None,
              name: str = "", micro_batch_size: int = 16) -> PrefixCache:
        """Load the states for ``features`` (``{input_ids, labels}``) from ``cache_dir`` (default
        ``$PRISM_CACHE/prefix``), computing and storing them first, once under a file lock per key, when absent
        or invalid; ``build_seconds``: the time spent computing (0 on a cache hit)."""
        depth = prefix_depth(model)
        if depth is None:
            raise ValueError("this model has no exact frozen prefix (prefix_depth is None); "
                             "use the full forward (train.prefix_cache=off)")
        input_ids = [f["input_ids"] for f in features]
        lengths = [len(ids) for ids in input_ids]
        if min(lengths, default=0) < 1:
            raise ValueError("every training example needs at least one token; check the tokenised features")
        key = prefix_key(model, depth, input_ids, name)
        root = Path(cache_dir) if cache_dir is not None else cache_root() / "prefix"

        def compute() -> dict[str, Tensor]:
            states = compute_prefix_states(model, depth, input_ids, micro_batch_size)
            return {"states": torch.cat(states).contiguous(), "lengths": torch.tensor(lengths, dtype=torch.long)}

        header = {"format": FORMAT, "key": key, "examples": len(lengths)}
        path, tensors, seconds = stored_tensors(root, _STATES, header, "examples", lengths, compute)
        states = list((tensors or load_file(str(path)))["states"].split(lengths))
        labels = [f.get("labels", f["input_ids"]) for f in features]
        return cls(model, depth, states, labels, build_seconds=seconds)

    def batch(self, indices: Sequence[int]) -> dict[str, LossFn]:
        """``{"loss_fn": PrefixBatch}`` for the examples ``indices``, right-padded to their longest, assembled on
        the host and copied without a device sync."""
        if len(indices) == 0:
            raise ValueError("a micro-batch needs at least one example index")
        rows = [self.states[i] for i in indices]
        length = max(row.shape[0] for row in rows)
        embeds = rows[0].new_zeros(len(rows), length, rows[0].shape[1])
        for r, row in enumerate(rows):
            embeds[r, :row.shape[0]] = row
        host = {"embeds": embeds, "mask": _pad([[1] * row.shape[0] for row in rows], 0, torch.device("cpu")),
                "labels": _pad([self.labels[i] for i in indices], IGNORE_INDEX, torch.device("cpu"))}
        host["positions"], host["targets"] = supervised_positions(host["labels"], host["mask"])
        dev = batch_to_device(host, self.device)
        return {"loss_fn": PrefixBatch(self.decoder, self.depth, dev["embeds"], dev["mask"], dev["labels"],
                                       (dev["positions"], dev["targets"]))}


def prefix_cache(model: nn.Module, features: Sequence[dict], mode: str = "auto",
                 cache_dir: str | os.PathLike[str] | None = None, name: str = "") -> PrefixCache | None:
    """``train.prefix_cache``: ``auto`` builds/loads the cache when :func:`prefix_depth` says it is
    exact, else ``None`` (full forward); ``off`` always ``None``."""
    if mode not in MODES:
        raise ValueError(f"unknown train.prefix_cache {mode!r}; use one of {', '.join(MODES)}")
    if mode == "off" or prefix_depth(model) is None:
        return None
    return PrefixCache.build(model, features, cache_dir=cache_dir, name=name)
