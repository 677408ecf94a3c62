"""Tiny random-config test models (``tiny-llama``, ``tiny-gemma``) and their in-process byte-level
tokenizer: no download, deterministic weights."""
from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from prism.backbones import TINY_SHAPE


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """An in-process byte-level tokenizer (no download): ids 0–2 are ``<pad>``, ``<eos>``, ``<bos>``,
    then the 256 byte symbols. Any UTF-8 text round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<eos>", "<bos>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(specials + alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")


_TINY_SEED = 1234


def _tiny_model(arch: str, vocab_size: int) -> PreTrainedModel:
    """A random-config two-layer model; weights depend only on ``arch`` (fixed seed, RNG restored)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_TINY_SEED)
        if arch == "llama":
            return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **TINY_SHAPE))
        config = Gemma3TextConfig(vocab_size=vocab_size, sliding_window=64, **TINY_SHAPE)
        return Gemma3ForCausalLM(config)
