"""Factor-space DP-SGD (paper eq. 3) followed by a baseline optimizer (docs/DECISIONS.md D23, Table 8).

DP: each example's gradients over *all* trainable LoRA tensors are concatenated, clipped to flat norm
``C' = C·(1 − CLIP_MARGIN)`` with Opacus' coefficient ``min(1, C'/(‖g_i‖ + 1e-6))`` (eq. 3–4: this norm is not
gauge invariant; the margin: docs/PRIVACY.md, "The clip margin"; a non-finite gradient gets coefficient 0),
summed over the logical batch, noised once with ``N(0, σ²C²)`` per coordinate and divided
by the expected batch size ``B``; the result is handed to the optimizer as ``p.grad``. Under DP the
clipped sum is accumulated in float64 (one ``einsum`` over the examples per tensor) and the noise drawn in
float64 (:mod:`prism.privacy.noise`, the law PRISM's noise has; docs/DECISIONS.md D65, D70); the noised
average is rounded to the parameters' dtype once: float32 sums of 256 aligned examples differ from their
neighbour's by more than C, and float32 draws stop at ≈ 5.77 standard deviations.

A subclass (:mod:`prism.methods.optimizers`) names its optimizer and its ``factors``, the peft factors
it trains. FFA (Sun et al. 2024) trains peft ``lora_B`` (paper ``A``) only: the randomly initialised
peft ``lora_A`` (paper ``B``) gets neither update nor noise and the clipping norm covers the ``lora_B``
tensors only. Parameters of a factor a method does not train are frozen (``requires_grad = False``)
and kept only to evaluate the noise diagnostic.
"""
from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from prism.mechanism.lora import lora_pairs, read_pair
from prism.methods.base import Method, PrivacySpec, Release
from prism.methods.schema import MethodConfig
from prism.privacy.noise import NoiseSource, as_noise_source

OPACUS_NORM_EPS = 1e-6  # opacus.optimizers.optimizer.DPOptimizer.clip_and_accumulate


def clip_coefficients(norms: Tensor, clip_norm: float) -> Tensor:
    """Per-example clipping coefficients ``min(1, C/(‖g_i‖ + 1e-6))`` (eq. 3, Opacus' convention)."""
    return (clip_norm / (norms + OPACUS_NORM_EPS)).clamp(max=1.0)


def first_order_noise_energy(A: Tensor, B: Tensor, xi_A: Tensor, xi_B: Tensor) -> Tensor:
    """``‖ξ_A Bᵀ + A ξ_Bᵀ‖²_F`` (eq. 7's first-order term) without forming the m×n matrix.

    Trace form: ``tr(ξ_Aᵀξ_A N) + tr(ξ_Bᵀξ_B M) + 2 tr((Aᵀξ_A)(Bᵀξ_B))`` with ``M = AᵀA``, ``N = BᵀB``;
    its expectation for i.i.d. ``N(0, τ²)`` noise is eq. 8, ``τ²(m‖B‖²_F + n‖A‖²_F)``.
    """
    return (
        ((xi_A.mT @ xi_A) * (B.mT @ B)).sum()
        + ((xi_B.mT @ xi_B) * (A.mT @ A)).sum()
        + 2.0 * torch.trace((A.mT @ xi_A) @ (B.mT @ xi_B))
    )


class FactorDPMethod(Method):
    """Factor-space DP-SGD + the optimizer of the subclass (:meth:`build_optimizer`)."""

    def __init__(self, config: MethodConfig, params: Mapping[str, nn.Parameter], privacy: PrivacySpec | None) -> None:
        self.config = config
        untrained = [f".{f}." for f in ("lora_A", "lora_B") if f not in self.factors]
        self.frozen: dict[str, nn.Parameter] = {n: p for n, p in params.items() if any(f in n for f in untrained)}
        for p in self.frozen.values():
            p.requires_grad_(False)
        params = {n: p for n, p in params.items() if n not in self.frozen}
        if not params:
            raise ValueError(f"method {self.name!r} got no trainable parameters; pass the LoRA factors of the peft model")
        super().__init__(params, privacy)
        self.optimizer = self.build_optimizer()
        everything = {**self.params, **self.frozen}
        names = [n for n in everything if ".lora_A." in n or ".lora_B." in n]
        # FFA given only lora_B cannot evaluate the diagnostic (it needs the frozen paper B).
        complete = all(n.replace(".lora_B.", ".lora_A.") in everything for n in names if ".lora_B." in n)
        self.pairs = lora_pairs(names) if complete else None
        self.zero_accumulators()

    @abc.abstractmethod
    def build_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over ``self.params``, from ``self.config``."""

    def zero_accumulators(self) -> None:
        self.summed = {n: torch.zeros(p.shape, device=p.device,  # contiguous whatever the parameter's strides
                                      dtype=torch.float64 if self.dp else torch.promote_types(p.dtype, torch.float32))
                       for n, p in self.params.items()}
        self.examples = 0
        self.norms: list[Tensor] = []

    def accumulate(self, grads: Mapping[str, Tensor]) -> None:
        """Clip and accumulate: DP clips each example's flat factor norm to C and adds ``Σ_i c_i g_i`` in float64
        (one fused norm over every tensor's per-example slices, then one ``einsum`` over the examples per
        tensor, no host read); non-DP adds the micro-batch sum."""
        missing = [n for n in self.params if n not in grads]
        if missing:
            raise ValueError(f"accumulate got no gradient for {missing[0]}; pass every trainable parameter's gradient")
        accs = list(self.summed.values())
        if not self.dp:
            for n, acc in self.summed.items():
                if grads[n].shape != acc.shape:
                    raise ValueError(f"{n}: non-DP gradient must be the micro-batch sum of shape {tuple(acc.shape)}")
            torch._foreach_add_(accs, [grads[n].to(acc.dtype) for n, acc in self.summed.items()])
            return
        k = grads[next(iter(self.params))].shape[0]
        for n, p in self.params.items():
            if grads[n].shape != (k, *p.shape):
                raise ValueError(f"{n}: per-example gradient has shape {tuple(grads[n].shape)}, expected {(k, *p.shape)}")
        converted = [grads[n].to(torch.float64, copy=True) for n in self.summed]  # zeroed in place below
        sq = torch.stack(torch._foreach_norm([g for x in converted for g in x.unbind(0)])).view(len(accs), k)
        norms = torch.linalg.vector_norm(sq, dim=0)
        finite = torch.isfinite(norms)  # a non-finite gradient contributes nothing (0 · NaN would be NaN)
        coef = torch.where(finite, clip_coefficients(norms, self.privacy.clip_target), 0.0)
        for acc, g in zip(accs, converted):
            acc.add_(torch.einsum("k,k...->...", coef, g.nan_to_num_(0.0, 0.0, 0.0)))
        self.examples += k
        self.norms.append(norms)

    @torch.no_grad()
    def privatize(self, denominator: float,
                  noise: NoiseSource | torch.Generator | None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The gradient handed to the optimizer and the noise inside it (float64), both divided by ``denominator``.

        DP (eq. 3): ``(Σ_i clip(g_i) + σC ξ)/B``, ``ξ ~ N(0, I)`` in float64 from ``noise`` once per logical step
        (one flat draw split over the tensors in parameter order), rounded to each parameter's dtype once.
        Non-DP: ``Σ_i g_i / b`` and zero noise.
        """
        if denominator <= 0:
            raise ValueError(f"denominator must be positive (got {denominator}); skip empty non-DP batches")
        noise = as_noise_source(noise)
        sums = self.summed
        if self.dp:
            sizes = [a.numel() for a in sums.values()]
            flat = noise.normal((sum(sizes),), next(iter(sums.values())).device)
            parts = flat.mul_(self.tau(denominator)).split(sizes)
            xi = {n: x.view(a.shape) for (n, a), x in zip(sums.items(), parts)}
        else:
            xi = {n: torch.zeros_like(a) for n, a in sums.items()}
        return {n: (a / denominator + xi[n]).to(self.params[n].dtype) for n, a in sums.items()}, xi

    def add_noise(self, denominator: float, noise: NoiseSource, diagnostics: bool = True) -> Release:
        """The :class:`~prism.methods.base.Release` of :meth:`privatize`; ``noise_sq`` is eq. 8's noise energy."""
        tensors, xi = self.privatize(denominator, noise)
        noise_sq = self.noise_norm(xi).square() if diagnostics and self.dp else None
        return Release(tensors=tensors, scale=self.tau(denominator), noise_sq=noise_sq)

    def noise_norm(self, noise: Mapping[str, Tensor]) -> Tensor:
        """``sqrt(Σ_modules ‖ξ_A Bᵀ + A ξ_Bᵀ‖²_F)`` at the current factors (Fig. 1 / eq. 8 diagnostic).

        A frozen factor (FFA's peft ``lora_A``) contributes no noise. NaN when a module's other factor
        is unknown (FFA built without its frozen ``lora_A``). A float64 device tensor.
        """
        if self.pairs is None:
            return torch.tensor(float("nan"), dtype=torch.float64)
        everything = {**self.params, **self.frozen}
        total = torch.zeros((), dtype=torch.float64, device=next(iter(everything.values())).device)
        with torch.no_grad():
            for pair in self.pairs:
                A, B = read_pair(everything, pair)
                zero = {pair.a_name: torch.zeros_like(A), pair.b_name: torch.zeros_like(B.mT)}
                xi_A, xi_B = read_pair({**zero, **noise}, pair)
                total = total + first_order_noise_energy(A.double(), B.double(), xi_A.double(), xi_B.double())
        return total.clamp(min=0.0).sqrt()

    def update(self, release: Release, diagnostics: bool = True) -> dict[str, Tensor]:
        """Hand the release to the optimizer as ``p.grad`` and step it; ``update_norm`` with ``diagnostics``."""
        before = [p.detach().clone() for p in self.params.values()] if diagnostics else None
        for n, p in self.params.items():
            p.grad = release.tensors[n]
        self.optimizer.step()
        for p in self.params.values():
            p.grad = None
        if not diagnostics:
            return {}
        with torch.no_grad():
            deltas = torch._foreach_sub([p.detach().double() for p in self.params.values()], [b.double() for b in before])
            return {"update_norm": torch.linalg.vector_norm(torch.stack(torch._foreach_norm(deltas)))}

    def clip_stats(self) -> dict[str, Tensor]:
        if not self.dp:
            return {}
        norms = torch.cat(self.norms) if self.norms else torch.zeros(1)  # no example: both 0
        return {"clip_fraction": (norms > self.privacy.clip_target).double().mean(), "grad_norm_mean": norms.mean()}

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
