"""`make gpu-check`: the paper's Table 5 on a random-initialised paper backbone, and the GPU-only paths.

No download: the model is built from ``conf/gpu_check/`` with random weights and the data are synthetic
rows of the paper's Math-10K length, under the paper's policy (bf16 frozen base, fp32 LoRA r = 16 with
dropout 0.05, ε = 6, B = 64, micro-batch 4). It prints Table 5 with the host syncs and kernel launches of
one logical step, runs a ``generate`` call of the trained PRISM model, and a save / kill / resume cycle of
PRISM that must end bitwise equal to an uninterrupted run (docs/GPU.md). Profiles: ``paper`` (GPU), ``sim``
(paper widths, 2 layers, for a CPU), ``tiny`` (seconds on a CPU: the test suite runs it). Exit status 1
when anything fails or a loss is non-finite.

    python -m pipelines gpu-check [profile=paper|sim|tiny] [device=cuda|cpu] [methods=prism,adamw]
"""
from __future__ import annotations

import functools
import gc
import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from pipelines.config.compose import compose_config, resolve
from pipelines.config.grids import comma_list
from prism import train as T
from prism.checkpoint import load_checkpoint, save_checkpoint
from prism.data import Example, Suite
from prism.data.prompts import train_prompt
from prism.models import peak_memory_mb

TABLE5 = (("DP-AdamW", "adamw", "eps6"), ("DP-LoRA+", "loraplus", "eps6"), ("PRISM", "prism", "eps6"),
          ("non-private", "adamw", "nondp"))
"""Table 5 rows: label, ``method``, ``privacy``; ratios are to the first row."""

CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls that block the host until the device catches up."""
CPU_SYNCS = ("aten::_local_scalar_dense", "aten::nonzero")
"""On a CPU: the ops that would read a device value on the host (``item``/``bool``/``int``, ``nonzero``)."""


@dataclass(frozen=True)
class Profile:
    """One gpu-check setting: backbone, device, batch geometry, synthetic data and step counts."""

    backbone: str
    device: str
    batch_size: int
    micro_batch_size: int
    cutoff_len: int
    examples: int
    warmup: int
    measure: int
    resume_steps: int  # per half of the save / kill / resume cycle
    resume_batch_size: int


PROFILES = {
    "paper": Profile("gemma-3-4b-pt-random", "cuda", batch_size=64, micro_batch_size=4, cutoff_len=256,
                     examples=256, warmup=1, measure=3, resume_steps=2, resume_batch_size=8),
    "sim": Profile("gemma-3-4b-pt-2layers-random", "cpu", batch_size=8, micro_batch_size=4, cutoff_len=256,
                   examples=32, warmup=1, measure=1, resume_steps=1, resume_batch_size=4),
    "tiny": Profile("tiny-gemma3-mm", "cpu", batch_size=8, micro_batch_size=4, cutoff_len=256, examples=32,
                    warmup=0, measure=1, resume_steps=1, resume_batch_size=8),
}


@dataclass
class Row:
    """One Table 5 row as measured."""

    label: str
    step_s: float
    peak_mb: float
    syncs: int
    kernels: int
    loss: float


# ---------------------------------------------------------------------------------------------- setup
def synthetic_suite(examples: int, cutoff_len: int, seed: int = 0) -> Suite:
    """Math-10K-shaped training rows of seeded random words: a prompt and a numeric answer whose
    byte-level tokenisation fills ``cutoff_len`` (the response carries the loss, as in training)."""
    rng = random.Random(seed)
    words = ("apples", "train", "sum", "twice", "left", "how", "many", "each", "total", "costs", "per", "more")

    def text(n_chars: int) -> str:
        out = ""
        while len(out) < n_chars:
            out += f"{rng.choice(words)} {rng.randint(0, 999)} "
        return out[:n_chars]

    template = len(train_prompt(Example("synthetic", "", "", "", 0)))  # the instruction template's bytes
    if cutoff_len < template + 16:
        raise ValueError(f"cutoff_len={cutoff_len} leaves no room for a response after the {template}-byte template")
    response = min(64, cutoff_len // 4)
    rows = [Example(task="synthetic", instruction=text(max(8, cutoff_len - template - response)), input="",
                    output=text(response) + str(i), answer=i) for i in range(examples)]
    return Suite(name="gpu-check", scale="paper", family="math", train=rows, eval={}, train_on_inputs=False,
                 cutoff_len=cutoff_len, task_columns={})


def job_config(profile: Profile, method: str, privacy: str, batch_size: int, steps: int,
               device: str) -> object:
    """The resolved run config: paper scale (bf16 base, fp32 LoRA r16, dropout 0.05) on ``profile``."""
    return resolve(compose_config([
        "scale=paper", "suite=math10k", "backbone=gemma-3-4b-pt", f"backbone.name={profile.backbone}",
        f"method={method}", f"privacy={privacy}", "lora=r16", "lora.dropout=0.05",
        f"suite.cutoff_len={profile.cutoff_len}", f"train.device={device}", f"train.steps={steps}",
        f"train.batch_size={batch_size}", f"train.micro_batch_size={profile.micro_batch_size}",
        "train.prefix_cache=off", "logging=disabled",
    ]))


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _step(setup: T.Setup, cfg: object) -> dict:
    record = T._to_host(T.train_step(setup, cfg))
    if setup.device.type == "cuda":
        torch.cuda.synchronize(setup.device)
    return record


# -------------------------------------------------------------------------------------------- counting
def count_step(step: Callable[[], object], device: torch.device) -> tuple[int, int]:
    """Host syncs and kernel launches of one call of ``step``, from ``torch.profiler``: on CUDA the
    blocking runtime calls and the device kernels (memcpy/memset included); on a CPU the value reads
    (:data:`CPU_SYNCS`) and every aten op (what would each be a launch on a device)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    events = list(prof.events())
    if device.type == "cuda":
        kernels = sum(e.device_type == DeviceType.CUDA for e in events) or sum(len(e.kernels) for e in events)
        return sum(e.name in CUDA_SYNCS for e in events), kernels
    return sum(e.name in CPU_SYNCS for e in events), sum(e.name.startswith("aten::") for e in events)


# -------------------------------------------------------------------------------------------- checks
def table5_row(profile: Profile, label: str, method: str, privacy: str, device: torch.device,
               suite: Suite, keep: bool = False) -> tuple[Row, T.Setup | None]:
    """Build, warm up, time ``measure`` steps (median), count one more step; peak memory since the
    build (weights included). ``keep`` returns the trained setup (for the generate check)."""
    steps = profile.warmup + profile.measure + 1
    cfg = job_config(profile, method, privacy, profile.batch_size, steps, str(device))
    _release(device)
    setup = T.build(cfg, suite=suite)
    for _ in range(profile.warmup):
        _step(setup, cfg)
    times, loss = [], math.nan
    for _ in range(profile.measure):
        tic = time.perf_counter()
        record = _step(setup, cfg)
        times.append(time.perf_counter() - tic)
        loss = record.get("loss", loss)
    syncs, kernels = count_step(lambda: _step(setup, cfg), device)
    row = Row(label, statistics.median(times), peak_memory_mb(device), syncs, kernels, float(loss))
    return row, (setup if keep else None)


def generate_check(setup: T.Setup, new_tokens: int = 8) -> str:
    """Greedy generation with the KV cache from the trained model (the evaluator's path)."""
    encoded = setup.tokenizer("Q: 12 apples + 30 apples = ?\nA:", return_tensors="pt").to(setup.device)
    setup.model.eval()
    with torch.no_grad():
        out = setup.model.generate(**encoded, max_new_tokens=new_tokens, do_sample=False, use_cache=True,
                                   pad_token_id=setup.tokenizer.pad_token_id)
    prompt = encoded["input_ids"].shape[1]
    if out.shape[1] <= prompt:
        raise RuntimeError("generate returned no new tokens")
    return setup.tokenizer.decode(out[0, prompt:], skip_special_tokens=True)


def resume_check(profile: Profile, device: torch.device, suite: Suite, workdir: Path) -> bool:
    """PRISM with dropout: ``2k`` uninterrupted steps vs ``k`` steps, checkpoint, drop everything,
    rebuild, restore, ``k`` more steps. True when every LoRA tensor is bitwise equal."""
    k = profile.resume_steps
    steps = profile.warmup + profile.measure + 1  # σ as in the timed jobs (the run stops after 2k steps)
    cfg = job_config(profile, "prism", "eps6", profile.resume_batch_size, steps, str(device))

    def run(setup: T.Setup, n: int) -> None:
        for _ in range(n):
            _step(setup, cfg)

    _release(device)
    straight = T.build(cfg, suite=suite)
    run(straight, 2 * k)
    expected = {name: p.detach().cpu().clone() for name, p in straight.params.items()}
    del straight
    _release(device)
    first = T.build(cfg, suite=suite)
    run(first, k)
    save_checkpoint(workdir, T._state(first, k))
    del first  # the kill: nothing in memory survives, only the checkpoint
    _release(device)
    resumed = T.build(cfg, suite=suite)
    T._restore(resumed, load_checkpoint(workdir))
    run(resumed, k)
    return all(torch.equal(p.detach().cpu(), expected[name]) for name, p in resumed.params.items())


# -------------------------------------------------------------------------------------------- report
def format_table(rows: Sequence[Row], device: torch.device) -> str:
    """Table 5 with the ratios to the first row (DP-AdamW)."""
    unit = ("host syncs", "kernels") if device.type == "cuda" else ("value reads", "aten ops")
    lines = [f"{'method':<12} {'step s':>9} {'x AdamW':>8} {'peak MiB':>10} {'x AdamW':>8} "
             f"{unit[0] + '/step':>17} {unit[1] + '/step':>14} {'loss':>8}"]
    base = rows[0]
    for r in rows:
        lines.append(f"{r.label:<12} {r.step_s:9.3f} {r.step_s / base.step_s:8.3f} {r.peak_mb:10.1f} "
                     f"{r.peak_mb / base.peak_mb:8.3f} {r.syncs:17d} {r.kernels:14d} {r.loss:8.3f}")
    return "\n".join(lines)


def run_check(profile: Profile, device: torch.device, methods: Sequence[str] | None = None,
              out: Callable[[str], None] = print) -> int:
    """Every check of ``profile`` on ``device``; prints as it goes; returns the number of failures. Every DP
    job here has the same (ε, δ, q, T), hence the same σ: it is calibrated once (seconds each)."""
    with mock.patch.object(T, "calibrate_for_run", functools.cache(T.calibrate_for_run)):
        started = time.perf_counter()
        suite = synthetic_suite(profile.examples, profile.cutoff_len)
        rows, failures, prism_setup = [], 0, None
        for label, method, privacy in TABLE5:
            if methods and method not in methods:
                continue
            try:
                row, setup = table5_row(profile, label, method, privacy, device, suite, keep=method == "prism")
            except Exception as exc:  # noqa: BLE001 - report every method, then fail
                failures += 1
                out(f"{label:<12} FAILED: {type(exc).__name__}: {exc}")
                continue
            prism_setup = setup or prism_setup
            failures += not math.isfinite(row.loss)
            rows.append(row)
            out(f"{label:<12} step {row.step_s:.3f} s  peak {row.peak_mb:.0f} MiB  syncs {row.syncs}  "
                f"kernels {row.kernels}  loss {row.loss:.3f}  [{time.perf_counter() - started:.0f} s]")
        if rows:
            out("\nTable 5 (" + f"{profile.backbone}, B={profile.batch_size}, micro-batch {profile.micro_batch_size}, "
                f"{profile.cutoff_len} tokens, median of {profile.measure} steps)\n" + format_table(rows, device))
        if prism_setup is not None:
            try:
                out(f"generate: {generate_check(prism_setup)!r}")
            except Exception as exc:  # noqa: BLE001
                failures += 1
                out(f"generate FAILED: {type(exc).__name__}: {exc}")
            prism_setup = None
        if not methods or "prism" in methods:
            with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
                try:
                    same = resume_check(profile, device, suite, Path(workdir))
                except Exception as exc:  # noqa: BLE001
                    same = False
                    out(f"resume FAILED: {type(exc).__name__}: {exc}")
            failures += not same
            out(f"save/kill/resume after {profile.resume_steps} of {2 * profile.resume_steps} steps: "
                f"{'bitwise identical' if same else 'DIFFERS'}")
        out(f"gpu-check: {'ok' if not failures else f'{failures} failure(s)'} in {time.perf_counter() - started:.0f} s")
        return failures


def main(*, profile: str = "paper", device: str | None = None, methods: str | None = None) -> int:
    """Run the checks of ``profile`` (paper: a GPU; sim, tiny: a CPU) on ``device`` (cuda|cpu, default the
    profile's) for ``methods`` (a comma-separated subset of adamw,loraplus,prism; default all); exit 1
    when one fails. Bad arguments raise a one-line ``ValueError`` before any model."""
    known = list(dict.fromkeys(method for _, method, _ in TABLE5))
    chosen = None if methods is None else comma_list(methods, "methods", choices=known)
    if profile not in PROFILES:
        raise ValueError(f"profile={profile} is not a profile, use profile= one of {', '.join(sorted(PROFILES))}")
    spec = PROFILES[profile]
    where = torch.device(device or spec.device)
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA device is visible, run `make gpu-check` on a GPU machine "
                         "(or `python -m pipelines gpu-check profile=tiny` on a CPU)")
    name = torch.cuda.get_device_name(where) if where.type == "cuda" else "cpu"
    print(f"device: {name}  torch {torch.__version__}  profile {profile} ({spec.backbone})")
    return 1 if run_check(spec, where, chosen) else 0

