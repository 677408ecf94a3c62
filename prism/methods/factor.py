"""Factor-space DP-SGD (paper eq. 3) followed by a baseline optimizer (docs/DECISIONS.md D23, Table 8).

DP: each example's gradients over *all* trainable LoRA tensors are concatenated, clipped to flat norm
``C`` with Opacus' coefficient ``min(1, C/(‖g_i‖ + 1e-6))`` (eq. 3–4: this norm is not gauge
invariant), summed over the logical batch, noised once with ``N(0, σ²C²)`` per coordinate and divided
by the expected batch size ``B``; the result is handed to the optimizer as ``p.grad``. The noise is
drawn in float64 (:func:`prism.geometry.standard_normal`, the law PRISM's noise has; docs/DECISIONS.md
D65) and rounded to the accumulators' dtype after scaling: float32 draws stop at ≈ 5.77 standard
deviations, and a Gaussian cut there lets a neighbouring dataset's outputs fall where this one's cannot.

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

from prism.geometry import standard_normal
from prism.lora import lora_pairs, read_pair
from prism.methods.base import Method, PrivacySpec
from prism.methods.optimizers import build_optimizer
from prism.methods.scratch import Scratch, kept_on

OPACUS_NORM_EPS = 1e-6  # opacus.optimizers.optimizer.DPOptimizer.clip_and_accumulate


def clip_coefficients(norms: Tensor, clip_norm: float) -> Tensor:
    """Per-example clipping coefficients ``min(1, C/(‖g_i‖ + 1e-6))`` (eq. 3, Opacus' convention)."""
    return (clip_norm / (norms + OPACUS_NORM_EPS)).clamp(max=1.0)


def add_clipped_per_tensor(accs: list[Tensor], grads: list[Tensor], coef: Tensor) -> None:
    """``acc += Σ_i c_i g_i`` for every accumulator: one ``k``-term product per tensor (``grads``
    ``[k, *shape]`` in the accumulators' dtypes), which reads each gradient once (the CPU's path)."""
    k = coef.numel()
    for acc, g in zip(accs, grads):
        acc.view(1, -1).addmm_(coef[None].to(acc.dtype), g.reshape(k, -1))


def add_clipped_fused(accs: list[Tensor], per_example: list[tuple[Tensor, ...]], coef: Tensor) -> None:
    """``acc += Σ_i c_i g_i`` by multi-tensor kernels: per example one fused scale and one fused add over all
    tensors (``per_example[tensor][example]``), as many kernels whatever the number of tensors (GPUs' path)."""
    for i in range(coef.numel()):
        torch._foreach_add_(accs, torch._foreach_mul([slices[i] for slices in per_example], coef[i]))


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
        self.scratch = Scratch(torch.float64)  # the noise draws' kept CPU workspace (prism.methods.scratch)
        self.zero_accumulators()

    def zero_accumulators(self) -> None:
        self.summed = {n: torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32), device=p.device)
                       for n, p in self.params.items()}  # contiguous whatever the parameter's strides
        self.examples = 0
        self.norms: list[Tensor] = []

    def accumulate(self, grads: Mapping[str, Tensor]) -> None:
        """DP: clip each example's flat factor norm to C and add; non-DP: add the micro-batch sum.

        DP: one fused norm over every tensor's per-example slices (``torch._foreach_norm``), then the
        clipped sum ``Σ_i c_i g_i``, with no host read. On the CPU it is one ``k``-term product per tensor,
        reading each gradient once; elsewhere per example one fused scale and one fused add across all
        tensors (``torch._foreach_*``, a number of kernels independent of the number of tensors). The
        same split as PRISM's tiles (docs/DECISIONS.md D67), so Table 5 compares two tuned paths.
        """
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
        converted = [grads[n].to(acc.dtype) for n, acc in self.summed.items()]
        per_example = [g.unbind(0) for g in converted]  # [tensor][example]
        sq = torch.stack(torch._foreach_norm([g for slices in per_example for g in slices])).view(len(accs), k)
        norms = torch.linalg.vector_norm(sq, dim=0)
        coef = clip_coefficients(norms, self.privacy.clip_norm)
        if kept_on(accs[0].device):
            add_clipped_per_tensor(accs, converted, coef)
        else:
            add_clipped_fused(accs, per_example, coef)
        self.examples += k
        self.norms.append(norms)

    def privatize(
        self, denominator: float, generator: torch.Generator | None
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The gradient handed to the optimizer and the noise inside it, both divided by ``denominator``.

        DP (eq. 3): ``(Σ_i clip(g_i) + σC ξ)/B``, ``ξ ~ N(0, I)`` drawn in float64 from ``generator`` once per
        logical step as one flat draw split over the tensors in parameter order, scaled, then rounded to the
        accumulators' dtype. Non-DP: ``Σ_i g_i / b`` and zero noise.
        """
        if denominator <= 0:
            raise ValueError(f"denominator must be positive (got {denominator}); skip empty non-DP batches")
        names, accs = list(self.summed), list(self.summed.values())
        if self.dp:
            first = accs[0]
            device = generator.device if generator is not None else first.device
            numel = sum(a.numel() for a in accs)
            size = 2 * ((numel + 1) // 2)  # what standard_normal's workspace must hold
            workspace = self.scratch.pair("draws", (size,), (size,), device) if kept_on(device) else None
            flat = standard_normal((numel,), generator, torch.float64, device, workspace=workspace)
            # a copy even where the dtype matches: the draws live in the kept workspace, the noise is returned
            flat = flat.mul_(self.privacy.sigma * self.privacy.clip_norm / denominator).to(
                first.device, first.dtype, copy=True)
            noise = [x.view(a.shape) for x, a in zip(flat.split([a.numel() for a in accs]), accs)]
        else:
            noise = [torch.zeros_like(a) for a in accs]
        grads = torch._foreach_add(torch._foreach_div(accs, denominator), noise)
        return dict(zip(names, grads)), dict(zip(names, noise))

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

    def step(
        self, denominator: float, generator: torch.Generator | None, diagnostics: bool = True
    ) -> dict[str, Tensor]:
        """Privatise, write ``p.grad``, run the optimizer; returns the base-class statistics.

        ``noise_norm`` (float64, per module) and ``update_norm`` (needs a copy of the parameters) are
        diagnostics, computed only when asked for; all statistics are 0-dim device tensors.
        """
        grads, noise = self.privatize(denominator, generator)
        stats: dict[str, Tensor] = {}
        if diagnostics:
            stats["noise_norm"] = self.noise_norm(noise) if self.dp else torch.zeros((), dtype=torch.float64)
        if self.dp:
            norms = torch.cat(self.norms) if self.norms else torch.zeros(1)  # no example: both 0
            stats["clip_fraction"] = (norms > self.privacy.clip_norm).double().mean()
            stats["grad_norm_mean"] = norms.mean()
        before = [p.detach().clone() for p in self.params.values()] if diagnostics else None
        for n, p in self.params.items():
            p.grad = grads[n].to(p.dtype)
        self.optimizer.step()
        for p in self.params.values():
            p.grad = None
        if diagnostics:
            with torch.no_grad():
                deltas = torch._foreach_sub([p.detach().double() for p in self.params.values()],
                                            [b.double() for b in before])
                stats["update_norm"] = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(deltas)))
        return stats

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
