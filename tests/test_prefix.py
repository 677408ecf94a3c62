"""The cached frozen prefix against the full forward on tiny random 4-layer models (LoRA on the top 2).

References are the model's own full forward on the same right-padded micro-batch. float64 models use
SDPA attention (HF's eager float64 mask overflows to NaN on fully masked rows, see
test_per_example.py). HF computes RMSNorm in float32 even in a float64 model, so re-padding the
same batch to another length alone moves its float64 outputs by ~1e-9: the tight (1e-10) checks
keep the reference's shapes, the realistic ones (collate pads to a multiple of 8, the cache is
built in other micro-batches) use the per-example-gradient tolerance.
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from conftest import LENGTHS, N_LAYERS, TARGETS, VOCAB, features, suite_node, tiny_model
from torch import Tensor, nn

import prism.fastpath.prefix as prefix
from prism.data.prompts import collate
from prism.fastpath.prefix import PrefixCache, prefix_cache, prefix_depth, prefix_key, shared_prefix_groups
from prism.privacy.per_example import (
    IGNORE_INDEX,
    PerExampleGradients,
    mean_token_loss,
    per_example_loss,
    summed_gradients,
    supervised_positions,
)


def replay_logits(model: nn.Module, cache: PrefixCache, indices: list[int]) -> Tensor:
    """All-position logits of the replayed forward (what PrefixBatch feeds the loss)."""
    batch = cache.batch(indices)["loss_fn"]
    length = batch.inputs_embeds.shape[1]
    with prefix._top_layers_only(batch.decoder, batch.depth):
        return model(inputs_embeds=batch.inputs_embeds, attention_mask=batch.attention_mask,
                     position_ids=torch.arange(length).unsqueeze(0)).logits


def real_rows(logits: Tensor, feats: list[dict]) -> list[Tensor]:
    return [logits[i, : len(f["input_ids"])] for i, f in enumerate(feats)]


# --------------------------------------------------------------------------------------- depth
def test_prefix_depth_is_first_trainable_layer() -> None:
    assert prefix_depth(tiny_model("llama")) == 2
    assert prefix_depth(tiny_model("gemma3")) == 2
    assert prefix_depth(tiny_model("gemma2")) == 2
    assert prefix_depth(tiny_model("llama", lora_layers=[3])) == 3
    frozen_below = tiny_model("llama", lora_layers=[1, 2, 3])
    for name, p in frozen_below.named_parameters():  # LoRA in layer 1, frozen: part of the (exact) prefix
        if ".layers.1." in name:
            p.requires_grad_(False)
    assert prefix_depth(frozen_below) == 2


def test_prefix_depth_refuses_what_it_cannot_replay_exactly() -> None:
    assert prefix_depth(tiny_model("llama", lora_layers=list(range(N_LAYERS)))) is None  # LoRA in layer 0
    trainable_embedding = tiny_model("llama")
    trainable_embedding.get_base_model().model.embed_tokens.weight.requires_grad_(True)
    assert prefix_depth(trainable_embedding) is None
    assert prefix_depth(tiny_model("llama", attention_dropout=0.1)) is None
    assert prefix_depth(tiny_model("gemma3", use_bidirectional_attention=True)) is None
    nothing_trainable = tiny_model("llama")
    nothing_trainable.requires_grad_(False)
    assert prefix_depth(nothing_trainable) is None
    nothing_trainable.get_base_model().model.norm.weight.requires_grad_(True)  # only the final norm
    assert prefix_depth(nothing_trainable) is None
    assert prefix_depth(nn.Sequential(nn.Linear(4, 4))) is None  # unverified architecture


# ------------------------------------------------------------------------------ exact replay
@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma2"])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_replayed_logits_equal_full_forward(family: str, dtype: torch.dtype, atol: float, tmp_path: Path) -> None:
    model = tiny_model(family, dtype).eval()
    feats = features()
    cache = PrefixCache.build(model, feats, cache_dir=tmp_path, micro_batch_size=len(feats))
    batch = collate(feats, pad_id=0, pad_to_multiple_of=None)
    full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    replay = replay_logits(model, cache, list(range(len(feats))))
    layers = cache.decoder.layers
    for got, want in zip(real_rows(replay, feats), real_rows(full, feats)):
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
    assert cache.decoder.layers is layers and all(type(m).__name__.endswith("DecoderLayer") for m in layers)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_per_example_gradients_from_cache_equal_full_forward(family: str, tmp_path: Path) -> None:
    """Realistic shapes: cache built in micro-batches of 2 (sorted by length), replay pads to the
    longest row, the token path pads to a multiple of 8."""
    model = tiny_model(family)
    feats = features()
    cache = PrefixCache.build(model, feats, cache_dir=tmp_path, micro_batch_size=2)
    engine = PerExampleGradients(model)
    indices = [4, 0, 1, 2]
    ref_losses, ref_grads = engine.compute(**collate([feats[i] for i in indices], pad_id=0))
    losses, grads = engine.compute(**cache.batch(indices))

    assert list(grads) == list(ref_grads) and len(grads) == 2 * len(TARGETS) * 2  # 2 layers × targets × A, B
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-8)
    assert losses[2] == 0  # feature 1 has no supervised token
    for name, ref in ref_grads.items():
        assert ref[[0, 1, 3]].flatten(1).norm(dim=1).min() > 1e-4  # non-trivial
        torch.testing.assert_close(grads[name], ref, rtol=1e-6, atol=1e-9)

    ref_sum_losses, ref_sums = summed_gradients(model, **collate([feats[i] for i in indices], pad_id=0))
    sum_losses, sums = summed_gradients(model, **cache.batch(indices))
    torch.testing.assert_close(sum_losses, ref_sum_losses, rtol=0, atol=1e-8)
    for name, ref in ref_sums.items():
        torch.testing.assert_close(sums[name], ref, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(sums[name], grads[name].sum(0), rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------------- supervised logits only
@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("train_on_inputs", [False, True])
def test_supervised_positions_reproduce_per_example_loss(padding_side: str, train_on_inputs: bool) -> None:
    feats = features([7, 3, 10, 5])
    if train_on_inputs:
        feats = [{"input_ids": f["input_ids"], "labels": f["input_ids"]} for f in feats]
    batch = collate(feats, pad_id=0, padding_side=padding_side)
    logits = torch.randn(*batch["input_ids"].shape, VOCAB, dtype=torch.float64)
    positions, targets = supervised_positions(batch["labels"], batch["attention_mask"])
    kept = torch.take_along_dim(logits, positions[..., None], dim=1)
    want = per_example_loss(logits, batch["labels"], batch["attention_mask"])
    torch.testing.assert_close(mean_token_loss(kept, targets), want, rtol=0, atol=1e-12)
    supervised = (batch["labels"][:, 1:] != IGNORE_INDEX) & (batch["attention_mask"][:, :-1] == 1)
    assert positions.shape[1] == supervised.sum(1).max()  # nothing beyond the longest supervised span
    if not train_on_inputs:
        assert positions.shape[1] == 3 and want[1] == 0


def test_supervised_positions_of_a_one_token_batch() -> None:
    positions, targets = supervised_positions(torch.tensor([[5], [6]]), torch.ones(2, 1, dtype=torch.long))
    assert positions.tolist() == [[0], [0]] and targets.tolist() == [[IGNORE_INDEX]] * 2


def test_micro_batch_is_tokens_or_loss_fn(tmp_path: Path) -> None:
    model = tiny_model("llama")
    feats = features()
    tokens = collate(feats[:2], pad_id=0)
    loss_fn = PrefixCache.build(model, feats, cache_dir=tmp_path).batch([0, 1])["loss_fn"]
    with pytest.raises(ValueError, match="not both"):
        summed_gradients(model, **tokens, loss_fn=loss_fn)
    with pytest.raises(ValueError, match="needs input_ids"):
        PerExampleGradients(model).compute(input_ids=tokens["input_ids"])
    with pytest.raises(ValueError, match="another model"):
        summed_gradients(tiny_model("llama"), loss_fn=loss_fn)


# ------------------------------------------------------------------------------------- storage
@pytest.fixture
def count_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    compute = prefix.compute_prefix_states

    def counted(*args: object, **kwargs: object) -> list[Tensor]:
        calls.append(1)
        return compute(*args, **kwargs)

    monkeypatch.setattr(prefix, "compute_prefix_states", counted)
    return calls


def test_cache_is_persisted_and_reused(tmp_path: Path, count_builds: list[int]) -> None:
    model = tiny_model("llama", torch.float32)
    feats = features()
    first = PrefixCache.build(model, feats, cache_dir=tmp_path, name="tiny")
    second = PrefixCache.build(model, feats, cache_dir=tmp_path, name="tiny")
    assert len(count_builds) == 1 and first.build_seconds > 0 and second.build_seconds == 0
    assert [s.shape for s in second.states] == [(n, 32) for n in LENGTHS]
    assert all(torch.equal(a, b) for a, b in zip(first.states, second.states))
    (entry,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "states.safetensors"]  # no temporaries left


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "drop_meta", "garble_meta"])
def test_damaged_cache_is_rebuilt(damage: str, tmp_path: Path, count_builds: list[int]) -> None:
    model = tiny_model("llama", torch.float32)
    feats = features()
    good = PrefixCache.build(model, feats, cache_dir=tmp_path)
    (entry,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    states, meta = entry / "states.safetensors", entry / "meta.json"
    data = bytearray(states.read_bytes())
    if damage == "flip_byte":
        data[-5] ^= 0xFF
        states.write_bytes(bytes(data))
    elif damage == "truncate":
        states.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "drop_meta":
        meta.unlink()
    else:
        meta.write_text("{not json")
    rebuilt = PrefixCache.build(model, feats, cache_dir=tmp_path)
    assert len(count_builds) == 2 and rebuilt.build_seconds > 0
    assert all(torch.equal(a, b) for a, b in zip(good.states, rebuilt.states))
    assert PrefixCache.build(model, feats, cache_dir=tmp_path).build_seconds == 0  # repaired on disk


def test_key_follows_what_the_states_depend_on() -> None:
    model = tiny_model("llama", torch.float32)
    ids = [f["input_ids"] for f in features()]
    key = prefix_key(model, 2, ids, "tiny")
    assert prefix_key(model, 2, ids, "tiny") == key
    assert prefix_key(model, 2, [*ids[:-1], ids[-1][:-1]], "tiny") != key  # token ids
    assert prefix_key(model, 3, ids, "tiny") != key  # depth
    assert prefix_key(model, 2, ids, "other") != key  # backbone name
    layers = model.get_base_model().model.layers
    with torch.no_grad():
        layers[3].mlp.up_proj.base_layer.weight.mul_(2)  # above the prefix (spectral init rewrites these)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(1)
    assert prefix_key(model, 2, ids, "tiny") == key
    with torch.no_grad():
        layers[1].self_attn.o_proj.weight[0, 0] += 1e-3  # inside the prefix
    assert prefix_key(model, 2, ids, "tiny") != key


def test_parallel_builders_compute_once(tmp_path: Path, count_builds: list[int]) -> None:
    model = tiny_model("llama", torch.float32)
    feats = features()
    results: list[PrefixCache] = []

    def worker() -> None:
        results.append(PrefixCache.build(model, feats, cache_dir=tmp_path))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3 and len(count_builds) == 1
    assert sorted(r.build_seconds > 0 for r in results) == [False, False, True]


def test_prefix_cache_switch(tmp_path: Path) -> None:
    feats = features()
    assert isinstance(prefix_cache(tiny_model("llama"), feats, "auto", tmp_path), PrefixCache)
    assert prefix_cache(tiny_model("llama"), feats, "off", tmp_path) is None
    everywhere = tiny_model("llama", lora_layers=list(range(N_LAYERS)))
    assert prefix_cache(everywhere, feats, "auto", tmp_path) is None
    with pytest.raises(ValueError, match="prefix_depth is None"):
        PrefixCache.build(everywhere, feats, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="auto, off"):
        prefix_cache(tiny_model("llama"), feats, "on", tmp_path)
    assert list(tmp_path.iterdir()) != []


# --------------------------------------------------------------------------- real backbone
@pytest.mark.slow
def test_real_backbone_cache_matches_full_forward(tmp_path: Path) -> None:
    """SmolLM2-135M (fp32, LoRA on the last 4 of 30 layers, spectral init): cached vs full per-example
    losses and gradients on 4 embedded GLUE examples."""
    from prism.data import build_suite
    from prism.data.prompts import tokenize_example
    from prism.models import attach_lora, load_backbone

    backbone = {"name": "smollm2-135m", "dtype": "float32", "lora_layers": 4}
    model, tokenizer = load_backbone(backbone, torch.device("cpu"))
    lora = {"r": 16, "alpha": 16, "dropout": 0.0, "targets": TARGETS}
    model = attach_lora(model, lora, backbone, init="spectral", generator=torch.Generator().manual_seed(0))
    suite = build_suite(suite_node("glue8", embedded={"train_per_task": 500, "eval_per_task": 200}), 0)
    feats = [tokenize_example(tokenizer, ex, 384, False) for ex in suite.train[:4]]
    assert prefix_depth(model) == 26
    cache = PrefixCache.build(model, feats, cache_dir=tmp_path, name="smollm2-135m")
    engine = PerExampleGradients(model)
    ref_losses, ref_grads = engine.compute(**collate(feats, pad_id=tokenizer.pad_token_id))
    losses, grads = engine.compute(**cache.batch([0, 1, 2, 3]))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-3, atol=1e-5)


# ----------------------------------------------------------------------- shared prompt prefix
def templated_features(seed: int = 1) -> list[dict[str, list[int]]]:
    """Two 'tasks': a common template, a task-specific instruction, then each example's own tokens."""
    gen = torch.Generator().manual_seed(seed)
    template = torch.randint(3, VOCAB, (5,), generator=gen).tolist()
    tasks = [torch.randint(3, VOCAB, (4,), generator=gen).tolist() for _ in range(2)]
    rows = []
    for i, n in enumerate([3, 1, 6, 2, 5, 4, 2, 7]):
        ids = template + tasks[i % 2] + torch.randint(3, VOCAB, (n,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": ids})
    rows.append({"input_ids": template[:3], "labels": template[:3]})  # shorter than the shared part
    return rows


def test_shared_prefix_groups_partition_by_common_tokens() -> None:
    ids = [f["input_ids"] for f in templated_features()]
    groups = shared_prefix_groups(ids, min_group=2)
    assert sorted(i for _, members in groups for i in members) == list(range(len(ids)))
    for shared, members in groups:  # the claimed prefix is shared and leaves each row a token
        assert all(ids[i][:shared] == ids[members[0]][:shared] and len(ids[i]) > shared for i in members)
    assert sorted((shared, len(members)) for shared, members in groups) == [(2, 1), (9, 4), (9, 4)]
    assert shared_prefix_groups(ids, min_group=5) == [(5, list(range(8))), (2, [8])]  # tasks of 4 stay together


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_states_behind_a_shared_prefix_equal_the_plain_forward(family: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Micro-batches that run their common prefix once through the KV cache (Gemma-3: sliding window
    3, shorter than the shared 9 tokens) give every row the states of its own full forward."""
    model = tiny_model(family, torch.float32)
    ids = [f["input_ids"] for f in templated_features()]
    shared = prefix.compute_prefix_states(model, 2, ids, micro_batch_size=4)
    monkeypatch.setattr(prefix, "common_prefix_length", lambda rows: 0)  # no sharing: one padded forward
    plain = prefix.compute_prefix_states(model, 2, ids, micro_batch_size=4)
    decoder = prefix._decoder(model)
    captured: list[Tensor] = []
    decoder.layers[2].register_forward_pre_hook(lambda m, a, k: captured.append(a[0] if a else k["hidden_states"]),
                                                with_kwargs=True)
    for i, row in enumerate(ids):
        captured.clear()
        with torch.no_grad():
            decoder(input_ids=torch.tensor([row]))
        torch.testing.assert_close(shared[i], captured[0][0], rtol=0, atol=1e-5)
        torch.testing.assert_close(plain[i], captured[0][0], rtol=0, atol=1e-5)
