"""The interface every method implements: a privatiser plus an update rule (docs/DECISIONS.md D2, D23).

The training loop (:mod:`prism.train`) drives one logical step as::

    method.zero_accumulators()
    for micro_batch in logical_batch:          # physical micro-batches only bound memory
        grads = <per-example grads of the per-example losses>   # DP:     name -> [k, *shape]
              | <sum over the micro-batch of those grads>       # non-DP: name -> [*shape]
        method.accumulate(grads)
    stats = method.step(denominator, generator, diagnostics)   # 0-dim device tensors

* DP (``privacy`` given): ``accumulate`` clips each example (flat factor norm for the baselines,
  global intrinsic norm for PRISM) and sums; ``step`` adds the Gaussian noise once, with standard
  deviation ``σ·C`` on the *sum* (i.e. ``σC/B`` after dividing by the expected batch size
  ``denominator = B``), then applies the update.
* Non-DP (``privacy is None``): ``accumulate`` sums, ``step`` divides by the realised batch size
  and applies the update. No clipping, no noise.

Keys are the trainable parameter names of the peft model (``...lora_A.default.weight``).
"""
from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class PrivacySpec:
    """What the accountant assumed: noise multiplier σ and clipping norm C."""

    sigma: float
    clip_norm: float


class Method(abc.ABC):
    """Privatiser + update rule over a fixed set of named trainable parameters."""

    def __init__(self, params: Mapping[str, nn.Parameter], privacy: PrivacySpec | None) -> None:
        self.params = dict(params)
        self.privacy = privacy

    @property
    def dp(self) -> bool:
        return self.privacy is not None

    @abc.abstractmethod
    def zero_accumulators(self) -> None:
        """Start a logical step."""

    @abc.abstractmethod
    def accumulate(self, grads: Mapping[str, Tensor]) -> None:
        """Add one micro-batch: per-example grads ``[k, *shape]`` (DP) or their sum ``[*shape]``."""

    @abc.abstractmethod
    def step(
        self, denominator: float, generator: torch.Generator | None, diagnostics: bool = True
    ) -> dict[str, Tensor]:
        """Noise (DP), normalise by ``denominator``, update the parameters; return step statistics.

        Statistics are 0-dim tensors on the parameters' device, never read on the host inside
        ``accumulate``/``step`` (the loop converts them once per logged step). Keys where they apply:
        ``clip_fraction`` (share of examples whose norm exceeded C), ``grad_norm_mean`` (mean
        per-example norm before clipping) and, only with ``diagnostics``, ``noise_norm`` (Frobenius
        norm of the intrinsic noise added to ΔZ, summed over modules in quadrature, after division
        by ``denominator``) and ``update_norm``. A non-finite gradient is not raised here: it
        propagates into the parameters, which the loop checks.
        """

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-identically (optimizer moments, counters)."""

    @abc.abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...
