"""`make gpu-check`: a few DP steps of every method on a tiny model on the GPU, with step time and memory.

For a machine with CUDA (CI never has one). Uses the paper-scale dtype policy — bf16 frozen base,
fp32 adapters, fp32/fp64 mechanism linear algebra — on a random-config model, so it needs no
download. Exits non-zero when a method fails or produces a non-finite loss.

    python -m pipelines.gpu_check [--backbone tiny-gemma] [--steps 3]
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from pipelines.grid import compose_config, resolve
from prism import train as T
from prism.methods import METHODS


def check(method: str, backbone: str, steps: int) -> dict[str, float]:
    cfg = resolve(compose_config([
        f"backbone={backbone}", "backbone.dtype=bfloat16", f"method={method}", "privacy=eps6",
        "suite=math10k", "suite.embedded.train_per_task=64", "suite.cutoff_len=512", "train.device=cuda",
        f"train.steps={steps}", "train.batch_size=16", "train.micro_batch_size=4", "logging=disabled",
    ]))
    setup = T.build(cfg)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        tic = time.perf_counter()
        record = T.train_step(setup, cfg)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - tic)
        losses.append(record.get("loss", float("nan")))
    return {"step_s": min(times[1:] or times), "peak_mb": torch.cuda.max_memory_allocated() / 2**20,
            "loss": losses[-1], "sigma": setup.sigma}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="tiny-llama")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible; run it on a GPU machine (the CPU path is covered by make test)")
        return 1
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  backbone {args.backbone}")
    failed = 0
    for method in METHODS:
        try:
            r = check(method, args.backbone, args.steps)
            ok = math.isfinite(r["loss"])
            failed += not ok
            print(f"{method:<12} step {r['step_s']:.3f} s  peak {r['peak_mb']:8.1f} MB  loss {r['loss']:.3f}  "
                  f"sigma {r['sigma']:.3f}  {'ok' if ok else 'NON-FINITE'}")
        except Exception as exc:  # noqa: BLE001 - report every method, then fail
            failed += 1
            print(f"{method:<12} FAILED: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
