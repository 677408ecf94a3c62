"""DP plumbing (docs/DECISIONS.md D1–D3, D21, D22): PRV accounting, Poisson sampling, per-example losses and gradients."""
from prism.privacy.accounting import (
    Accountant,
    calibrate_for_run,
    calibrate_sigma,
    calibration_rate,
    calibration_steps,
    epsilon_spent,
)
from prism.privacy.per_example import PerExampleGradients, per_example_loss, summed_gradients
from prism.privacy.sampling import PoissonSampler

__all__ = [
    "Accountant",
    "PerExampleGradients",
    "PoissonSampler",
    "calibrate_for_run",
    "calibrate_sigma",
    "calibration_rate",
    "calibration_steps",
    "epsilon_spent",
    "per_example_loss",
    "summed_gradients",
]
