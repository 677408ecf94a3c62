"""The last decoder layer at the read positions only (prism/fastpath/top_layer.py) against the full layer
(float64 tolerance 1e-7: HF computes RMSNorm in float32 even in a float64 model, see test_prefix.py).

References: the full forward of the same tiny random Llama (per-example losses and Opacus
per-example LoRA gradients of the replayed micro-batch with the shortcut switched off) and the KV
cache of the model's own prefill."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import features, tiny_model
from transformers import DynamicCache

from prism.fastpath import top_layer
from prism.fastpath.grouped_attention import grouped_eager
from prism.fastpath.prefix import PrefixCache, _decoder, _top_layers_only
from prism.methods.hf_baseline import holdout_loss
from prism.privacy.per_example import PerExampleGradients, summed_gradients


@pytest.mark.parametrize(("dtype", "lora_layers", "tol"), [(torch.float64, [2, 3], 1e-7),
                                                           (torch.float32, [3], 1e-5)])
def test_read_positions_give_the_full_layers_losses_and_gradients(dtype, lora_layers, tol, tmp_path: Path) -> None:
    model = tiny_model("llama", dtype, lora_layers=lora_layers)
    feats = features()
    feats[3]["labels"] = feats[3]["input_ids"][:]  # a row supervised everywhere, position 0 included
    cache = PrefixCache.build(model, feats, cache_dir=tmp_path, micro_batch_size=2)
    assert top_layer.supported(cache.decoder)
    indices = [4, 0, 1, 3, 2]
    sparse = cache.batch(indices)["loss_fn"]
    full = replace(sparse, read_only_supervised=False)
    engine = PerExampleGradients(model)
    ref_losses, ref_grads = engine.compute(loss_fn=full)
    losses, grads = engine.compute(loss_fn=sparse)
    torch.testing.assert_close(losses, ref_losses, rtol=tol, atol=tol)
    assert losses[2] == 0 and bool((ref_losses[[0, 1, 3, 4]] > 0).all())
    for name, ref in ref_grads.items():
        assert ref.flatten(1).norm(dim=1).max() > 1e-3  # non-trivial
        torch.testing.assert_close(grads[name], ref, rtol=tol, atol=tol)
    ref_sum, ref_sums = summed_gradients(model, loss_fn=full)
    got_sum, sums = summed_gradients(model, loss_fn=sparse)
    torch.testing.assert_close(got_sum, ref_sum, rtol=tol, atol=tol)
    for name, ref in ref_sums.items():
        torch.testing.assert_close(sums[name], ref, rtol=tol, atol=tol)
    assert all(type(m).__name__ == "LlamaDecoderLayer" for m in cache.decoder.layers)  # restored


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_keys_values_only_fill_the_cache_like_the_full_layer(dtype) -> None:
    model = tiny_model("llama", dtype, lora_layers=[3]).eval()
    decoder = _decoder(model)
    ids = torch.randint(3, 90, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding, as in generation
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    embeds = decoder.embed_tokens(ids)
    caches = [DynamicCache(config=decoder.config), DynamicCache(config=decoder.config)]
    with torch.no_grad(), _top_layers_only(decoder, 3):
        decoder(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, cache=caches[0], use_cache=True)
        with top_layer.keys_values_only(decoder):
            decoder(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, cache=caches[1], use_cache=True)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(caches[1].layers[3].keys, caches[0].layers[3].keys, rtol=tol, atol=tol)
    torch.testing.assert_close(caches[1].layers[3].values, caches[0].layers[3].values, rtol=tol, atol=tol)


def test_only_llama_layers_take_the_shortcut() -> None:
    assert top_layer.supported(_decoder(tiny_model("llama")))
    assert not top_layer.supported(_decoder(tiny_model("gemma3")))
    assert not top_layer.supported(_decoder(tiny_model("llama", attention_dropout=0.1)))


def test_grouped_eager_attention_generates_what_eager_does() -> None:
    """Grouped-query attention without the per-head KV copy: the same greedy tokens and scores as HF's
    eager attention on a tiny random Llama (4 query heads on 2 key/value heads), left-padded batch."""
    model = tiny_model("llama", torch.float32, lora_layers=[3]).eval()
    assert model.config._attn_implementation == "eager"
    ids = torch.randint(3, 90, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    greedy = {"do_sample": False, "max_new_tokens": 8, "pad_token_id": 0, "output_scores": True,
              "return_dict_in_generate": True}
    with torch.no_grad():
        eager = model.generate(input_ids=ids, attention_mask=mask, **greedy)
        with grouped_eager(model):
            assert model.config._attn_implementation != "eager"
            grouped = model.generate(input_ids=ids, attention_mask=mask, **greedy)
    assert model.config._attn_implementation == "eager"
    assert torch.equal(grouped.sequences, eager.sequences)
    gemma = tiny_model("gemma2", torch.float32)  # eager with logit soft-capping: left alone
    with grouped_eager(gemma):
        assert gemma.config._attn_implementation == "eager"
    for got, want in zip(grouped.scores, eager.scores):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lora_layers", [[3], [2, 3]])
def test_holdout_loss_from_prefix_states_is_the_full_models_token_mean(lora_layers, tmp_path: Path) -> None:
    """The hold-out loss of the released non-private recipe, replayed from frozen-prefix states (last
    layer at the supervised positions), against the token-mean cross-entropy of the full model run on
    each row alone; the model's train/eval mode is restored."""
    model = tiny_model("llama", torch.float64, lora_layers=lora_layers)
    feats = features()
    feats[3]["labels"] = feats[3]["input_ids"][:]
    total, count = 0.0, 0
    with torch.no_grad():
        model.eval()
        for f in feats:
            logits = model(input_ids=torch.tensor([f["input_ids"]])).logits[0, :-1]
            targets = torch.tensor(f["labels"][1:])
            total += float(F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"))
            count += int((targets != -100).sum())
    model.train()
    held = PrefixCache.build(model, feats, cache_dir=tmp_path, micro_batch_size=2)
    got = holdout_loss(model, feats, 0, 4, torch.device("cpu"), held)
    plain = holdout_loss(model, feats, 0, 4, torch.device("cpu"))
    assert model.training
    assert got == pytest.approx(total / count, rel=1e-7) and plain == pytest.approx(total / count, rel=1e-7)
