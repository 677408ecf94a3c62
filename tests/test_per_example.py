"""Per-example losses and LoRA gradients against microbatch-of-1 autodiff on tiny random HF models.

float64 models use SDPA attention: HF's eager attention in float64 turns left-padded rows into NaN
(its additive mask overflows), which says nothing about per-example gradients.
"""
from __future__ import annotations

import math

import pytest
import torch
from conftest import TARGETS
from peft import LoraConfig, get_peft_model
from torch import Tensor, nn
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from prism.privacy import PerExampleGradients, per_example_loss, summed_gradients

VOCAB = 128
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_implementation="sdpa")


def tiny_lora_model(family: str) -> nn.Module:
    """Random 2-layer float64 causal LM with LoRA on the paper's targets, lora_B non-zero."""
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY))
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(**TINY, sliding_window=4))
    model = get_peft_model(model.double(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    return model


def padded_batch(lengths: list[int], prompt: list[int], seq_len: int) -> dict[str, Tensor]:
    """Left-padded batch: row i has ``lengths[i]`` real tokens, the first ``prompt[i]`` unsupervised."""
    input_ids = torch.randint(1, VOCAB, (len(lengths), seq_len))
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for i, (n, p) in enumerate(zip(lengths, prompt)):
        attention_mask[i, seq_len - n:] = 1
        input_ids[i, : seq_len - n] = 0
        labels[i, seq_len - n + p:] = input_ids[i, seq_len - n + p:]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# row 4 has no supervised token (prompt covers it): zero loss, zero gradient
BATCH = {"lengths": [9, 6, 4, 7, 5], "prompt": [2, 0, 1, 3, 5], "seq_len": 9}


def microbatch_of_one(model: nn.Module, batch: dict[str, Tensor]) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
    """Reference: each padded row alone, ``ℓ_i.backward()``, read ``.grad``."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    losses, grads = [], []
    for i in range(batch["input_ids"].shape[0]):
        model.zero_grad(set_to_none=True)
        row = {k: v[i : i + 1] for k, v in batch.items()}
        logits = model(input_ids=row["input_ids"], attention_mask=row["attention_mask"]).logits
        loss = per_example_loss(logits, row["labels"], row["attention_mask"])[0]
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.detach().clone() for n, p in params.items()})
    model.zero_grad(set_to_none=True)
    return losses, grads


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_per_example_gradients_equal_microbatch_of_one(family: str) -> None:
    model = tiny_lora_model(family)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    batch = padded_batch(**BATCH)
    ref_losses, ref_grads = microbatch_of_one(model, batch)

    losses, grads = PerExampleGradients(model).compute(**batch)

    assert list(grads) == trainable  # peft's own names, no Opacus "_module." prefix
    for target in TARGETS:  # every target module type, both factors
        for side in ("lora_A", "lora_B"):
            assert any(f"{target}.{side}." in n for n in grads), (target, side)
    torch.testing.assert_close(losses, torch.stack(ref_losses), rtol=0, atol=1e-10)
    for name in trainable:
        assert grads[name].shape == (5, *model.get_parameter(name).shape)
        for i in range(5):
            torch.testing.assert_close(grads[name][i], ref_grads[i][name], rtol=1e-6, atol=1e-9)
    assert all(grads[n][:4].flatten(1).norm(dim=1).min() > 1e-4 for n in trainable)  # non-trivial
    assert all(torch.count_nonzero(grads[n][4]) == 0 for n in trainable)
    assert losses[4] == 0
    for name, p in model.named_parameters():  # frozen base: no gradient, unchanged
        if not p.requires_grad:
            assert p.grad is None and getattr(p, "grad_sample", None) is None
            assert torch.equal(p, frozen_before[name])


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_micro_batches_do_not_accumulate() -> None:
    model = tiny_lora_model("llama")
    engine = PerExampleGradients(model)
    first = padded_batch(**BATCH)
    second = padded_batch([3, 8, 5], [1, 2, 0], 8)
    engine.compute(**first)
    _, grads = engine.compute(**second)
    _, ref = microbatch_of_one(model, second)
    for name, g in grads.items():
        for i in range(3):
            torch.testing.assert_close(g[i], ref[i][name], rtol=1e-6, atol=1e-9)
    for p in model.parameters():
        assert p.grad is None and getattr(p, "grad_sample", None) is None


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_factors_frozen_before_wrapping_are_left_out() -> None:
    """FFA freezes peft lora_A when the method is built; wrapping afterwards must follow requires_grad."""
    model = tiny_lora_model("llama")
    for name, p in model.named_parameters():
        if "lora_A" in name:
            p.requires_grad_(False)
    engine = PerExampleGradients(model)
    batch = padded_batch([4, 6], [1, 2], 6)
    _, grads = engine.compute(**batch)
    assert grads and all("lora_B" in name for name in grads)
    _, ref = microbatch_of_one(model, batch)
    for name, g in grads.items():
        for i in range(2):
            torch.testing.assert_close(g[i], ref[i][name], rtol=1e-6, atol=1e-9)
    model.get_parameter(next(iter(grads))).requires_grad_(False)
    with pytest.raises(RuntimeError, match="build it after"):
        engine.compute(**batch)


def test_summed_gradients_equal_sum_of_per_example() -> None:
    model = tiny_lora_model("gemma3")
    batch = padded_batch(**BATCH)
    losses_dp, per_example = PerExampleGradients(model).compute(**batch)
    losses, summed = summed_gradients(model, **batch)  # hooks of the DP wrapper must stay inert
    torch.testing.assert_close(losses, losses_dp, rtol=0, atol=1e-12)
    assert list(summed) == list(per_example)
    for name, g in summed.items():
        torch.testing.assert_close(g, per_example[name].sum(0), rtol=1e-9, atol=1e-12)


def test_per_example_loss_by_hand() -> None:
    logits = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[-100, 2, 5, -100], [0, 1, 3, 4], [5, -100, -100, -100]])
    losses = per_example_loss(logits, labels)
    expected = []
    for i in range(3):
        terms = [
            -math.log(torch.softmax(logits[i, t], dim=0)[labels[i, t + 1]].item())
            for t in range(3)
            if labels[i, t + 1] != -100
        ]
        expected.append(sum(terms) / len(terms) if terms else 0.0)
    torch.testing.assert_close(losses, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    losses.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.count_nonzero(logits.grad[2]) == 0  # no supervised token: no gradient

    # row 1 left-padded by one: its target at position 1 is predicted from padding and drops out
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    masked = per_example_loss(logits, labels, mask)
    by_hand = sum(-math.log(torch.softmax(logits[1, t], dim=0)[labels[1, t + 1]].item()) for t in (1, 2)) / 2
    assert masked[1].item() == pytest.approx(by_hand, rel=1e-12)
    torch.testing.assert_close(masked[[0, 2]], losses[[0, 2]])


def test_per_example_loss_equals_hf_loss_of_a_lone_example() -> None:
    """HF's ``labels=`` loss is the token mean of one unpadded sequence; ours must agree row by row.

    Row 1 is left-padded and supervised from its first token, which only the padding could predict:
    the mask must drop that target, else ℓ_1 would depend on the padding.
    """
    model = tiny_lora_model("llama")
    batch = padded_batch([9, 6], [2, 0], 9)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ours = per_example_loss(logits, batch["labels"], batch["attention_mask"])
    for i, n in enumerate([9, 6]):
        row = slice(9 - n, 9)
        hf = model(input_ids=batch["input_ids"][i : i + 1, row], labels=batch["labels"][i : i + 1, row]).loss
        torch.testing.assert_close(ours[i].float(), hf, rtol=1e-6, atol=1e-6)  # HF computes in float32


def test_low_precision_logits_are_upcast() -> None:
    logits = torch.randn(2, 5, 7).bfloat16()
    labels = torch.randint(0, 7, (2, 5))
    assert per_example_loss(logits, labels).dtype == torch.float32


def test_parameter_without_per_example_gradient_is_named() -> None:
    model = tiny_lora_model("llama")
    model.base_model.model.unused_head = nn.Linear(4, 4).double()  # trainable, never called
    with pytest.raises(RuntimeError, match="unused_head.weight"):
        PerExampleGradients(model).compute(**padded_batch([5, 3], [1, 0], 5))
    with pytest.raises(RuntimeError, match="unused_head.weight"):
        summed_gradients(model, **padded_batch([5, 3], [1, 0], 5))


def test_model_without_trainable_parameters_is_rejected() -> None:
    model = LlamaForCausalLM(LlamaConfig(**TINY)).requires_grad_(False)
    with pytest.raises(ValueError, match="attach LoRA"):
        PerExampleGradients(model)
