"""A method defined outside ``prism/``: factor-space DP-SGD with momentum (eq. 3 and ``torch.optim.SGD``).

Its config dataclass and its class are all a method needs (docs/DECISIONS.md D78); ``toy_sgd.yaml``
beside it names the class (``_target_``), so the registry imports this file the first time the
name is looked up.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prism.methods.factor import FactorDPMethod
from prism.methods.schema import MethodConfig


@dataclass(frozen=True, kw_only=True)
class ToySGDConfig(MethodConfig):
    """``toy_sgd``: ``torch.optim.SGD``'s momentum besides the common keys."""

    momentum: float = field(metadata={"help": "SGD momentum", "range": "[0, 1)"})


class ToySGDMethod(FactorDPMethod):
    """DP-SGD with momentum on both LoRA factors."""

    name, label, config_class = "toy_sgd", "Toy SGD", ToySGDConfig

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(list(self.params.values()), **self.config.options())
