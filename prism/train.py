"""One training loop for every method, private or not (docs/DECISIONS.md D1–D3, D7, Algorithm 1).

Every method gets the same Poisson sampler, σ (PRV-calibrated for the exact number of steps), clipping
norm C and number of steps; they differ only in the :class:`~prism.methods.base.Method` that clips,
noises and updates. A private selection's candidate (``privacy.selection``, docs/PRIVACY.md "ε includes
tuning") trains at the selection's σ (:func:`prism.privacy.selection.calibrate_candidate_sigma`) from seeds
of its own, outside the validation rows, and publishes the noised count of its correct validation rows.
The two privacy switches, ``privacy.noise_source`` (``os``: every step is checkpointed before it is
logged) and ``privacy.log_private_stats`` (off: :data:`PRIVATE_STATS` and :data:`prism.record.PRIVATE_FINAL` are
dropped from the logs), are explained in docs/PRIVACY.md.
"""
from __future__ import annotations

import copy
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from prism.checkpoint import load_checkpoint, restore_rng_states, rng_states, save_checkpoint
from prism.data import Suite, build_suite, sub_seed
from prism.data.config import SuiteConfig
from prism.data.custom import TASK, answer_room, check_task, validating
from prism.data.prompts import collate, tokenize_example, tokenize_train_set
from prism.evaluation.evaluate import evaluate_suite, new_tokens
from prism.fastpath.prefix import PrefixCache, prefix_cache
from prism.fastpath.transfer import batch_to_device
from prism.job import JobConfig, SelectionConfig, job_of
from prism.methods import PrivacySpec, build_method
from prism.methods.base import Method
from prism.methods.hf_baseline import HFRecipe, HFTrainerBaseline, holdout_loss, holdout_split
from prism.methods.registry import lookup
from prism.models import (
    BackboneLoader,
    attach_lora,
    cache_root,
    export_adapter,
    load_backbone,
    peak_memory_mb,
    trainable_parameters,
)
from prism.models.local import describe, speed_paths
from prism.privacy import (
    Accountant,
    PerExampleGradients,
    PoissonSampler,
    calibrate_for_run,
    summed_gradients,
)
from prism.privacy.accounting import is_private
from prism.privacy.budget import total_steps
from prism.privacy.noise import NoiseSource, SecureNoise, SeededNoise
from prism.privacy.per_example import TokenBatch, enable_activation_checkpointing, supervised_positions
from prism.privacy.protocol import dp_caveats, protocol_record
from prism.privacy.sampling import noise_denominator
from prism.privacy.selection import calibrate_candidate_sigma, noised_count, selection_epsilon
from prism.record import FinalRecord, SelectionBlock

LogFn = Callable[[dict[str, Any]], None]
narrate = logging.getLogger("prism.train").info  # one line per phase (pipelines/runs/runner.py prints it)
# Per-step record fields computed from un-noised data, not covered by ε (docs/PRIVACY.md).
PRIVATE_STATS = ("loss", "clip_fraction", "grad_norm_mean", "noise_norm", "batch_size", "step_time_s")
log = logging.getLogger(__name__)


class TrainingDivergedError(RuntimeError):
    """A non-finite loss, gradient or factor: the run stops, its last checkpoint is kept."""


@dataclass
class Setup:
    """Everything the loop needs, built once per run."""

    model: nn.Module
    tokenizer: Any
    suite: Any
    features: list[dict[str, list[int]]]
    params: dict[str, nn.Parameter]
    method: Method
    sampler: PoissonSampler
    accountant: Accountant
    noise: NoiseSource
    gradients: Callable[[dict[str, Any]], tuple[Tensor, dict[str, Tensor]]]
    sigma: float
    device: torch.device
    prefix: PrefixCache | None  # exact cache of the frozen lower layers' hidden states (None: full forward)
    secure: bool = False  # privacy.noise_source=os: no RNG state to checkpoint; every step checkpointed
    validation: Suite | None = None  # the validation rows a selection's candidate scores (None: an ordinary run)


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present; nothing assumes a GPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no GPU is visible; use train.device=auto or cpu")
    return torch.device(name)


def logs_private_stats(cfg: JobConfig | DictConfig) -> bool:
    """``privacy.log_private_stats``: whether the logs may carry times, memory and :data:`PRIVATE_STATS`."""
    return bool(cfg.privacy.log_private_stats)


def public_record(record: dict[str, Any], log_private_stats: bool) -> dict[str, Any]:
    """``record`` without :data:`PRIVATE_STATS` unless ``privacy.log_private_stats``."""
    return record if log_private_stats else {k: v for k, v in record.items() if k not in PRIVATE_STATS}


def selection_of(cfg: JobConfig | DictConfig) -> SelectionConfig | None:
    """``privacy.selection`` of a private run (a selection's candidate), else None."""
    job = job_of(cfg)
    return job.privacy.selection if is_private(job) else None


def run_seed(cfg: JobConfig | DictConfig) -> int:
    """The seed of the initialisation, the batches and the noise: ``seed``, or for candidate k of a private
    selection one derived from ``seed`` and k, so that its candidates are independent runs."""
    selection = selection_of(cfg)
    return cfg.seed if selection is None else sub_seed(cfg.seed, "selection-candidate", str(selection.candidate))


def validation_node(suite: SuiteConfig) -> SuiteConfig:
    """``suite`` scoring its validation rows (``suite.eval_split=validation``): what a selection's candidate
    scores. Its other fields stay as checked (a custom task's validation rows are drawn by
    ``suite.custom.validation_fraction``, without ``suite.validation_per_task``)."""
    node = copy.copy(suite)
    node.eval_split = "validation"
    return node


def build(cfg: JobConfig | DictConfig, suite: Suite | None = None, load: BackboneLoader = load_backbone) -> Setup:
    """Model, data, privacy calibration and method for one job (a :class:`~prism.job.JobConfig`, or a resolved
    config :func:`prism.job.job_of` types; ``suite``: a prebuilt one, e.g. ``make gpu-check``'s; ``load``:
    :func:`prism.models.load_backbone` or :class:`prism.models.KeptBackbones`)."""
    cfg = job_of(cfg)
    selection, seed = selection_of(cfg), run_seed(cfg)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    device = resolve_device(cfg.train.device)
    narrate("building suite %s (%s scale)", cfg.suite.name, cfg.suite.scale)
    suite = suite if suite is not None else build_suite(cfg.suite, cfg.seed)  # before the model: a data error costs no model load
    validation = None
    if selection is not None:  # a candidate trains outside the validation rows it scores (the scored tasks')
        validation = build_suite(validation_node(cfg.suite), cfg.seed)
        suite.train, validation.eval = validation.train, {t: validation.eval[t] for t in suite.eval}
    recipe = HFRecipe.from_config(cfg, len(suite.train))  # train.nondp_trainer=hf: docs/DECISIONS.md D7
    if recipe is not None:
        suite.train, holdout = holdout_split(suite.train, recipe.holdout, cfg.seed)
    n_train = len(suite.train)
    if cfg.train.batch_size > n_train:
        raise ValueError(f"train.batch_size={cfg.train.batch_size} is larger than the {n_train} training examples "
                         f"of suite {suite.name}; lower train.batch_size")
    narrate("loading backbone %s on %s (an embedded one is converted from its GGUF on first use, ~1 min)",
            cfg.backbone.name, device)
    model, tokenizer = load(cfg.backbone, device)
    if suite.source:  # suite=custom: every training row's length again, with the loaded tokenizer
        count = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
        check_task(cfg.suite.custom, cfg.train.batch_size, suite.cutoff_len, count, cfg.backbone.name,
                   validating(cfg.suite, selection is not None))
        if warning := answer_room(suite.train, count, new_tokens(cfg.suite.decoding, TASK)):
            log.warning(warning)
    model = attach_lora(model, cfg.lora, cfg.backbone, init=cfg.method.init,
                        generator=torch.Generator().manual_seed(seed), init_svd=cfg.method.init_svd)
    narrate("%s; %s", describe(model), speed_paths(model, cfg.train.prefix_cache))
    features = tokenize_train_set(tokenizer, suite.train, suite.cutoff_len, suite.train_on_inputs, cfg.backbone.name)
    secure = cfg.privacy.noise_source == "os"  # the sampler and the noise draw from the OS CSPRNG
    sampler = PoissonSampler(n_train, cfg.train.batch_size, generator_seed=seed + 1, secure=secure)
    dp = is_private(cfg)
    sigma = 0.0
    if selection is not None:  # the whole selection is (ε, δ)-DP, every candidate and score included (RDP)
        sigma = calibrate_candidate_sigma(cfg.privacy.epsilon, cfg.privacy.delta, sampler.sample_rate, total_steps(cfg),
                                          score_sigma=selection.score_noise, mean=selection.mean, shape=selection.shape)
    elif dp:
        sigma = calibrate_for_run(cfg.privacy.epsilon, cfg.privacy.delta, sampler.sample_rate, total_steps(cfg),
                                  cfg.privacy.calibration, cache_dir=cache_root() / "sigma")
    for caveat in dp_caveats(cfg, lookup(cfg.method).tangent):  # protocol=released: docs/DECISIONS.md
        log.warning("NOT a valid DP guarantee as stated: %s", caveat)
    params = trainable_parameters(model)
    privacy = PrivacySpec(sigma=sigma, clip_norm=cfg.privacy.clip_norm) if dp else None
    method = build_method(cfg.method, params, privacy)
    params = {name: p for name, p in params.items() if p.requires_grad}  # FFA freezes peft lora_A
    narrate("frozen-prefix cache (train.prefix_cache=%s) for %d training examples", cfg.train.prefix_cache,
            len(features))
    prefix = prefix_cache(model, features, cfg.train.prefix_cache, name=cfg.backbone.name)
    if recipe is not None:  # hold-out rows replay from their own frozen-prefix states too
        held = [tokenize_example(tokenizer, ex, suite.cutoff_len, suite.train_on_inputs) for ex in holdout]
        held_prefix = prefix_cache(model, held, cfg.train.prefix_cache, name=cfg.backbone.name)
        method = HFTrainerBaseline(method, recipe, lambda: holdout_loss(
            model, held, tokenizer.pad_token_id, cfg.train.eval_batch_size, device, held_prefix))
    noise = SecureNoise() if secure else SeededNoise(torch.Generator(device=device).manual_seed(seed + 2))
    if cfg.train.activation_checkpointing:
        enable_activation_checkpointing(model)
    if dp:
        per_example = PerExampleGradients(model, scale=cfg.privacy.per_example_scale,
                                          released_power=method.per_example_power)  # never wrapped under DP
        gradients = lambda batch: per_example.compute(**batch)  # noqa: E731
    else:
        gradients = lambda batch: summed_gradients(model, **batch)  # noqa: E731
    return Setup(model, tokenizer, suite, features, params, method, sampler, Accountant(), noise,
                 gradients, sigma, device, prefix, secure=secure, validation=validation)


def micro_batch(s: Setup, indices: list[int], padding_side: str = "right") -> dict[str, Any]:
    """From the prefix cache when there is one, else tokens collated on the host (padded on
    ``padding_side``) with their supervised positions, copied without a device sync."""
    if s.prefix is not None:
        return s.prefix.batch(indices)
    host = collate([s.features[i] for i in indices], pad_id=s.tokenizer.pad_token_id, padding_side=padding_side)
    host["positions"], host["targets"] = supervised_positions(host["labels"], host["attention_mask"])
    dev = batch_to_device(host, s.device)
    return {"loss_fn": TokenBatch(dev["input_ids"], dev["attention_mask"], dev["labels"],
                                  (dev["positions"], dev["targets"]))}


def _check_finite(loss_sum: Tensor, params: dict[str, Tensor]) -> None:
    """Stop unless the summed loss plus one fused max-norm over the updated parameters is finite: one
    device sync per step covers losses, gradients (they reach the parameters through the update) and
    factors; the max-norm, unlike the 2-norm, cannot overflow on finite entries."""
    norms = torch._foreach_norm(list(params.values()), ord=math.inf)
    if bool(torch.isfinite(loss_sum.float() + torch.stack(norms).float().sum())):
        return
    bad = "loss" if not bool(torch.isfinite(loss_sum)) else "factor " + next(
        name for name, norm in zip(params, norms) if not bool(torch.isfinite(norm)))
    raise TrainingDivergedError(f"non-finite {bad} after the update; the run stopped and its last checkpoint is "
                                "kept (lower method.lr or check the data)")


def _to_host(record: dict[str, Any]) -> dict[str, Any]:
    """A step record with its device scalars read back in one transfer (only when it is logged)."""
    keys = [k for k, v in record.items() if isinstance(v, Tensor)]
    if not keys:
        return record
    values = torch.stack([record[k].detach().double().reshape(()) for k in keys]).cpu().tolist()
    return {**record, **dict(zip(keys, values))}


def _state(s: Setup, step: int) -> dict[str, Any]:
    """Checkpoint contents (with ``noise_source: os`` there is no sampler or noise RNG state)."""
    state = {
        "step": step,
        "params": {name: p.detach().cpu().clone() for name, p in s.params.items()},
        "method": s.method.state_dict(),
        "accountant": s.accountant.state_dict(),
        **rng_states(),
    }
    if not s.secure:
        state.update(sampler=s.sampler.state_dict(), noise_rng=s.noise.generator.get_state())
    return state


def _restore(s: Setup, state: dict[str, Any]) -> int:
    with torch.no_grad():
        for name, p in s.params.items():
            p.copy_(state["params"][name].to(p.device))
    s.method.load_state_dict(state["method"])
    if not s.secure:  # noise_source=os: fresh entropy continues the run
        s.sampler.load_state_dict(state["sampler"])
        s.noise.generator.set_state(state["noise_rng"])
    s.accountant.load_state_dict(state["accountant"])
    restore_rng_states(state)
    return int(state["step"])


def train_step(s: Setup, cfg: JobConfig, diagnostics: bool = True, indices: Tensor | None = None) -> dict[str, Any]:
    """One logical step: Poisson batch → micro-batches → clip & sum → noise once → update; statistics stay 0-dim
    device tensors (``diagnostics``, off only in mechanism benchmarks: the noise and update norms too).
    ``indices``: the logical batch, drawn from the sampler when None (the record-and-replay audit,
    :mod:`prism.audit.neighbours`, passes one draw with a row forced in and out). Under DP the finite check
    reads the updated factors only, never the loss: a non-finite example contributes nothing to the clipped
    sum, so the stop depends on the release alone (docs/PRIVACY.md)."""
    indices = s.sampler.sample() if indices is None else indices
    if s.method.dp:
        s.accountant.step(noise_multiplier=s.sigma, sample_rate=s.sampler.sample_rate)
    s.method.zero_accumulators()
    if len(indices) == 0:
        # DP: the noisy step is released on an empty batch too (noise only, the same σC/B), since
        # skipping it would reveal that the batch was empty. Non-DP: nothing to average.
        stats = s.method.step(float(cfg.train.batch_size), s.noise, diagnostics) if s.method.dp else {}
        _check_finite(torch.zeros(()), s.params)  # a non-finite noise draw stops here too (0-dim: any device)
        return {"batch_size": 0, **stats}
    loss_sum = torch.zeros((), device=s.device)
    for chunk in indices.split(cfg.train.micro_batch_size):
        loss, grads = s.gradients(micro_batch(s, chunk.tolist(), cfg.train.padding_side))
        s.method.accumulate(grads)
        loss_sum = loss_sum + loss.detach().float().sum()
    denominator = (noise_denominator(cfg.privacy.denominator, len(indices), cfg.train.batch_size)
                   if s.method.dp else len(indices))
    stats = s.method.step(float(denominator), s.noise, diagnostics)
    _check_finite(torch.zeros(()) if s.method.dp else loss_sum, s.params)
    return {"loss": loss_sum / len(indices), "batch_size": len(indices), **stats}


def train_and_evaluate(cfg: JobConfig | DictConfig, run_dir: Path, log_fn: LogFn | None = None,
                       load: BackboneLoader = load_backbone) -> dict[str, Any]:
    """Train (resuming from ``run_dir/checkpoint`` when present), evaluate, return the final record
    (``cfg`` and ``load``: as in :func:`build`)."""
    started = time.time()
    cfg = job_of(cfg)
    s = build(cfg, load=load)
    log = log_fn or (lambda record: None)
    ckpt_dir = Path(run_dir) / "checkpoint"
    state = load_checkpoint(ckpt_dir)
    start = _restore(s, state) if state is not None else 0
    if start:
        narrate("resuming from the checkpoint of step %d (%s)", start, ckpt_dir)
    elif (Path(run_dir) / "metrics.jsonl").exists():
        narrate("no checkpoint in %s: training starts again at step 1", ckpt_dir)
    initial = {name: p.detach().clone() for name, p in s.params.items()}
    benchmark = cfg.train.benchmark
    steps = total_steps(cfg)
    step_times, empty = [], 0
    log_private = logs_private_stats(cfg)
    if s.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(s.device)
    narrate("training: steps %d..%d of %d (σ = %.4g, q = %.4g)", start + 1, steps, steps, s.sigma, s.sampler.sample_rate)
    for step in range(start, steps):
        tic = time.perf_counter()
        record = _to_host(train_step(s, cfg))
        if s.device.type == "cuda":
            torch.cuda.synchronize(s.device)
        record.update(step=step + 1, sigma=s.sigma, step_time_s=time.perf_counter() - tic)
        if s.method.dp:
            record["epsilon_spent"] = s.accountant.epsilon(cfg.privacy.delta)
        empty += record["batch_size"] == 0
        step_times.append(record["step_time_s"])
        if step == start and record["batch_size"] > 0:
            _assert_moved(s.params, initial)
        if not s.secure:  # seeded: a replayed step is bitwise the same, so log first and lose no line
            log(public_record(record, log_private))
        if not benchmark and (s.secure or (step + 1) % cfg.train.checkpoint_every == 0 or step + 1 == steps):
            save_checkpoint(ckpt_dir, _state(s, step + 1))  # os noise: every step, before its line is logged
        if s.secure:
            log(public_record(record, log_private))
    train_time = time.time() - started
    measured = step_times[benchmark.warmup:] if benchmark else step_times
    record = FinalRecord(
        sigma=s.sigma,
        sample_rate=s.sampler.sample_rate,
        steps=steps,
        empty_batches=empty,
        n_train=len(s.suite.train),
        epsilon_spent=s.accountant.epsilon(cfg.privacy.delta) if s.method.dp else math.inf,
        peak_memory_mb=peak_memory_mb(s.device),
        train_time_s=train_time,
        prefix_depth=s.prefix.depth if s.prefix is not None else None,
        prefix_build_s=s.prefix.build_seconds if s.prefix is not None else 0.0,
        protocol=protocol_record(cfg, lookup(cfg.method).tangent),
        step_time_s=float(np.mean(measured)) if measured else float("nan"),
    )
    if not benchmark:
        if isinstance(s.method, HFTrainerBaseline):  # released non-DP recipe: the best hold-out checkpoint
            record = replace(record, best_step=s.method.restore_best())
        if selection_of(cfg) is not None:
            record = replace(record, selection=_selection_score(s, cfg))
        narrate("evaluating %d tasks (%d rows)", len(s.suite.eval), sum(map(len, s.suite.eval.values())))
        record = record.with_evaluation(evaluate_suite(s.model, s.tokenizer, s.suite, cfg.suite.decoding,
                                                       cfg.train.eval_batch_size))
        export_adapter(s.model, Path(run_dir) / "adapter")
    record = replace(record, wall_time_s=time.time() - started)
    return (record if log_private else record.without_private()).to_json()


class _SecureDraws:
    """``normal(loc, scale)`` from the OS CSPRNG (:class:`prism.privacy.noise.SecureNoise`), for :func:`noised_count`."""

    def normal(self, loc: float, scale: float) -> float:
        return loc + scale * float(SecureNoise().normal((1,), torch.device("cpu")))


def _selection_score(s: Setup, cfg: JobConfig) -> SelectionBlock:
    """A candidate's :class:`~prism.record.SelectionBlock`: the count of
    its correct validation rows plus Gaussian noise of ``privacy.selection.score_noise`` rows (a generator
    seeded by the run seed, the cell (method, suite, ε) and the candidate, so that no two cells share a
    score's noise, or the OS CSPRNG under ``privacy.noise_source=os``), and the
    selection's ε. The per-row outcomes and the un-noised count are neither logged nor kept."""
    selection = cfg.privacy.selection
    narrate("scoring the validation rows (only their noised count is kept)")
    outcomes = evaluate_suite(s.model, s.tokenizer, s.validation, cfg.suite.decoding, cfg.train.eval_batch_size)
    correct = np.concatenate([outcomes["per_example"][task]["correct"] for task in s.validation.eval])
    draws = _SecureDraws() if s.secure else np.random.default_rng(
        sub_seed(cfg.seed, "selection-score", cfg.method.name, cfg.suite.name, str(cfg.privacy.epsilon),
                 str(selection.candidate)))
    knobs = dict(score_sigma=selection.score_noise, mean=selection.mean, shape=selection.shape)
    epsilon = selection_epsilon(s.sigma, s.sampler.sample_rate, total_steps(cfg), cfg.privacy.delta, **knobs)
    return SelectionBlock(score=noised_count(correct, knobs["score_sigma"], draws), rows=int(correct.size),
                          candidate=selection.candidate, mean=knobs["mean"], shape=knobs["shape"],
                          score_noise=knobs["score_sigma"], sigma=s.sigma, epsilon=epsilon)


def _assert_moved(params: dict[str, nn.Parameter], initial: dict[str, Tensor]) -> None:
    """Guard against a known silent failure: an update that never reaches the LoRA weights."""
    if all(torch.equal(p.detach(), initial[name]) for name, p in params.items()):
        raise RuntimeError("the LoRA weights did not change after the first update: the optimizer is not wired to "
                           "the model's trainable parameters (check the peft/Opacus wrapping)")
