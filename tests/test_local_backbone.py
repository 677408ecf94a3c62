"""backbone=local: a tiny random Llama (and Gemma-3) saved with save_pretrained to a temp folder, its
LoRA targets and rank checked from the folder before loading, the speed paths reported, and an
end-to-end run whose result does not depend on which path ran."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from pipelines.run import main
from prism.backbones import local_linear_shapes, local_problem
from prism.models import attach_lora, load_backbone
from prism.models.local import speed_paths
from prism.models.tiny import _tiny_model, byte_tokenizer
from prism.models.wiring import lora_config, validate_lora

TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]


def _save(arch: str, folder: Path) -> nn.Module:
    tokenizer = byte_tokenizer()
    model = _tiny_model(arch, vocab_size=len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    return folder, _save("llama", folder)


def _decoder_linears(model: nn.Module) -> dict[str, tuple[int, int]]:
    return {name: tuple(m.weight.shape) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and ".layers." in name}


def test_header_shapes_equal_the_models_own_layers(llama: tuple[Path, nn.Module]) -> None:
    folder, model = llama
    assert local_linear_shapes(folder) == _decoder_linears(model)


def test_targets_and_rank_are_checked_from_the_folder(llama: tuple[Path, nn.Module], tmp_path: Path) -> None:
    folder, model = llama
    names = sorted({name.rsplit(".", 1)[-1] for name in _decoder_linears(model)})
    assert local_problem(folder, TARGETS, 16, 1) is None
    unknown = local_problem(folder, ["q_proj", "qkv_proj"], 16, None)
    assert "qkv_proj" in unknown and all(name in unknown for name in names)
    narrow = min(min(model.get_submodule(f"model.layers.1.self_attn.{t}").weight.shape) for t in ("k_proj", "v_proj"))
    too_wide = local_problem(folder, TARGETS, narrow + 1, 1)
    assert f"lora.r={narrow + 1}" in too_wide and f"width {narrow}" in too_wide
    assert "exceeds the 2 decoder layers" in local_problem(folder, TARGETS, 16, 3)
    assert "no such folder" in local_problem(tmp_path / "nothing", TARGETS, 16, None)
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(folder, bare)
    (bare / "tokenizer.json").unlink()
    assert "tokenizer.json" in local_problem(bare, TARGETS, 16, None)
    assert "backbone.path" in local_problem(None, TARGETS, 16, None)


def test_loads_the_saved_weights_and_wires_the_checked_targets(llama: tuple[Path, nn.Module]) -> None:
    folder, original = llama
    model, tokenizer = load_backbone({"name": "local", "path": str(folder), "dtype": "float32"}, "cpu")
    assert tokenizer.pad_token is not None and not any(p.requires_grad for p in model.parameters())
    saved = load_file(str(folder / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    half, _ = load_backbone({"name": "local", "path": str(folder), "dtype": "bfloat16"}, "cpu")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}  # backbone.dtype rules, not the file's
    lora = {"r": 4, "alpha": 4, "dropout": 0.0, "targets": TARGETS}
    targeted = validate_lora(model, lora_config(model, lora, {"lora_layers": 1}))
    expected = {n for n in local_linear_shapes(folder) if n.startswith("model.layers.1.") and n.rsplit(".", 1)[-1] in TARGETS}
    assert set(targeted) == expected


def test_speed_paths_say_which_ran(llama: tuple[Path, nn.Module], tmp_path: Path) -> None:
    lora = {"r": 4, "alpha": 4, "dropout": 0.0, "targets": TARGETS}
    model, _ = load_backbone({"name": "local", "path": str(llama[0]), "dtype": "float32"}, "cpu")
    line = speed_paths(attach_lora(model, lora, {"lora_layers": 1}, "peft", None), "auto")
    assert "frozen-prefix cache on" in line and "top-layer path on" in line and "grouped attention on" in line
    _save("gemma3", tmp_path / "gemma")  # a second architecture: no Llama layer, Gemma's soft-capped attention
    gemma, _ = load_backbone({"name": "local", "path": str(tmp_path / "gemma"), "dtype": "float32"}, "cpu")
    line = speed_paths(attach_lora(gemma, lora, {"lora_layers": 1}, "peft", None), "auto")
    assert "frozen-prefix cache on" in line and "top-layer path off (Gemma3DecoderLayer" in line
    assert "grouped attention off (model_type gemma3_text)" in line
    assert "frozen-prefix cache off (train.prefix_cache=off)" in speed_paths(gemma, "off")


def test_bad_targets_exit_2_listing_the_names(llama: tuple[Path, nn.Module], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results"
    code = main(["backbone=local", f"backbone.path={llama[0]}", "lora.targets=[q_proj,c_attn]", f"results_dir={results}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "c_attn" in err and "gate_proj" in err, err
    assert not results.exists()


def test_end_to_end_result_does_not_depend_on_the_speed_path(llama: tuple[Path, nn.Module], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"id": i, "prompt": f"Is item {i} even?", "target": "yes" if i % 2 == 0 else "no"} for i in range(40)]
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    finals = []
    for mode in ("auto", "off"):
        results = tmp_path / mode
        code = main(["suite=custom", f"suite.custom.train={task}", "suite.custom.labels=[yes,no]", "backbone=local",
                     f"backbone.path={llama[0]}", "scale=smoke", "method=adamw", "privacy=eps6",
                     f"train.prefix_cache={mode}", f"results_dir={results}", "logging=disabled"])
        out = capsys.readouterr().out
        assert code == 0 and f"frozen-prefix cache {'on' if mode == 'auto' else 'off'}" in out
        (folder,) = [p for p in (results / "runs").iterdir() if p.is_dir() and not p.name.startswith("_")]
        finals.append((json.loads((folder / "final.json").read_text()), load_file(str(folder / "adapter" / "adapter_model.safetensors"))))
    (a, wa), (b, wb) = finals
    assert a["data"]["train_sha256"] and a["n_train"] == 32 and a["eval_rows"] == {"custom": 8}
    assert set(a["columns"]) == {"Accuracy", "Macro-F1"} and a["columns"] == b["columns"]
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-5) for k in wa)
