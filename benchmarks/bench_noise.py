"""Cost of the two noise sources per logical step, side by side in one process (``privacy.noise_source``).

Per step PRISM draws ``Σ(m + n) r`` unit normals (eq. 19) and the factor-space baselines ``Σ(m + n) r``
too (one per LoRA coordinate), so one count covers both. Shapes: Gemma-3-4B (34 layers, hidden 2560,
q 2048, k/v 1024, MLP 10240) and the embedded default (SmolLM2-135M's last layer: hidden 576, q 576,
k/v 192, MLP 1536), r = 16, Table 7's targets (q, k, v, up, down). Prints the median seconds of each
source and their ratio (interleaved A B B A; OMP_NUM_THREADS=1).

    python benchmarks/bench_noise.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from prism.privacy.noise import SecureNoise, SeededNoise

SHAPES = {  # name: (layers, hidden, q, kv, mlp)
    "gemma-3-4b (34 layers)": (34, 2560, 2048, 1024, 10240),
    "embedded (smollm2-135m, last layer)": (1, 576, 576, 192, 1536),
}


def draws_per_step(layers: int, hidden: int, q: int, kv: int, mlp: int, r: int = 16) -> int:
    """``Σ(m + n) r`` over q, k, v, up, down of every layer."""
    return layers * r * ((q + hidden) + 2 * (kv + hidden) + 2 * (mlp + hidden))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    print(f"{'shapes':<38}{'draws':>12}{'seeded s':>10}{'os s':>10}{'os/seeded':>11}")
    for name, shape in SHAPES.items():
        n = draws_per_step(*shape)
        sources = {"seeded": SeededNoise(torch.Generator().manual_seed(0)), "os": SecureNoise()}
        times: dict[str, list[float]] = {k: [] for k in sources}
        for _ in range(args.repeats):
            for key in ("seeded", "os", "os", "seeded"):
                tic = time.perf_counter()
                sources[key].normal((n,), cpu)
                times[key].append(time.perf_counter() - tic)
        seeded, secure = statistics.median(times["seeded"]), statistics.median(times["os"])
        print(f"{name:<38}{n:>12,}{seeded:>10.3f}{secure:>10.3f}{secure / seeded:>11.2f}")


if __name__ == "__main__":
    main()
