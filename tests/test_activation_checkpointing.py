"""Activation checkpointing stays exact under Opacus' per-sample hooks (prism/privacy/per_example.py)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import TARGETS
from peft import LoraConfig, get_peft_model
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from prism.fastpath.prefix import PrefixCache
from prism.privacy import PerExampleGradients
from prism.privacy.per_example import enable_activation_checkpointing

VOCAB = 96
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def lora_model(family: str, dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE, sliding_window=4))
    model.set_attn_implementation("eager")
    model = get_peft_model(model.double(), LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    return model


def batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (4, 10), generator=generator)
    mask = torch.ones_like(input_ids)
    mask[1, 7:] = 0
    labels = input_ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def per_sample(model: torch.nn.Module, checkpointing: bool, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if checkpointing:
        assert enable_activation_checkpointing(model) == SHAPE["num_hidden_layers"]
    engine = PerExampleGradients(model)
    torch.manual_seed(5)  # the dropout masks
    return engine.compute(**inputs)


@pytest.mark.parametrize("family", ["llama", "gemma"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_per_sample_grads_equal_with_and_without_checkpointing(family: str, dropout: float) -> None:
    model = lora_model(family, dropout)
    losses, grads = per_sample(copy.deepcopy(model), False, **batch())
    losses_ckpt, grads_ckpt = per_sample(model, True, **batch())
    torch.testing.assert_close(losses_ckpt, losses, rtol=1e-6, atol=1e-6)
    assert grads.keys() == grads_ckpt.keys() and len(grads) == 5 * SHAPE["num_hidden_layers"] * 2
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-6, atol=1e-6, msg=name)


def test_checkpointing_of_a_cached_prefix_replay(tmp_path: Path) -> None:
    """Top layers replayed from cached states (inputs that never required grad) still get exact grads."""
    model = lora_model("llama", 0.0)
    model.base_model.model.model.layers[0].requires_grad_(False)  # LoRA on the top two layers only
    features = [{"input_ids": row[row != -100].tolist() or [4, 5], "labels": row.tolist()}
                for row in batch()["labels"].clamp(min=3)]
    reference = copy.deepcopy(model)
    cache = PrefixCache.build(reference, features, cache_dir=tmp_path)
    losses, grads = PerExampleGradients(reference).compute(**cache.batch([0, 1, 2, 3]))
    enable_activation_checkpointing(model)
    cache_ckpt = PrefixCache.build(model, features, cache_dir=tmp_path)
    losses_ckpt, grads_ckpt = PerExampleGradients(model).compute(**cache_ckpt.batch([0, 1, 2, 3]))
    torch.testing.assert_close(losses_ckpt, losses, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.slow  # two tiny builds: ~30 s on a shared CPU
def test_the_loop_switch_trains_like_the_plain_loop() -> None:
    """``train.activation_checkpointing=true`` changes memory, not the update (same seed, dropout on)."""
    from pipelines.config.compose import compose_config, resolve
    from prism import train as T

    def params_after(flag: str) -> dict[str, torch.Tensor]:
        cfg = resolve(compose_config(["backbone=tiny-gemma", "suite=glue8", "suite.embedded.train_per_task=16",
                                      "suite.cutoff_len=1024", "train.batch_size=8", "train.micro_batch_size=4",
                                      "train.device=cpu", "method=adamw", "privacy=eps6", "lora.dropout=0.1",
                                      "logging=disabled", f"train.activation_checkpointing={flag}"]))
        setup = T.build(cfg)
        T.train_step(setup, cfg)
        return {k: v.detach().clone() for k, v in setup.params.items()}

    plain, checkpointed = params_after("false"), params_after("true")
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, rtol=1e-5, atol=1e-6, msg=name)
