"""backbone=local: a tiny random Llama (and Gemma-3) saved with save_pretrained to a temp folder, its
LoRA targets and rank checked from the folder before loading, a damaged folder (truncated weights,
a missing shard, an unknown model_type, an unreadable tokenizer.json, a context shorter than the
sequences) refused before any run folder,
the speed paths reported, and an end-to-end run whose result does not depend on which path ran."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TARGETS
from safetensors.torch import load_file
from torch import nn

from pipelines.__main__ import main as cli
from pipelines.runs import runner
from prism.backbones import causal_lm_types, config_types, local_linear_shapes, local_problem
from prism.models import attach_lora, load_backbone
from prism.models.local import speed_paths
from prism.models.tiny import _tiny_model, byte_tokenizer
from prism.models.wiring import lora_config, validate_lora


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


def _damaged(folder: Path, tmp_path: Path, name: str) -> Path:
    copy = tmp_path / name
    shutil.copytree(folder, copy)
    return copy


def test_a_truncated_safetensors_file_is_refused_by_its_size(llama: tuple[Path, nn.Module], tmp_path: Path) -> None:
    """save_pretrained writes exactly 8 + header + data bytes, so the complete file's size is what the
    header asks for: one byte short is refused naming that size; the complete file passes."""
    folder, _ = llama
    whole = (folder / "model.safetensors").stat().st_size
    short = _damaged(folder, tmp_path, "short")
    with (short / "model.safetensors").open("r+b") as fh:
        fh.truncate(whole - 1)
    problem = local_problem(short, TARGETS, 4, None)
    assert problem == (f"backbone.path={short}: model.safetensors is truncated ({whole - 1} bytes, its header needs "
                       f"{whole}); copy the file again (an interrupted copy or download) or save the model again "
                       "with save_pretrained")
    with (short / "model.safetensors").open("r+b") as fh:
        fh.truncate(100)  # inside the header
    assert "model.safetensors is truncated (100 bytes, shorter than its own" in local_problem(short, TARGETS, 4, None)
    assert local_problem(folder, TARGETS, 4, None) is None


def test_a_sharded_model_needs_every_shard_whole(tmp_path: Path) -> None:
    tokenizer = byte_tokenizer()
    model = _tiny_model("llama", vocab_size=len(tokenizer))
    folder = tmp_path / "sharded"
    model.save_pretrained(folder, max_shard_size="40KB")
    tokenizer.save_pretrained(folder)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2 and (folder / "model.safetensors.index.json").is_file()
    assert local_problem(folder, TARGETS, 4, None) is None
    assert local_linear_shapes(folder) == _decoder_linears(model)
    missing = _damaged(folder, tmp_path, "missing")
    (missing / shards[1].name).unlink()
    assert f"names 1 shard(s) not in the folder (first: {shards[1].name})" in local_problem(missing, TARGETS, 4, None)
    cut = _damaged(folder, tmp_path, "cut")
    with (cut / shards[-1].name).open("r+b") as fh:
        fh.truncate(shards[-1].stat().st_size - 4)
    assert f"{shards[-1].name} is truncated" in local_problem(cut, TARGETS, 4, None)


def test_model_type_is_checked_against_the_installed_transformers(llama: tuple[Path, nn.Module], tmp_path: Path) -> None:
    """The model types are read from transformers' source without importing it; they are exactly the
    keys of its own mappings."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert causal_lm_types() == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) and config_types() == set(CONFIG_MAPPING_NAMES)
    for model_type, words in (("llama9", "unknown to the installed transformers"),
                              ("t5", "not a causal language model")):
        folder = _damaged(llama[0], tmp_path, model_type)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
        problem = local_problem(folder, TARGETS, 4, None)
        assert f"config.json's model_type {model_type!r} is {words}" in problem, problem


def test_an_unreadable_tokenizer_json_is_refused(llama: tuple[Path, nn.Module], tmp_path: Path) -> None:
    folder = _damaged(llama[0], tmp_path, "tok")
    text = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(text[: len(text) // 2])
    assert "tokenizer.json is not readable JSON" in local_problem(folder, TARGETS, 4, None)


def test_the_models_context_holds_the_longest_sequence(llama: tuple[Path, nn.Module], tmp_path: Path) -> None:
    """suite.cutoff_len plus the generation cap must fit in config.json's max_position_embeddings: at
    the boundary the config passes, one position fewer it is refused naming the largest cutoff that fits."""
    from pipelines.config.validate import ConfigError, load_job

    job = ["backbone=local", "suite.cutoff_len=200", "suite.decoding.max_new_tokens=10", f"results_dir={tmp_path / 'r'}"]
    for context, ok in ((210, True), (209, False)):
        folder = _damaged(llama[0], tmp_path, f"context{context}")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
        if ok:
            load_job([*job, f"backbone.path={folder}"])
            continue
        with pytest.raises(ConfigError, match=r"exceed the 209-token context .* lower suite.cutoff_len to at most 199$"):
            load_job([*job, f"backbone.path={folder}"])


def test_a_damaged_folder_exits_2_without_a_run_folder(llama: tuple[Path, nn.Module], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def no_training(*_: object) -> None:
        raise AssertionError("a damaged model folder reached the trainer")

    monkeypatch.setattr(runner, "default_trainer", no_training)
    short = _damaged(llama[0], tmp_path, "short")
    with (short / "model.safetensors").open("r+b") as fh:
        fh.truncate(fh.seek(0, 2) // 2)
    results = tmp_path / "results"
    code = cli(["run", "backbone=local", f"backbone.path={short}", f"results_dir={results}", "logging=disabled"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "model.safetensors is truncated" in err and not results.exists()


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
    code = cli(["run", "backbone=local", f"backbone.path={llama[0]}", "lora.targets=[q_proj,c_attn]", f"results_dir={results}"])
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
        code = cli(["run", "suite=custom", f"suite.custom.train={task}", "suite.custom.labels=[yes,no]", "backbone=local",
                     f"backbone.path={llama[0]}", "scale=smoke", "method=adamw", "privacy=eps6",
                     f"train.prefix_cache={mode}", f"results_dir={results}", "logging=disabled"])
        out = capsys.readouterr().out
        assert code == 0 and f"frozen-prefix cache {'on' if mode == 'auto' else 'off'}" in out
        (folder,) = [p for p in (results / "runs").iterdir() if p.is_dir() and not p.name.startswith("_")]
        finals.append((json.loads((folder / "final.json").read_text()), load_file(str(folder / "adapter" / "adapter_model.safetensors"))))
    (a, wa), (b, wb) = finals
    assert a["data"]["train_sha256"] and a["n_train"] + a["eval_rows"]["custom"] == 40 and a["eval_rows"]["custom"]
    assert set(a["columns"]) == {"Accuracy", "Macro-F1"} and a["columns"] == b["columns"]
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-5) for k in wa)
