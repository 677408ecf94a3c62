"""DP plumbing (docs/DECISIONS.md D1–D3, D21, D22): PRV accounting, Poisson sampling, noise, per-example
losses and gradients, the torch-free accountant limits and step rule the validator reads
(:mod:`prism.privacy.limits`, :mod:`prism.privacy.budget`) and the protocol record.

The names below load their submodule on first use, so ``prism.privacy.budget`` and
``prism.privacy.limits`` stay importable without torch (the validator imports them before any model).
"""
from __future__ import annotations

import importlib
from typing import Any

_SOURCES = {
    "Accountant": "accounting", "calibrate_for_run": "accounting", "calibrate_sigma": "accounting",
    "calibration_rate": "accounting", "calibration_steps": "accounting", "epsilon_spent": "accounting",
    "PerExampleGradients": "per_example", "per_example_loss": "per_example", "summed_gradients": "per_example",
    "PoissonSampler": "sampling",
}
__all__ = sorted(_SOURCES)


def __getattr__(name: str) -> Any:
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_SOURCES[name]}"), name)
