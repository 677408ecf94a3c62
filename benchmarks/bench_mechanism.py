"""PRISM's mechanism at Gemma-3-4B LoRA shapes on CPU, against DP-AdamW's clip/noise/update (informational).

No model is loaded: random full-rank factors and synthetic per-example factor gradients with the exact
shapes of the paper's targeted modules (q, k, v, up, down of every decoder layer; hidden 2560,
intermediate 10240, 8 query heads × 256, 4 KV heads × 256), r = 16, micro-batch 4, B = 64, so one
logical step is ``zero_accumulators`` + B/4 ``accumulate`` calls + ``step``. Times are CPU seconds
(one thread), medians over ``--repeats`` rounds, the methods interleaved. The ratio that matters is
the one on a GPU (``make gpu-check``); this CPU ratio is printed, not judged. ``torch.profiler`` checks
two properties of the batched path, which make the exit status: the ops per logical step do not grow
with depth, and ``accumulate``/``step`` read nothing on the host besides torch's linalg checks.

    python benchmarks/bench_mechanism.py                  # 34 layers (the paper's Gemma-3-4B)
    python benchmarks/bench_mechanism.py --layers 4       # quicker
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prism.methods import build_method  # noqa: E402
from prism.methods.base import Method, PrivacySpec  # noqa: E402

HIDDEN, INTERMEDIATE, Q_OUT, KV_OUT = 2560, 10240, 8 * 256, 4 * 256
MODULES = {  # module -> (m = out features, n = in features): paper A is m×r, B is n×r
    "self_attn.q_proj": (Q_OUT, HIDDEN), "self_attn.k_proj": (KV_OUT, HIDDEN), "self_attn.v_proj": (KV_OUT, HIDDEN),
    "mlp.up_proj": (INTERMEDIATE, HIDDEN), "mlp.down_proj": (HIDDEN, INTERMEDIATE),
}
PRISM = {"name": "prism", "lr": 3e-4, "init": "spectral"}
ADAMW = {"name": "adamw", "lr": 3e-4, "init": "peft", "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
         "amsgrad": False}
KINDS = ("PRISM", "DP-AdamW")


def lora_params(layers: int, r: int, seed: int) -> dict[str, nn.Parameter]:
    """peft-named factors: lora_A [r, n] (paper Bᵀ) and lora_B [m, r] (paper A), random full rank."""
    g = torch.Generator().manual_seed(seed)
    params = {}
    for layer in range(layers):
        for module, (m, n) in MODULES.items():
            prefix = f"model.layers.{layer}.{module}"
            params[f"{prefix}.lora_A.default.weight"] = nn.Parameter(torch.randn(r, n, generator=g) / n**0.5)
            params[f"{prefix}.lora_B.default.weight"] = nn.Parameter(torch.randn(m, r, generator=g) / r**0.5)
    return params


def per_example_grads(params: dict[str, nn.Parameter], k: int, seed: int) -> dict[str, torch.Tensor]:
    """Synthetic per-example gradients ``[k, *shape]`` (about half the examples get clipped at C = 1)."""
    g = torch.Generator().manual_seed(seed)
    scale = 1.0 / len(params) ** 0.5
    return {name: scale * torch.randn(k, *p.shape, generator=g) / p.numel() ** 0.25 for name, p in params.items()}


def build(kind: str, params: dict[str, nn.Parameter], privacy: PrivacySpec) -> Method:
    return build_method(OmegaConf.create(ADAMW if kind == "DP-AdamW" else PRISM), params, privacy)


def timed(fn: Callable[[], object]) -> float:
    """CPU seconds (user + system) of one call: single-threaded, so the core time it took, without the
    time the process waited for a core on a shared machine."""
    tic = time.process_time()
    fn()
    return time.process_time() - tic


def nested_in(event, prefix: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False


def profile_counts(fn: Callable[[], object]) -> tuple[int, int, int]:
    """(aten ops called from Python, our host reads, linalg checks) of one call of ``fn``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = list(prof.events())
    ops = sum(e.name.startswith("aten::") and not nested_in(e, "aten::") for e in events)
    reads = sum(e.name == "aten::_local_scalar_dense" and not nested_in(e, "aten::_linalg_check_errors")
                and not nested_in(e, "Optimizer.step#") for e in events)
    checks = sum(e.name == "aten::_linalg_check_errors" for e in events)
    return ops, reads, checks


def step_counts(kind: str, layers: int, r: int, k: int, micro: int, privacy: PrivacySpec) -> dict[str, int]:
    """Profiler counts per logical step (zero + micro·accumulate + step) at ``layers`` layers; host
    reads split into those of ``zero_accumulators`` and those inside ``accumulate``/``step``."""
    params = lora_params(layers, r, seed=0)
    method = build(kind, params, privacy)
    grads = per_example_grads(params, k, seed=1)
    gen = torch.Generator().manual_seed(2)
    zero = profile_counts(method.zero_accumulators)
    acc = profile_counts(lambda: method.accumulate(grads))
    stp = profile_counts(lambda: method.step(64.0, gen, diagnostics=False))
    return {"ops": zero[0] + micro * acc[0] + stp[0], "zero_reads": zero[1], "step_reads": micro * acc[1] + stp[1],
            "checks": zero[2] + micro * acc[2] + stp[2]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=34)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--micro", type=int, default=4, help="micro-batch size k")
    parser.add_argument("--batch", type=int, default=64, help="expected logical batch B")
    args = parser.parse_args()
    torch.set_num_threads(1)
    privacy = PrivacySpec(sigma=1.0, clip_norm=1.0)
    r, k, micro = args.rank, args.micro, args.batch // args.micro
    params = {kind: lora_params(args.layers, r, seed=0) for kind in KINDS}
    methods = {kind: build(kind, params[kind], privacy) for kind in KINDS}
    grads = per_example_grads(params["PRISM"], k, seed=1)
    gen = torch.Generator().manual_seed(2)
    times: dict[str, dict[str, list[float]]] = {kind: {"zero": [], "accumulate": [], "step": []} for kind in KINDS}
    for _ in range(args.repeats):
        for kind in (*KINDS, *reversed(KINDS)):
            method, t = methods[kind], times[kind]
            t["zero"].append(timed(method.zero_accumulators))
            t["accumulate"].append(statistics.mean(timed(lambda m=method: m.accumulate(grads)) for _ in range(micro)))
            t["step"].append(timed(lambda m=method: m.step(float(args.batch), gen, diagnostics=False)))
    half = max(1, args.layers // 2)
    counts = {(kind, L): step_counts(kind, L, r, k, micro, privacy) for kind in KINDS for L in (half, args.layers)}
    logical = {}
    print(f"{args.layers} layers × {len(MODULES)} modules, r = {r}, micro-batch {k}, B = {args.batch}; CPU seconds, "
          f"median of {args.repeats}")
    print(f"{'method':<10}{'zero ms':>9}{'accum ms':>10}{'step ms':>9}{'logical ms':>12}{'ops L/2':>9}{'ops L':>8}"
          f"{'host reads':>12}")
    for kind in KINDS:
        med = {part: statistics.median(v) for part, v in times[kind].items()}
        logical[kind] = med["zero"] + micro * med["accumulate"] + med["step"]
        c_half, c_full = counts[kind, half], counts[kind, args.layers]
        print(f"{kind:<10}{1e3 * med['zero']:>9.1f}{1e3 * med['accumulate']:>10.1f}{1e3 * med['step']:>9.1f}"
              f"{1e3 * logical[kind]:>12.1f}{c_half['ops']:>9,}{c_full['ops']:>8,}{c_full['step_reads']:>12}")
    print(f"PRISM / DP-AdamW logical step on this CPU: {logical['PRISM'] / logical['DP-AdamW']:.2f} "
          "(informational; the GPU ratio is make gpu-check's)")
    checks = {"PRISM ops independent of depth": counts["PRISM", half]["ops"] == counts["PRISM", args.layers]["ops"],
              "no host read inside accumulate/step": all(counts[kind, args.layers]["step_reads"] == 0 for kind in KINDS)}
    for name, ok in checks.items():
        print(f"{name}: {'ok' if ok else 'FAILED'}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
