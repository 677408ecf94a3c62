"""The spectral-residual initialisation: top-r SVD of each frozen base weight, balanced factors, and
the base replaced by its residual so the effective weight is unchanged."""
from __future__ import annotations

import torch
from peft import PeftModel
from torch import Tensor

from prism.mechanism.lora import peft_factors
from prism.models.adapter import ADAPTER, lora_modules

EXACT_SVD_MAX_DIM = 1024
"""Spectral init uses the exact ``torch.linalg.svd`` when ``min(m, n)`` is at most this, else a
randomized SVD (all embedded backbones are exact; Gemma at paper scale, hidden ≥ 2304, is randomized)."""

RSVD_OVERSAMPLING = 8
RSVD_POWER_ITERATIONS = 2
SVD_MODES = ("auto", "randomized")
"""``method.init_svd``: ``auto`` (exact up to :data:`EXACT_SVD_MAX_DIM`, randomized above) or
``randomized`` for every layer, as the released code did (docs/DECISIONS.md D6)."""


def top_r_svd(W: Tensor, r: int, generator: torch.Generator | None, mode: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """``W ≈ U_r diag(S_r) V_rᵀ`` in fp32: exact SVD when ``min(m, n) ≤ EXACT_SVD_MAX_DIM`` (``mode="auto"``),
    else the randomized range finder (Halko et al. 2011) with ``r + 8`` Gaussian probes drawn from
    ``generator`` on the CPU and 2 QR-stabilised power iterations. Computed in fp32 (fp64 if ``W`` is)."""
    if mode not in SVD_MODES:
        raise ValueError(f"method.init_svd={mode!r}; choose one of {SVD_MODES}")
    W = W.to(torch.promote_types(W.dtype, torch.float32))
    if mode == "auto" and min(W.shape) <= EXACT_SVD_MAX_DIM:
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        return U[:, :r], S[:r], Vh[:r].T
    k = min(r + RSVD_OVERSAMPLING, min(W.shape))
    Omega = torch.randn(W.shape[1], k, generator=generator, dtype=torch.float32).to(W)
    Q = torch.linalg.qr(W @ Omega).Q
    for _ in range(RSVD_POWER_ITERATIONS):
        Q = torch.linalg.qr(W.T @ Q).Q
        Q = torch.linalg.qr(W @ Q).Q
    U_small, S, Vh = torch.linalg.svd(Q.T @ W, full_matrices=False)
    return (Q @ U_small)[:, :r], S[:r], Vh[:r].T


def balanced_factors(U: Tensor, S: Tensor, V: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """Paper factors ``A = U diag(√(S/s))``, ``B = V diag(√(S/s))``, so that ``s·ABᵀ = U S Vᵀ`` and
    ``M = AᵀA = N = BᵀB = diag(S)/s``."""
    root = torch.sqrt(S / scaling)
    return U * root, V * root


@torch.no_grad()
def spectral_residual_init(peft_model: PeftModel, generator: torch.Generator | None, svd: str = "auto") -> None:
    """For every LoRA layer with frozen base ``W``: balanced factors ``(A0, B0)`` of its top-r SVD into peft
    ``(lora_B, lora_A)`` and the base replaced by the residual ``W_res = W − s·A0B0ᵀ`` (in its dtype), so the
    effective weight equals ``W``; ``(A0, B0)`` are kept (fp32, CPU) in ``peft_model.prism_init_factors`` for
    :func:`export_adapter`."""
    init_factors: dict[str, tuple[Tensor, Tensor]] = {}
    for name, module in lora_modules(peft_model).items():
        base = module.get_base_layer().weight
        scaling = module.scaling[ADAPTER]
        r = module.r[ADAPTER]
        A0, B0 = balanced_factors(*top_r_svd(base, r, generator, svd), scaling)
        base.copy_((base.to(A0.dtype) - scaling * (A0 @ B0.T)).to(base.dtype))
        lora_A_weight, lora_B_weight = peft_factors(A0, B0)
        module.lora_A[ADAPTER].weight.copy_(lora_A_weight)
        module.lora_B[ADAPTER].weight.copy_(lora_B_weight)
        init_factors[name] = (A0.cpu(), B0.cpu())
    peft_model.prism_init_factors = init_factors
