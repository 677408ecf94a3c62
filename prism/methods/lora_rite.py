"""LoRA-RITE (Yen et al. 2025, "LoRA done RITE: robust invariant transformation equilibration for LoRA
optimization"), written from the paper and its reference implementation's defaults (docs/DECISIONS.md D27).

For each LoRA pair ``Z = A Bᵀ`` (paper notation, :mod:`prism.mechanism.lora`) and each step:

1. thin QR ``A = Q_A R_A``, ``B = Q_B R_B``;
2. *unmagnified* gradients ``u_A = g_A R_B⁻¹ = G Q_B`` and ``u_B = g_B R_A⁻¹ = Gᵀ Q_A`` — the gradient
   expressed in the orthonormal basis of the *other* factor (pseudo-inverse, so a zero factor such
   as peft's zero-initialised ``lora_B`` gives a zero unmagnified gradient instead of an error);
3. optional update skipping (a tensor whose RMS exceeds ``update_skipping`` is zeroed) and optional
   global clipping of all unmagnified gradients to norm ``clip_unmagnified_grad``;
4. the r×r second moment ``V_A`` (and the first moment ``m_A``) live in the basis ``Q_B``: on a basis
   change they are transported with ``P = Q_B,newᵀ Q_B,old`` (``V ← P V Pᵀ``, ``m ← m Pᵀ``), then
   ``V_A ← β̂₂ V_A + (1 − β̂₂) u_Aᵀu_A / m``;
5. ``ū_A = u_A V_A^{-1/2}`` with eigenvalue map ``w ↦ 1/(√max(w, 0) + eps)``; ``m_A ← β̂₁ m_A + (1 − β̂₁) ū_A``;
6. ``A ← A − lr · m_A R_B^{-T}`` (so ``ΔA Bᵀ = −lr · m_A Q_Bᵀ``), symmetrically for ``B``.

``β̂ = β(1 − β^t)/(1 − β^{t+1})`` (t = number of earlier steps) folds Adam's bias correction into the
decay. Steps 2–6 make the update of ``Z`` invariant under any gauge ``(A R, B R^{-T})``, ``R ∈ GL(r)``.

Under DP the gradient this optimizer sees is already privatised, so the clipping in step 3 is
post-processing (no privacy cost) — but it changes the method. Defaults follow the released DP
baseline, which called LoRA-RITE with its reference defaults: ``update_skipping = 1.0``,
``clip_unmagnified_grad = 1.0`` (0 disables either); weight decay, update capping and the
"escape mass" correction of the reference are off there and are not implemented here.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from prism.mechanism.lora import lora_pairs, paper_factors


def bias_corrected_decay(beta: float, t: int) -> float:
    """``β(1 − β^t)/(1 − β^{t+1})``: the EMA decay that equals Adam's debiased average (t ≥ 0 earlier steps)."""
    return beta * (1.0 - beta**t) / (1.0 - beta ** (t + 1))


def inverse_sqrt_psd(V: Tensor, eps: float) -> Tensor:
    """``V^{-1/2}`` of a symmetric PSD r×r matrix via ``eigh``, eigenvalues mapped ``w ↦ 1/(√max(w,0) + eps)``."""
    w, U = torch.linalg.eigh(0.5 * (V + V.mT))
    return (U * (w.clamp(min=0.0).sqrt() + eps).reciprocal()) @ U.mT


class LoRARite(torch.optim.Optimizer):
    """LoRA-RITE over peft LoRA factors paired by module name; per-pair state under peft ``lora_B.weight``:
    ``t``, ``V_A``, ``V_B`` (r×r), ``m_A`` (m×r), ``m_B`` (n×r) and ``Q_A``, ``Q_B`` (the last step's bases)."""

    def __init__(self, params: Mapping[str, nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, update_skipping: float = 1.0, clip_unmagnified_grad: float = 1.0) -> None:
        pairs = lora_pairs(params)
        paired = {n for p in pairs for n in (p.a_name, p.b_name)}
        unpaired = [n for n in params if n not in paired]
        if unpaired:
            raise ValueError(f"LoRA-RITE optimises LoRA factor pairs only; {unpaired[0]} is not a lora_A/lora_B weight")
        for pair in pairs:
            A, B = paper_factors(params[pair.b_name], params[pair.a_name])
            if A.ndim != 2 or B.ndim != 2 or A.shape[1] != B.shape[1]:
                raise ValueError(f"{pair.module}: factor shapes {tuple(A.shape)} and {tuple(B.shape)} do not share a rank")
        self._pairs = [(params[p.a_name], params[p.b_name]) for p in pairs]
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "update_skipping": update_skipping,
                    "clip_unmagnified_grad": clip_unmagnified_grad}
        super().__init__([t for pair in self._pairs for t in pair], defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One LoRA-RITE update of every pair whose two factors have gradients (module docstring, steps 1–6)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        prepared = []
        for lora_B_w, lora_A_w in self._pairs:
            if lora_B_w.grad is None or lora_A_w.grad is None:
                continue
            A, B = paper_factors(lora_A_w, lora_B_w)
            g_A, g_B = paper_factors(lora_A_w.grad, lora_B_w.grad)
            Q_A, R_A = torch.linalg.qr(A)
            Q_B, R_B = torch.linalg.qr(B)
            R_A_inv, R_B_inv = torch.linalg.pinv(R_A), torch.linalg.pinv(R_B)
            u_A, u_B = g_A @ R_B_inv, g_B @ R_A_inv
            if group["update_skipping"] > 0:  # a tensor whose RMS exceeds the threshold is zeroed
                u_A, u_B = (torch.where(u.pow(2).mean().sqrt() > group["update_skipping"], torch.zeros_like(u), u)
                            for u in (u_A, u_B))
            prepared.append((lora_B_w, A, B, Q_A, Q_B, R_A_inv, R_B_inv, u_A, u_B))
        if not prepared:
            return loss
        scale = 1.0
        if group["clip_unmagnified_grad"] > 0:
            norm = torch.sqrt(sum(u_A.pow(2).sum() + u_B.pow(2).sum() for *_, u_A, u_B in prepared))
            scale = (group["clip_unmagnified_grad"] / norm).clamp(max=1.0)
        for lora_B_w, A, B, Q_A, Q_B, R_A_inv, R_B_inv, u_A, u_B in prepared:
            state = self.state[lora_B_w]
            if not state:
                state.update(
                    t=0, V_A=A.new_zeros(A.shape[1], A.shape[1]), V_B=B.new_zeros(B.shape[1], B.shape[1]),
                    m_A=torch.zeros_like(A), m_B=torch.zeros_like(B), Q_A=torch.zeros_like(A), Q_B=torch.zeros_like(B),
                )
            t = state["t"]
            b1, b2 = (bias_corrected_decay(beta, t) for beta in group["betas"])
            # A's moments live in B's basis and vice versa.
            state["m_A"], state["V_A"] = _moment_step(u_A * scale, state["m_A"], state["V_A"], Q_B.mT @ state["Q_B"],
                                                      b1, b2, group["eps"])
            state["m_B"], state["V_B"] = _moment_step(u_B * scale, state["m_B"], state["V_B"], Q_A.mT @ state["Q_A"],
                                                      b1, b2, group["eps"])
            A.sub_(group["lr"] * (state["m_A"] @ R_B_inv.mT))
            B.sub_(group["lr"] * (state["m_B"] @ R_A_inv.mT))
            state.update(t=t + 1, Q_A=Q_A, Q_B=Q_B)
        return loss


def _moment_step(u: Tensor, m: Tensor, V: Tensor, P: Tensor, b1: float, b2: float, eps: float) -> tuple[Tensor, Tensor]:
    """Transport ``(m, V)`` by the basis change ``P``, then take the EMAs (steps 4–5); returns ``(m, V)``."""
    V = b2 * (P @ V @ P.mT) + (1.0 - b2) * (u.mT @ u) / u.shape[0]
    m = b1 * (m @ P.mT) + (1.0 - b1) * (u @ inverse_sqrt_psd(V, eps))
    return m, V
