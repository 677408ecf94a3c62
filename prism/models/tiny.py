"""Tiny random-config test models (``tiny-llama``, ``tiny-gemma``) and their in-process byte-level
tokenizer: no download, deterministic weights."""
from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast


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
_TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, initializer_range=0.1,
                   pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True)


def _tiny_model(arch: str, vocab_size: int) -> PreTrainedModel:
    """A random-config two-layer model; weights depend only on ``arch`` (fixed seed, RNG restored)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_TINY_SEED)
        if arch == "llama":
            return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **_TINY_SHAPE))
        config = Gemma3TextConfig(vocab_size=vocab_size, sliding_window=64, **_TINY_SHAPE)
        return Gemma3ForCausalLM(config)
