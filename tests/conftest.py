"""Shared test set-up: offline, single-threaded, seeded; `slow` tests only under `make test-all`.

Besides the fixtures, the test doubles several files build on (test files never import each other):
the tiny-run override list, a character tokenizer, a tiny random causal LM with LoRA, a fake run
folder, and one LoRA pair with its method and a fake training set-up.
"""
from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from torch import nn  # noqa: E402

from prism.methods import build_method  # noqa: E402
from prism.methods.base import PrivacySpec  # noqa: E402
from prism.privacy import Accountant  # noqa: E402
from tests.oracles import grads_of  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
TEST_DATA = Path(os.environ.get("PRISM_TEST_DATA") or REPO.parent / "shared" / "data")
"""Real data a few tests read, never committed: ``$PRISM_TEST_DATA``, by default ``shared/data`` beside the
checkout. A test whose data is absent skips."""
TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]
"""The LoRA target modules of every tiny model."""


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def llm_adapters_dir() -> Path:
    """The LLM-Adapters files (``ft-training_set/``, ``dataset/<test set>/``) under :data:`TEST_DATA`; skip
    when absent."""
    path = TEST_DATA / "llm-adapters"
    if not path.is_dir():
        pytest.skip(f"{path} not present (set PRISM_TEST_DATA to a folder that holds llm-adapters/)")
    return path


# ------------------------------------------------------------------------------ a tiny training run
TINY_RUN = [
    "backbone=tiny-llama",
    "suite=glue8",
    "suite.cutoff_len=1024",  # the byte tokenizer needs room for the response after the prompt
    "suite.embedded.train_per_task=16",
    "suite.embedded.eval_per_task=2",
    "suite.decoding.max_new_tokens=2",
    "train.steps=3",
    "train.batch_size=8",
    "train.micro_batch_size=4",
    "train.checkpoint_every=1",
    "logging=disabled",
]
"""Overrides that make the real loop run in seconds: the random tiny-llama backbone, 32 training and
4 evaluation rows, 3 steps of batch 8."""


def tiny_cfg(*overrides: str) -> DictConfig:
    """The resolved job config of :data:`TINY_RUN` with ``overrides``."""
    from pipelines.config.compose import compose_config, resolve

    return resolve(compose_config([*TINY_RUN, *overrides]))


DECODING = {"num_beams": 1, "max_new_tokens": 8, "prompt_encoding": "text", "renormalize_logits": False,
            "remove_invalid_values": False, "choice_regex": "lookaround", "shared_prefix": True,
            "frozen_prefix": True}
"""A complete ``suite.decoding`` node: greedy, 8 new tokens, each prompt tokenized alone."""


def suite_node(name: str, scale: str = "embedded", embedded: dict | None = None, **keys: Any) -> dict:
    """A complete ``suite`` node of suite ``name`` at ``scale`` for :func:`prism.data.build_suite`: its
    family's template, Table 7's cut-off and loss, :data:`DECODING`, no row limit, the rows following the run
    seed; with ``embedded``, that stand-in node training on every task and scoring them all; ``keys`` set the
    rest."""
    from prism.data.embedded import EMBEDDED_TASKS

    family = "math" if name == "math10k" else "glue"
    node = {"name": name, "scale": scale, "family": family, "train_on_inputs": family == "math",
            "cutoff_len": 384 if family == "glue" else 256, "eval_limit": None, "decoding": DECODING, **keys}
    if embedded is not None:
        node["embedded"] = {"tasks": list(EMBEDDED_TASKS.get(name, ())), "unscored": [], **embedded}
    return node


TINY_JOB = ["backbone=tiny-llama", "backbone.lora_layers=null", "train.batch_size=4", "suite.eval_limit=2",
            "suite.cutoff_len=1024", "suite.embedded.train_per_task=16", "logging=disabled"]
"""The same tiny backbone for jobs a launcher or worker runs (each test adds its suite, method, steps,
micro-batch and checkpoint interval): LoRA on every layer, batch 4, 2 evaluation rows."""


def adapter_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    """The exported adapter's tensors of a finished run folder."""
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


# ------------------------------------------------------------------------------ a character tokenizer
def char_tokenizer() -> Any:
    """One token per printable ASCII character; <pad>=0, <eos>=1, <unk>=2; no BOS; exact round trip."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({c: i + 3 for i, c in enumerate(sorted(set(string.printable)))})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


# ------------------------------------------------------------------------------ a tiny causal LM
VOCAB = 96
N_LAYERS = 4
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
LENGTHS = [11, 6, 14, 9, 7, 12]


def tiny_model(family: str, dtype: torch.dtype = torch.float64, lora_layers: list[int] | None = None,
               **config: object) -> nn.Module:
    """Random 4-layer causal LM with LoRA (lora_B non-zero) on ``lora_layers`` (default: the top 2)."""
    from peft import LoraConfig, get_peft_model
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    attn = "sdpa" if dtype == torch.float64 and family != "gemma2" else "eager"  # Gemma-2 has no SDPA
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=N_LAYERS,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                 attn_implementation=attn, **config)
    torch.manual_seed(7)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    elif family == "gemma3":  # sliding window 3 < sequence lengths: both attention types exercised above d
        model = Gemma3ForCausalLM(Gemma3TextConfig(**shape, sliding_window=3, layer_types=LAYER_TYPES))
    else:  # eager: window 10 > any padding run (a fully masked padding row is NaN in float64), < longest row
        model = Gemma2ForCausalLM(Gemma2Config(**shape, sliding_window=10, layer_types=LAYER_TYPES))
    layers = lora_layers if lora_layers is not None else [2, 3]
    model = get_peft_model(model.to(dtype), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS,
                                                        layers_to_transform=layers, layers_pattern="layers"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    return model


def features(lengths: list[int] = LENGTHS, seed: int = 0) -> list[dict[str, list[int]]]:
    """Token rows of :func:`tiny_model`'s vocabulary whose last 3 tokens are supervised (row 1: none)."""
    from prism.privacy.per_example import IGNORE_INDEX

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
        labels = [IGNORE_INDEX] * n if i == 1 else [IGNORE_INDEX] * (n - 3) + ids[n - 3:]
        rows.append({"input_ids": ids, "labels": labels})
    return rows


# ------------------------------------------------------------------------------ a fake run folder
def _rows(column: str, score: float, n: int = 200) -> dict:
    """Per-row outcomes of ``n`` evaluation rows whose mean is ``score`` (to 1/n)."""
    right = round(score * n)
    return {"column": column, "correct": [1] * right + [0] * (n - right), "rows": f"rows-{column}"}


def make_run(root: Path, run_hash: str, *, method: str, privacy: str, suite: str, columns: dict | None = None,
             state: str = "finished", scale: str = "embedded", r: int = 16, backbone: str = "smollm2-135m",
             paper_name: str = "gemma-3-4b-pt", final_text: str | None = None, status_text: str | None = None,
             experiment: str | None = None, seed: int = 42, steps: int = 30, epsilon: float | None = None,
             extra_config: dict | None = None, **final_extra) -> Path:
    """A run folder at ``root/<run_hash>`` (``root``: the store), tagged into the view of ``experiment``
    when given."""
    from pipelines.runs import store

    folder = root / run_hash
    folder.mkdir(parents=True)
    if experiment:
        store.tag(root, experiment, run_hash)
    eps = {"nondp": math.inf, "eps6": 6.0, "eps3": 3.0}[privacy] if epsilon is None else epsilon
    config = {"seed": seed, "backbone": {"name": backbone, "paper_name": paper_name},
              "suite": {"name": suite, "scale": scale}, "method": {"name": method},
              "privacy": {"name": privacy, "epsilon": eps}, "lora": {"r": r},
              "train": {"steps": steps, "batch_size": 16}, "experiment": experiment or root.name,
              **(extra_config or {})}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    status = {"state": state} if state != "failed" else {"state": "failed", "error": "CUDA out of memory"}
    (folder / "status.json").write_text(status_text if status_text is not None else json.dumps(status))
    if state == "finished":
        run = store.RunBlock(hash=run_hash, experiment=experiment or root.name, attempts=1, versions={},
                             git_commit=final_extra.pop("git_commit", None),
                             git_dirty=final_extra.pop("git_dirty", None), hostname="test").to_json()
        final = {"scores": {}, "columns": columns or {}, "epsilon_spent": eps if eps == math.inf else eps - 0.01,
                 "per_example": {c: _rows(c, v) for c, v in (columns or {}).items()}, "run": run, **final_extra}
        (folder / "final.json").write_text(final_text if final_text is not None else json.dumps(final))
    return folder


# ------------------------------------------------------------------------------ one LoRA pair and its method
M, N, R = 7, 6, 3
"""The pair's shapes: A [M, R], B [N, R] (the paper's ΔW = A Bᵀ is M × N)."""
F64 = torch.float64


def method_cfg(name: str, **overrides: Any) -> DictConfig:
    """``conf/method/<name>.yaml`` with a fixed float lr (the yaml's lr interpolates the suite)."""
    cfg = OmegaConf.load(REPO / "conf" / "method" / f"{name}.yaml")
    cfg.lr = 0.05
    return OmegaConf.merge(cfg, overrides)


def pair_params(A: torch.Tensor, B: torch.Tensor) -> dict[str, nn.Parameter]:
    """peft names for one module: lora_B = A [m, r], lora_A = Bᵀ [r, n]."""
    return {"x.lora_A.default.weight": nn.Parameter(B.T.clone()),
            "x.lora_B.default.weight": nn.Parameter(A.clone())}


def tiny_pair_params(seed: int) -> dict[str, nn.Parameter]:
    """A random pair of the shapes :data:`M`, :data:`N`, :data:`R`."""
    g = torch.Generator().manual_seed(seed)
    return pair_params(torch.randn(M, R, generator=g), torch.randn(N, R, generator=g))


def conditioned(rows: int, kappa: float, g: torch.Generator) -> torch.Tensor:
    """A random [rows, R] matrix with singular values log-spaced from 1 down to 1/kappa."""
    Q, _ = torch.linalg.qr(torch.randn(rows, R, generator=g, dtype=F64))
    P, _ = torch.linalg.qr(torch.randn(R, R, generator=g, dtype=F64))
    return (Q * torch.logspace(0.0, -torch.log10(torch.tensor(kappa)).item(), R, dtype=F64)) @ P.T


def fake_setup(params: dict[str, nn.Parameter], secure: bool = False) -> SimpleNamespace:
    """What train_step / train_and_evaluate read from a Setup, around a real method, sampler and
    accountant; per-example gradients of ⟨G_i, ABᵀ⟩ for random G_i stand in for the model."""
    from prism.mechanism.lora import lora_pairs, read_pair
    from prism.privacy import PoissonSampler
    from prism.privacy.noise import SecureNoise, SeededNoise

    g = torch.Generator().manual_seed(9)
    A, B = (x.detach() for x in read_pair(params, lora_pairs(params)[0]))

    def gradients(indices: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        G = torch.randn(len(indices), M, N, generator=g, dtype=F64)
        return G.square().mean((1, 2)), grads_of(A, B, G, torch.float32)

    return SimpleNamespace(
        sampler=PoissonSampler(16, 4, generator_seed=1, secure=secure), accountant=Accountant(), sigma=1.0, params=params,
        method=build_method(method_cfg("prism"), params, PrivacySpec(sigma=1.0, clip_norm=1.0)),
        noise=SecureNoise() if secure else SeededNoise(torch.Generator().manual_seed(2)), gradients=gradients,
        device=torch.device("cpu"), prefix=None, suite=SimpleNamespace(train=list(range(16))), secure=secure,
    )
