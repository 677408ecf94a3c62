"""PRISM's mechanism at Gemma-3-4B LoRA shapes on CPU: per-module vs batched, against DP-AdamW's clip/noise/update.

No model is loaded: random full-rank factors and synthetic per-example factor gradients with the exact
shapes of the paper's targeted modules (q, k, v, up, down of every decoder layer; hidden 2560,
intermediate 10240, 8 query heads × 256, 4 KV heads × 256), r = 16, micro-batch 4, B = 64, so one
logical step is ``zero_accumulators`` + B/4 ``accumulate`` calls + ``step``. Times are CPU seconds
(one thread, so the core time without the waits for a core on a shared machine), medians over
``--repeats`` rounds, methods and the pieces of the float64 floor (:func:`float64_floor`) interleaved;
each round runs whole logical steps, each call timed separately (``accumulate``: the mean of the B/k
calls of a step, so once-per-step work inside it is spread as in training), and the logical step is
``zero + B/k·accumulate + step``. ``torch.profiler`` counts, per logical step,
the aten ops called from Python (the kernel chain; nested ops excluded), our host reads
(``_local_scalar_dense`` outside torch's own checks; a device sync on a GPU) and torch's linalg
convergence checks (one host read of ``info`` per ``eigh``/SVD call, a device sync on CUDA too).
Statistics are left on the device (``diagnostics=False``: no noise/update norms), as in a step
that is not logged.

    python benchmarks/bench_mechanism.py                  # 34 layers (the paper's Gemma-3-4B)
    python benchmarks/bench_mechanism.py --layers 4       # quicker
"""
from __future__ import annotations

import argparse
import math
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

from prism.geometry import standard_normal  # noqa: E402
from prism.methods.base import Method, PrivacySpec  # noqa: E402
from prism.methods.factor import FactorDPMethod  # noqa: E402
from prism.methods.prism import PrismMethod  # noqa: E402
from prism.methods.scratch import CPU_TILE_BYTES  # noqa: E402

HIDDEN, INTERMEDIATE, Q_OUT, KV_OUT = 2560, 10240, 8 * 256, 4 * 256
MODULES = {  # module -> (m = out features, n = in features): paper A is m×r, B is n×r
    "self_attn.q_proj": (Q_OUT, HIDDEN), "self_attn.k_proj": (KV_OUT, HIDDEN), "self_attn.v_proj": (KV_OUT, HIDDEN),
    "mlp.up_proj": (INTERMEDIATE, HIDDEN), "mlp.down_proj": (HIDDEN, INTERMEDIATE),
}
PRISM = {"name": "prism", "lr": 3e-4, "init": "spectral"}
ADAMW = {"name": "adamw", "lr": 3e-4, "init": "peft", "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
         "amsgrad": False}
# (numerator, denominator, target): ratios of logical-step time, with the targets
TARGETS = [("PRISM per-module", "PRISM batched", 5.0, ">="), ("PRISM batched", "DP-AdamW", 2.0, "<=")]


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


def build(kind: str, params: dict[str, nn.Parameter], privacy: PrivacySpec, tile_bytes: float | None = None) -> Method:
    """``PRISM batched``: the CPU's chain (accumulate in cache-sized tiles of ``tile_bytes``, default
    :data:`prism.methods.scratch.CPU_TILE_BYTES`); ``PRISM whole groups``: one tile per shape group, the
    chain a GPU runs; ``PRISM per-module``: the reference path."""
    if kind == "DP-AdamW":
        return FactorDPMethod(OmegaConf.create(ADAMW), params, privacy)
    if kind == "PRISM whole groups":
        tile_bytes = math.inf
    return PrismMethod(OmegaConf.create(PRISM), params, privacy, batched=kind != "PRISM per-module",
                       tile_bytes=tile_bytes)


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


def step_counts(kind: str, layers: int, r: int, k: int, micro: int, privacy: PrivacySpec,
                tile_bytes: float | None) -> dict[str, int]:
    """Profiler counts per logical step (zero + micro·accumulate + step) at ``layers`` layers; host
    reads split into those of ``zero_accumulators`` and those inside ``accumulate``/``step``."""
    params = lora_params(layers, r, seed=0)
    method = build(kind, params, privacy, tile_bytes)
    grads = per_example_grads(params, k, seed=1)
    gen = torch.Generator().manual_seed(2)
    zero = profile_counts(method.zero_accumulators)
    acc = profile_counts(lambda: method.accumulate(grads))
    stp = profile_counts(lambda: method.step(64.0, gen, diagnostics=False))
    return {"ops": zero[0] + micro * acc[0] + stp[0], "zero_reads": zero[1], "step_reads": micro * acc[1] + stp[1],
            "checks": zero[2] + micro * acc[2] + stp[2]}


def op_cost_s(r: int, calls: int = 20000) -> float:
    """Seconds per call of an ``r×r`` float64 product from a Python loop: the fixed Python, dispatcher
    and BLAS-call cost of one small op, i.e. what batching modules into one op can save per op."""
    x = torch.randn(r, r, dtype=torch.float64)
    for _ in range(1000):
        x @ x
    tic = time.perf_counter()
    for _ in range(calls):
        x @ x
    return (time.perf_counter() - tic) / calls


def read_pass_s(grads: dict[str, torch.Tensor], repeats: int = 3) -> float:
    """Seconds of one float32 read of a micro-batch's per-example gradients (one fused norm over all
    of them): the memory floor of one pass over the data every accumulate must touch."""
    tensors = list(grads.values())
    torch._foreach_norm(tensors)
    return statistics.median(timed(lambda: torch._foreach_norm(tensors)) for _ in range(repeats))


def float64_floor(grads: dict[str, torch.Tensor], k: int, r: int) -> dict[str, Callable[[], object]]:
    """Seconds of the work every float64 per-example norm (docs/DECISIONS.md D40, D60) must do with torch's
    CPU kernels, measured on this micro-batch's grads. ``convert``: one float32→float64 copy into a kept
    buffer (torch multiplies only equal dtypes); ``gram``: the ``4 k r² Σ(m+n)`` flops of ``g_Aᵀg_A``,
    ``Q_Aᵀg_A``, ``g_Bᵀg_B``, ``Q_Bᵀg_B`` as ``[k, m, r]ᵀ [k, m, r]`` products (m = 10,240) on an operand that fits
    in cache, the best rate they reach here (so a lower bound on their time); ``sum``: one read of the float64 copy by the
    weighted sum (its coefficients need every module's norm first, so it is a second pass); ``noise`` (per
    step): ``Σ(m+n) r`` float64 normals (:func:`prism.geometry.standard_normal`, into a kept workspace). The
    frames, lift, moments and retraction are left out (no floor is claimed for them). Returns the calls,
    timed in the methods' rounds, side by side with them."""
    tensors = list(grads.values())
    numel = sum(g.numel() for g in tensors)
    buffer = torch.empty(numel, dtype=torch.float64)
    views = list(buffer.split([g.numel() for g in tensors]))
    views = [v.view(g.shape) for v, g in zip(views, tensors)]
    alpha = torch.rand(1, 1, k, dtype=torch.float64)
    out = torch.empty(1, 1, numel // k, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    rows = sum(sum(g.shape[1:]) - r for g in tensors)  # Σ(m + n): lora_B grads are [k, m, r], lora_A [k, r, n]
    noise_ws = tuple(torch.empty(rows * r + 1, dtype=torch.float64) for _ in range(2))  # kept, as the methods keep theirs
    seconds: dict[str, Callable[[], object]] = {
        "convert": lambda: torch._foreach_copy_(views, tensors),
        "sum": lambda: out.baddbmm_(alpha, buffer.view(1, k, -1), beta=0.0),
        "noise": lambda: standard_normal((rows * r,), gen, torch.float64, torch.device("cpu"), workspace=noise_ws),
    }
    flops = 4 * k * r * r * rows
    X = torch.randn(8 * k, INTERMEDIATE, r, dtype=torch.float64)
    seconds["gram"] = lambda: [X.mT @ X for _ in range(max(1, round(flops / (2 * X.numel() * r))))]
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=34)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tile-bytes", type=float, default=None,
                        help="PRISM batched's CPU tile in bytes (default prism.methods.scratch.CPU_TILE_BYTES)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    r, k, micro = args.rank, args.micro_batch, args.batch // args.micro_batch
    privacy = PrivacySpec(sigma=0.6, clip_norm=1.0)
    kinds = ["PRISM per-module", "PRISM whole groups", "PRISM batched", "DP-AdamW"]
    params = {kind: lora_params(args.layers, r, seed=0) for kind in kinds}
    methods = {kind: build(kind, params[kind], privacy, args.tile_bytes) for kind in kinds}
    grads = per_example_grads(params[kinds[0]], k, seed=1)
    gen = torch.Generator().manual_seed(2)
    times: dict[str, dict[str, list[float]]] = {kind: {"zero": [], "accumulate": [], "step": []} for kind in kinds}
    floor_calls = float64_floor(grads, k, r)
    floor_times: dict[str, list[float]] = {key: [] for key in floor_calls}
    for rep in range(args.repeats + 1):  # the first round warms up
        for key, fn in floor_calls.items():
            seconds = timed(fn)
            if rep:
                floor_times[key].append(seconds)
        for kind, method in methods.items():
            t = {"zero": timed(method.zero_accumulators),
                 "accumulate": sum(timed(lambda m=method: m.accumulate(grads)) for _ in range(micro)) / micro,
                 "step": timed(lambda m=method: m.step(float(args.batch), gen, diagnostics=False))}
            if rep:
                for key, value in t.items():
                    times[kind][key].append(value)
    counts = {(kind, L): step_counts(kind, L, r, k, micro, privacy, args.tile_bytes)
              for kind in kinds for L in sorted({max(1, args.layers // 2), args.layers})}
    modules = args.layers * len(MODULES)
    print(f"Gemma-3-4B LoRA shapes: {args.layers} layers × {len(MODULES)} modules = {modules} modules, "
          f"{len({s for s in MODULES.values()})} shape groups; r={r}, micro-batch {k}, B={args.batch} "
          f"({micro} accumulate calls per logical step); float32 factors, PRISM per-example path float64; "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of {args.repeats}\n")
    half = max(1, args.layers // 2)
    header = (f"{'method':<18} {'zero ms':>8} {'accum ms':>9} {'step ms':>8} {'logical ms':>11} "
              f"{'ops/step L=' + str(half):>15} {'ops/step L=' + str(args.layers):>15} {'host reads':>10} "
              f"{'linalg chk':>10}")
    print(header)
    print("-" * len(header))
    logical = {}
    for kind in kinds:
        med = {key: statistics.median(v) for key, v in times[kind].items()}
        logical[kind] = med["zero"] + micro * med["accumulate"] + med["step"]
        c = counts[kind, args.layers]
        reads = f"{c['zero_reads']}+{c['step_reads']}"
        print(f"{kind:<18} {1e3 * med['zero']:8.1f} {1e3 * med['accumulate']:9.1f} {1e3 * med['step']:8.1f} "
              f"{1e3 * logical[kind]:11.1f} {counts[kind, half]['ops']:>15} {c['ops']:>15} {reads:>10} "
              f"{c['checks']:>10}")
    print("\nPRISM whole groups: one chain per shape group, as on a GPU; PRISM batched: the CPU's default, per-example "
          "products in cache-sized tiles of modules (docs/DECISIONS.md D67). host reads: ours per logical step, "
          "zero_accumulators + (accumulate, step); linalg chk: torch's eigh/SVD convergence checks (host reads here; "
          "a device sync each on CUDA)\n")
    pm, pw, pb, ad = kinds
    t_op, t_read = op_cost_s(r), read_pass_s(grads)
    overhead = counts[pm, args.layers]["ops"] * t_op
    ceiling = logical[pm] / max(logical[pm] - overhead, 1e-12)
    accum = {kind: statistics.median(times[kind]["accumulate"]) for kind in kinds}
    megabytes = sum(g.numel() * g.element_size() for g in grads.values()) / 1e6
    floor = {key: statistics.median(v) for key, v in floor_times.items()}
    per_micro = floor["convert"] + floor["gram"] + floor["sum"]
    floor_step = micro * per_micro + floor["noise"]
    med = {key: statistics.median(v) for key, v in times[pb].items()}
    print(f"roofline: one small aten op costs {1e6 * t_op:.1f} µs; × {counts[pm, args.layers]['ops']} ops = "
          f"{1e3 * overhead:.0f} ms of the per-module path's {1e3 * logical[pm]:.0f} ms logical step, the most that "
          f"batching itself can remove (the rest is arithmetic and memory traffic; beyond it the batched path "
          f"factors its frames by CholeskyQR2, the per-module reference by Householder), so batching alone gives "
          f"per-module / batched <= {ceiling:.2f} here. One float32 read of a micro-batch's per-example grads "
          f"({megabytes:.0f} MB) takes {1e3 * t_read:.1f} ms: accumulate = {accum[pb] / t_read:.1f} such reads for "
          f"PRISM batched, {accum[ad] / t_read:.1f} for DP-AdamW.\n")
    print(f"float64 floor of PRISM's logical step (per-example norms in float64, docs/DECISIONS.md D40/D60; "
          f"torch CPU kernels), measured on these grads:\n"
          f"  per micro-batch: float32->float64 copy {1e3 * floor['convert']:.1f} ms + Gram/cross products "
          f"{1e3 * floor['gram']:.1f} ms (their flops on a cache-resident operand) + one float64 "
          f"read by the weighted sum {1e3 * floor['sum']:.1f} ms = {1e3 * per_micro:.1f} ms "
          f"(PRISM batched accumulate: {1e3 * accum[pb]:.1f} ms)\n"
          f"  per step: float64 tangent noise draws {1e3 * floor['noise']:.0f} ms\n"
          f"  floor = {micro} x {1e3 * per_micro:.1f} + {1e3 * floor['noise']:.0f} = {1e3 * floor_step:.0f} ms, "
          f"= {floor_step / logical[ad]:.2f}x DP-AdamW's {1e3 * logical[ad]:.0f} ms logical step "
          f"(zero, QR frames, lift and retraction not counted)\n"
          f"  PRISM batched beyond it: {micro} x {1e3 * (accum[pb] - per_micro):.1f} ms in accumulate (each tile converted "
          f"twice in cache instead of once plus one float64 read from memory, K_A and P_B's product forms below the "
          f"cache-resident rate, the norms' r x r algebra), {1e3 * med['zero']:.0f} ms in zero "
          f"(snapshots, frames, rank check), {1e3 * (med['step'] - floor['noise']):.0f} ms in step besides the draws "
          f"(lift, horizontalisation, moments, retraction) = {1e3 * (logical[pb] - floor_step):.0f} ms\n")
    missed = 0
    print(f"{'ratio (logical step)':<36} {'measured':>9}  target")
    for a, b, target, sense in TARGETS:
        ratio = logical[a] / logical[b]
        ok = ratio >= target if sense == ">=" else ratio <= target
        missed += not ok
        print(f"{a + ' / ' + b:<36} {ratio:9.2f}  {sense} {target:<5} {'ok' if ok else 'MISSED'}")
        if a == pm:
            print(f"{'  its ceiling, no op cost at all':<36} {ceiling:9.2f}  {sense} {target:<5} "
                  f"{'reachable' if ceiling >= target else 'out of reach at these shapes'}")
        else:
            bound = floor_step / logical[b]
            print(f"{'  its floor, float64 norms':<36} {bound:9.2f}  {sense} {target:<5} "
                  f"{'below the target' if bound <= target else 'out of reach under float64 norms'}")
    flat = counts[pw, half]["ops"] == counts[pw, args.layers]["ops"]
    missed += not flat
    print(f"{'whole-group ops independent of L':<36} {str(flat):>9}  == True {'ok' if flat else 'MISSED'}")
    for kind in (pw, pb):
        step_reads = counts[kind, args.layers]["step_reads"]
        missed += step_reads != 0
        print(f"{kind.replace('PRISM ', '') + ' host reads in acc+step':<36} {step_reads:>9}  == 0    "
              f"{'ok' if step_reads == 0 else 'MISSED'}")
    print(f"\n(the op-count target is checked on the whole-group chain, the one a GPU runs; on the CPU, accumulate "
          f"and two stages of the step run in {CPU_TILE_BYTES / 2**20:g} MiB tiles of modules (docs/DECISIONS.md D67, D68), "
          f"one chain per tile, so the op count grows with the modules: {counts[pb, half]['ops']} -> {counts[pb, args.layers]['ops']})" if args.tile_bytes is None else "")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
