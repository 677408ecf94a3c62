"""How many updates a run performs: the one rule the trainer, the runner, the grids and the validator read."""
from __future__ import annotations

from typing import Any


def total_steps(cfg: Any) -> int:
    """``train.steps``, or warm-up + measured updates in benchmark mode (``train.benchmark``, Table 5)."""
    benchmark = cfg.train.benchmark
    return int(benchmark.warmup + benchmark.measure) if benchmark else int(cfg.train.steps)
