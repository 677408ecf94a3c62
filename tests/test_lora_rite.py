"""LoRA-RITE: agrees with an independent implementation and is gauge invariant (Yen et al. 2025)."""
from __future__ import annotations

import pytest
import torch
from pytorch_optimizer import LoRARite as LibraryLoRARite

from prism.mechanism.lora import paper_factors, peft_factors
from prism.methods.lora_rite import LoRARite, bias_corrected_decay


def _names(i: int) -> tuple[str, str]:
    base = f"base_model.model.layers.{i}.self_attn.q_proj"
    return f"{base}.lora_A.default.weight", f"{base}.lora_B.default.weight"


def _pair_params(A: torch.Tensor, B: torch.Tensor, i: int) -> dict[str, torch.nn.Parameter]:
    lora_A_w, lora_B_w = peft_factors(A, B)
    a_name, b_name = _names(i)
    return {a_name: torch.nn.Parameter(lora_A_w.clone()), b_name: torch.nn.Parameter(lora_B_w.clone())}


def _set_intrinsic_grads(params: dict, Gs: list[torch.Tensor]) -> None:
    """Chain rule of paper §3 for each module: g_A = G B, g_B = Gᵀ A, written in peft layout."""
    for i, G in enumerate(Gs):
        a_name, b_name = _names(i)
        A, B = paper_factors(params[a_name].detach(), params[b_name].detach())
        g_lora_A, g_lora_B = peft_factors(G @ B, G.mT @ A)
        params[a_name].grad = g_lora_A.clone()
        params[b_name].grad = g_lora_B.clone()


def _Z(params: dict, i: int) -> torch.Tensor:
    a_name, b_name = _names(i)
    A, B = paper_factors(params[a_name].detach(), params[b_name].detach())
    return A @ B.mT


def test_bias_corrected_decay_equals_debiased_adam_average() -> None:
    beta, xs = 0.9, torch.randn(6, dtype=torch.float64)
    ema, debiased = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for t, x in enumerate(xs):
        ema = beta * ema + (1 - beta) * x
        b = bias_corrected_decay(beta, t)
        debiased = b * debiased + (1 - b) * x
        assert torch.allclose(debiased, ema / (1 - beta ** (t + 1)))


@pytest.mark.parametrize("scales", [(0.05, 0.05, 0.05), (0.4, 0.4, 30.0)], ids=["plain", "skip_and_clip"])
def test_matches_pytorch_optimizer_lora_rite(scales: tuple[float, ...]) -> None:
    """Same trajectory as pytorch_optimizer's LoRARite (its eps² inside the root is the only difference).

    Three modules, one with peft's zero-initialised lora_B (paper A = 0). In ``skip_and_clip`` the
    third module's unmagnified gradient RMS exceeds the skipping threshold and the others' global norm
    exceeds the clipping norm 1, so both optional components are exercised.
    """
    g = torch.Generator().manual_seed(1)
    shapes = [(7, 5, 3), (6, 4, 2), (5, 8, 3)]
    factors = []
    for j, (m, n, r) in enumerate(shapes):
        A = torch.zeros(m, r, dtype=torch.float64) if j == 1 else torch.randn(m, r, generator=g, dtype=torch.float64)
        factors.append((A, torch.randn(n, r, generator=g, dtype=torch.float64)))
    ours = {k: v for i, (A, B) in enumerate(factors) for k, v in _pair_params(A, B, i).items()}
    theirs = {k: torch.nn.Parameter(v.detach().clone()) for k, v in ours.items()}
    opt_ours = LoRARite(ours, lr=0.05, betas=(0.9, 0.99), eps=1e-6, update_skipping=1.0, clip_unmagnified_grad=1.0)
    opt_theirs = LibraryLoRARite(list(theirs.values()), lr=0.05, betas=(0.9, 0.99), eps=1e-6)
    for _ in range(4):
        Gs = [scales[j] * torch.randn(m, n, generator=g, dtype=torch.float64) for j, (m, n, _r) in enumerate(shapes)]
        _set_intrinsic_grads(ours, Gs)
        _set_intrinsic_grads(theirs, Gs)
        opt_ours.step()
        opt_theirs.step()
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], rtol=1e-7, atol=1e-9), name
    start = {k: v for i, (A, B) in enumerate(factors) for k, v in _pair_params(A, B, i).items()}
    assert any(not torch.equal(ours[k], start[k]) for k in ours)  # the comparison is not vacuous


def _gauge_run(make_opt, A: torch.Tensor, B: torch.Tensor, Gs: list[torch.Tensor]) -> list[torch.Tensor]:
    params = _pair_params(A, B, 0)
    opt = make_opt(params)
    Zs = []
    for G in Gs:
        _set_intrinsic_grads(params, [G])
        opt.step()
        Zs.append(_Z(params, 0))
    return Zs


@pytest.mark.parametrize(
    ("make_opt", "invariant"),
    [
        (lambda p: LoRARite(p, lr=0.05, betas=(0.9, 0.999), eps=1e-6, update_skipping=1.0, clip_unmagnified_grad=1.0), True),
        (lambda p: torch.optim.AdamW(list(p.values()), lr=0.05, weight_decay=0.0), False),
    ],
    ids=["lora_rite", "adamw"],
)
def test_update_of_Z_is_gauge_invariant(make_opt, invariant: bool) -> None:
    """Z-trajectory under (A, B) and (A R, B R^{-T}) with the same intrinsic gradients G_t (Yen et al. 2025)."""
    g = torch.Generator().manual_seed(2)
    m, n, r = 8, 6, 3
    A = torch.randn(m, r, generator=g, dtype=torch.float64)
    B = torch.randn(n, r, generator=g, dtype=torch.float64)
    R = torch.eye(r, dtype=torch.float64) * 2.0 + torch.randn(r, r, generator=g, dtype=torch.float64)
    Gs = [0.1 * torch.randn(m, n, generator=g, dtype=torch.float64) for _ in range(4)]
    original = _gauge_run(make_opt, A, B, Gs)
    gauged = _gauge_run(make_opt, A @ R, B @ torch.linalg.inv(R).mT, Gs)
    for Z, Z_gauged in zip(original, gauged):
        assert torch.allclose(Z, Z_gauged, atol=1e-9) == invariant
    assert not torch.allclose(original[-1], A @ B.mT, atol=1e-3)  # it moved


def test_unpaired_parameter_is_rejected() -> None:
    params = _pair_params(torch.randn(4, 2), torch.randn(3, 2), 0)
    params["lm_head.weight"] = torch.nn.Parameter(torch.randn(2, 2))
    with pytest.raises(ValueError, match="lm_head.weight"):
        LoRARite(params, lr=1e-3)
