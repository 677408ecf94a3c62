"""Factor-space DP-SGD (paper eq. 3) followed by a baseline optimizer (SPEC §2–§3, Table 8).

DP: each example's gradients over *all* trainable LoRA tensors are concatenated, clipped to flat norm
``C`` with Opacus' coefficient ``min(1, C/(‖g_i‖ + 1e-6))`` (eq. 3–4: this norm is not gauge
invariant), summed over the logical batch, noised once with ``N(0, σ²C²)`` per coordinate and divided
by the expected batch size ``B``; the result is handed to the optimizer as ``p.grad``.

FFA (Sun et al. 2024): the randomly initialised peft ``lora_A`` (paper ``B``) is frozen and only peft
``lora_B`` (paper ``A``) is trained, so it gets neither update nor noise and the clipping norm covers
the ``lora_B`` tensors only. ``lora_A`` parameters handed to an ``ffa`` method are frozen
(``requires_grad = False``) and kept only to evaluate the noise diagnostic.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from prism.lora import lora_pairs, read_pair
from prism.methods.base import Method, PrivacySpec
from prism.methods.optimizers import build_optimizer

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
    """Factor-space DP-SGD + the optimizer named by ``cfg.name`` (adamw | loraplus | lamb | ffa | lora_rite)."""

    def __init__(
        self, cfg: DictConfig, params: Mapping[str, nn.Parameter], privacy: PrivacySpec | None
    ) -> None:
        params = dict(params)
        self.frozen: dict[str, nn.Parameter] = {}
        if cfg.name == "ffa":
            self.frozen = {n: p for n, p in params.items() if ".lora_A." in n}
            for p in self.frozen.values():
                p.requires_grad_(False)
            params = {n: p for n, p in params.items() if n not in self.frozen}
        if not params:
            raise ValueError(f"method {cfg.name!r} got no trainable parameters; pass the LoRA factors of the peft model")
        super().__init__(params, privacy)
        self.optimizer = build_optimizer(cfg, self.params)
        everything = {**self.params, **self.frozen}
        names = [n for n in everything if ".lora_A." in n or ".lora_B." in n]
        # FFA given only lora_B cannot evaluate the diagnostic (it needs the frozen paper B).
        complete = all(n.replace(".lora_B.", ".lora_A.") in everything for n in names if ".lora_B." in n)
        self.pairs = lora_pairs(names) if complete else None
        self.zero_accumulators()

    def zero_accumulators(self) -> None:
        self.summed = {n: torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
                       for n, p in self.params.items()}
        self.examples = 0
        self.clipped = 0
        self.norm_sum = 0.0

    def accumulate(self, grads: Mapping[str, Tensor]) -> None:
        """DP: clip each example's flat factor norm to C and add; non-DP: add the micro-batch sum."""
        missing = [n for n in self.params if n not in grads]
        if missing:
            raise ValueError(f"accumulate got no gradient for {missing[0]}; pass every trainable parameter's gradient")
        if not self.dp:
            for n, acc in self.summed.items():
                if grads[n].shape != acc.shape:
                    raise ValueError(f"{n}: non-DP gradient must be the micro-batch sum of shape {tuple(acc.shape)}")
                acc.add_(grads[n].to(acc.dtype))
            return
        k = grads[next(iter(self.params))].shape[0]
        for n, p in self.params.items():
            if grads[n].shape != (k, *p.shape):
                raise ValueError(f"{n}: per-example gradient has shape {tuple(grads[n].shape)}, expected {(k, *p.shape)}")
        norms = torch.sqrt(sum(grads[n].to(acc.dtype).reshape(k, -1).pow(2).sum(1) for n, acc in self.summed.items()))
        coef = clip_coefficients(norms, self.privacy.clip_norm)
        for n, acc in self.summed.items():
            acc.add_(torch.einsum("i,i...->...", coef, grads[n].to(acc.dtype)))
        self.examples += k
        self.clipped += int((norms > self.privacy.clip_norm).sum())
        self.norm_sum += float(norms.sum())

    def privatize(
        self, denominator: float, generator: torch.Generator | None
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The gradient handed to the optimizer and the noise inside it, both divided by ``denominator``.

        DP (eq. 3): ``(Σ_i clip(g_i) + σC ξ)/B``, ``ξ ~ N(0, I)`` drawn from ``generator`` once per logical
        step, tensor by tensor in parameter order. Non-DP: ``Σ_i g_i / b`` and zero noise.
        """
        if denominator <= 0:
            raise ValueError(f"denominator must be positive (got {denominator}); skip empty non-DP batches")
        noise = {}
        for n, acc in self.summed.items():
            if self.dp:
                device = generator.device if generator is not None else acc.device
                xi = torch.randn(acc.shape, generator=generator, device=device, dtype=acc.dtype).to(acc.device)
                noise[n] = xi * (self.privacy.sigma * self.privacy.clip_norm / denominator)
            else:
                noise[n] = torch.zeros_like(acc)
        grads = {n: acc / denominator + noise[n] for n, acc in self.summed.items()}
        return grads, noise

    def noise_norm(self, noise: Mapping[str, Tensor]) -> float:
        """``sqrt(Σ_modules ‖ξ_A Bᵀ + A ξ_Bᵀ‖²_F)`` at the current factors (Fig. 1 / eq. 8 diagnostic).

        A frozen factor (FFA's peft ``lora_A``) contributes no noise. NaN when a module's other factor
        is unknown (FFA built without its frozen ``lora_A``).
        """
        if self.pairs is None:
            return float("nan")
        everything = {**self.params, **self.frozen}
        total = 0.0
        with torch.no_grad():
            for pair in self.pairs:
                A, B = read_pair(everything, pair)
                zero = {pair.a_name: torch.zeros_like(A), pair.b_name: torch.zeros_like(B.mT)}
                xi_A, xi_B = read_pair({**zero, **noise}, pair)
                total = total + first_order_noise_energy(A.double(), B.double(), xi_A.double(), xi_B.double())
        return float(torch.as_tensor(total).clamp(min=0.0).sqrt())

    def step(self, denominator: float, generator: torch.Generator | None) -> dict[str, float]:
        """Privatise, write ``p.grad``, run the optimizer; returns the base-class statistics."""
        grads, noise = self.privatize(denominator, generator)
        stats = {"noise_norm": self.noise_norm(noise) if self.dp else 0.0}
        if self.dp:
            stats["clip_fraction"] = self.clipped / self.examples if self.examples else 0.0
            stats["grad_norm_mean"] = self.norm_sum / self.examples if self.examples else 0.0
        before = {n: p.detach().clone() for n, p in self.params.items()}
        for n, p in self.params.items():
            p.grad = grads[n].to(p.dtype)
        self.optimizer.step()
        for p in self.params.values():
            p.grad = None
        with torch.no_grad():
            stats["update_norm"] = float(
                torch.sqrt(sum((p.double() - before[n].double()).pow(2).sum() for n, p in self.params.items()))
            )
        return stats

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
