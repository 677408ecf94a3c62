"""Embedded backbones: the GGUF shipped inside a PyPI package, dequantised by transformers once and cached
as safetensors under ``$PRISM_CACHE/backbones/<name>/`` with a manifest (sha256 of every file, source
package and version) checked on every load.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import torch
from filelock import FileLock
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

from prism.backbones import MANIFEST, BackboneSpec, cache_root, gguf_path
from prism.fileio import sha256_file

_MANIFEST_FORMAT = 1


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cache_is_valid(directory: Path, spec: BackboneSpec) -> bool:
    """The manifest exists, names this source (and the installed version, when installed), and every
    listed file exists with the recorded sha256."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    installed = _installed_version(spec.source)
    if manifest.get("format") != _MANIFEST_FORMAT or manifest.get("source_package") != spec.source:
        return False
    if installed is not None and manifest.get("source_version") != installed:
        return False
    files = manifest.get("files") or {}
    if not any(name.endswith(".safetensors") for name in files):
        return False
    return all((directory / name).is_file() and sha256_file(directory / name) == digest
               for name, digest in files.items())


def _load_gguf(spec: BackboneSpec) -> tuple[PreTrainedModel, PreTrainedTokenizerFast, str]:
    """Dequantise the spec's GGUF with transformers (fp32); return model, tokenizer and file name."""
    gguf = gguf_path(spec)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer, gguf.name


def _convert_gguf(spec: BackboneSpec, target: Path) -> None:
    """Write the dequantised checkpoint + tokenizer + manifest into a temporary directory next to
    ``target``, then move it into place (rename), replacing an invalid previous cache."""
    model, tokenizer, gguf_name = _load_gguf(spec)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        files = {p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file()}
        manifest = {"format": _MANIFEST_FORMAT, "backbone": spec.name, "source_package": spec.source,
                    "source_version": _installed_version(spec.source), "gguf_file": gguf_name,
                    "files": files}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def embedded_checkpoint(spec: BackboneSpec) -> Path:
    """The validated safetensors cache directory of an embedded backbone, (re)built when missing,
    incomplete or corrupt. A file lock serialises concurrent builders."""
    target = cache_root() / "backbones" / spec.name
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f"{spec.name}.lock")):
        if not _cache_is_valid(target, spec):
            _convert_gguf(spec, target)
    return target
