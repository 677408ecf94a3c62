"""Low-dimensional tangent-noise sampler (eq. 19) vs dense projection of an m×n Gaussian (eq. 18).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sampler.py [--repeats 15]``.
Prints, for m = n ∈ {512, 1024, 2048} and r = 16 in float32 on one CPU thread, the median time of
``tangent_noise`` (O((m+n) r) random numbers, O((m+n) r²) flops) and of
``tangent_project(A, B, randn(m, n))`` (O(mn) random numbers, O(mnr) flops), their ratio, and the
growth of the sampler's time as m + n doubles (≈ 2 for linear scaling).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from prism.audit.diagnostics import sample_tangent_noise
from prism.mechanism.geometry import frame, tangent_project


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    r = args.rank
    print(f"float32, torch {torch.__version__}, threads={torch.get_num_threads()}, r={r}, "
          f"median of {args.repeats} after warm-up")
    header = (f"{'m=n':>6} {'sampler (eq.19) ms':>19} {'+frame ms':>10} {'dense P(Ξ) ms':>14} "
              f"{'dense/sampler':>14} {'sampler growth':>15}")
    print(header)
    print("-" * len(header))
    previous = None
    for size in args.sizes:
        A = torch.randn(size, r, generator=gen)
        B = torch.randn(size, r, generator=gen)
        fr = frame(A, B)
        t_sampler = median_seconds(lambda A=A, B=B, fr=fr: sample_tangent_noise(A, B, generator=gen, frame=fr), args.repeats)
        t_with_frame = median_seconds(lambda A=A, B=B: sample_tangent_noise(A, B, generator=gen), args.repeats)
        t_dense = median_seconds(
            lambda A=A, B=B, size=size: tangent_project(A, B, torch.randn(size, size, generator=gen)), args.repeats
        )
        growth = "" if previous is None else f"{t_sampler / previous:.2f}x"
        print(f"{size:>6} {1e3 * t_sampler:>19.3f} {1e3 * t_with_frame:>10.3f} {1e3 * t_dense:>14.3f} "
              f"{t_dense / t_sampler:>13.1f}x {growth:>15}")
        previous = t_sampler
    print("sampler: tangent_noise with a precomputed Frame (per-step QR reused); "
          "+frame: including the thin QRs of A and B")


if __name__ == "__main__":
    main()
