"""The interface every method implements: Opacus' three verbs (docs/DECISIONS.md D2, D23, D71).

The training loop (:mod:`prism.train`) drives one logical step as::

    method.zero_accumulators()
    for micro_batch in logical_batch:          # physical micro-batches only bound memory
        grads = <per-example grads of the per-example losses>   # DP:     name -> [k, *shape]
              | <sum over the micro-batch of those grads>       # non-DP: name -> [*shape]
        method.accumulate(grads)                              # 1. clip and accumulate
    release = method.add_noise(denominator, noise)            # 2. the privatised quantity
    stats = method.update(release)                            # 3. the update, from the release alone

(:meth:`Method.step` is the three in a row.) Under DP (``privacy`` given) ``accumulate`` clips each
example (flat factor norm for the baselines, global intrinsic norm for PRISM) to ``C·(1 − CLIP_MARGIN)``
and sums, an example with a non-finite gradient contributing nothing;
``add_noise`` adds the Gaussian noise once, with standard deviation ``σ·C`` on the *sum* (``σC/B``
after dividing by the expected batch size ``denominator = B``), and returns a :class:`Release`; the
privacy boundary is that object: ``update`` reads it and public state only (the current factors,
the optimizer's moments of earlier releases). Non-DP (``privacy is None``): ``accumulate`` sums,
``add_noise`` divides by the realised batch size (no clipping, no noise).

Keys are the trainable parameter names of the peft model (``...lora_A.default.weight``).
"""
from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from prism.privacy.noise import NoiseSource, as_noise_source

if TYPE_CHECKING:
    from prism.methods.schema import MethodConfig


CLIP_MARGIN = 1e-3
"""Each example is clipped to ``C·(1 − CLIP_MARGIN)`` while the noise keeps ``σC``: the margin covers the float32
jitter of the other examples' gradients between neighbouring batches (docs/PRIVACY.md, "The clip margin")."""


@dataclass(frozen=True)
class PrivacySpec:
    """What the accountant assumed: noise multiplier σ and clipping norm C (the sensitivity of the clipped sum)."""

    sigma: float
    clip_norm: float

    @property
    def clip_target(self) -> float:
        """The norm each example is clipped to, ``C·(1 − CLIP_MARGIN)``: a neighbouring batch moves the clipped
        sum by at most C, the added example and the float32 jitter of the others together."""
        return self.clip_norm * (1.0 - CLIP_MARGIN)


@dataclass
class Release:
    """What one step releases, the only input of :meth:`Method.update`: ``tensors``, per trainable parameter,
    the privatised quantity in its layout (the baselines: the noised averaged gradient, eq. 3; PRISM: the
    noised, horizontalised lift of eq. 17, ``ΔA`` for peft ``lora_B`` and ``ΔBᵀ`` for ``lora_A``); ``scale``,
    the noise standard deviation ``σC/B`` in it (public; 0 without DP); ``noise_sq``, the squared norm of the
    noise it holds, a diagnostic not covered by ε (with the release it pins the clipped sum), or ``None``."""

    tensors: dict[str, Tensor]
    scale: float
    noise_sq: Tensor | None = None


class Method(abc.ABC):
    """Privatiser + update rule over a fixed set of named trainable parameters.

    A registered method (:mod:`prism.methods.registry`) states its traits as class attributes, which
    whatever depends on the method reads instead of its name."""

    name: ClassVar[str]  # the registry key and conf/method/<name>.yaml
    label: ClassVar[str]  # its row in the tables
    config_class: ClassVar[type[MethodConfig]]  # the dataclass it receives (prism.methods.schema)
    tangent: ClassVar[bool] = False  # clips, noises, updates in the tangent space (eqs. 14–22), not the factors (eq. 3)
    factors: ClassVar[tuple[str, ...]] = ("lora_A", "lora_B")  # the peft factors it clips and trains
    per_example_power: ClassVar[int] = 1  # the released loop's per-example scaling power (D3)
    hf_clips: ClassVar[bool] = True  # the released non-private HF recipe clips its gradient (D7)
    compare_by_default: ClassVar[bool] = True  # in make compare's default method list

    def __init__(self, params: Mapping[str, nn.Parameter], privacy: PrivacySpec | None) -> None:
        self.params = dict(params)
        self.privacy = privacy

    @property
    def dp(self) -> bool:
        return self.privacy is not None

    def tau(self, denominator: float) -> float:
        """Noise standard deviation ``σC/denominator`` of the averaged release (0 without DP)."""
        return 0.0 if self.privacy is None else self.privacy.sigma * self.privacy.clip_norm / denominator

    @abc.abstractmethod
    def zero_accumulators(self) -> None:
        """Start a logical step."""

    @abc.abstractmethod
    def accumulate(self, grads: Mapping[str, Tensor]) -> None:
        """Add one micro-batch: per-example grads ``[k, *shape]`` (DP) or their sum ``[*shape]``."""

    @abc.abstractmethod
    def add_noise(self, denominator: float, noise: NoiseSource, diagnostics: bool = True) -> Release:
        """Divide the sum by ``denominator`` and add the noise (DP): the :class:`Release` of this step."""

    @abc.abstractmethod
    def update(self, release: Release, diagnostics: bool = True) -> dict[str, Tensor]:
        """Apply the update from ``release`` and public state alone; return ``update_norm`` with ``diagnostics``."""

    @abc.abstractmethod
    def clip_stats(self) -> dict[str, Tensor]:
        """``clip_fraction`` (share of examples whose norm exceeded the clip target) and ``grad_norm_mean`` (their mean
        norm before clipping) of this step's examples, under DP; not covered by ε."""

    def step(self, denominator: float, noise: NoiseSource | torch.Generator | None,
             diagnostics: bool = True) -> dict[str, Tensor]:
        """:meth:`add_noise` then :meth:`update`; returns the step statistics as 0-dim device tensors, never read
        on the host here: :meth:`clip_stats` and, with ``diagnostics``, ``update_norm`` and ``noise_norm`` (the
        intrinsic noise added to ΔZ after division by ``denominator``, modules in quadrature). A non-finite
        gradient propagates into the parameters, which the loop checks."""
        if not denominator > 0:
            raise ValueError(f"denominator={denominator} must be positive (skip empty non-DP batches)")
        release = self.add_noise(float(denominator), as_noise_source(noise), diagnostics)
        stats = {**self.clip_stats(), **self.update(release, diagnostics)}
        if diagnostics and self.dp and release.noise_sq is not None:
            stats["noise_norm"] = release.noise_sq.sqrt()
        return stats

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-identically (optimizer moments, counters)."""

    @abc.abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...
