"""The one place where peft's LoRA parameters meet the paper's notation (docs/ARCHITECTURE.md, Notation).

Paper: ``Z = A Bᵀ`` with ``A ∈ R^{m×r}`` (output side) and ``B ∈ R^{n×r}`` (input side).
peft:  ``lora_B.weight`` has shape ``(m, r)`` and **is** the paper's ``A``;
       ``lora_A.weight`` has shape ``(r, n)`` and **is** the paper's ``Bᵀ``.
peft adds ``scaling · lora_B(lora_A(x))`` with ``scaling = α / r``; ``Z`` excludes the scaling, so
autograd's gradients of ``lora_B.weight`` / ``lora_A.weight`` are exactly ``g_A = G B`` and
``g_Bᵀ = (Gᵀ A)ᵀ`` for the intrinsic gradient ``G = ∇_Z ℓ`` (paper §3).

Everything above this module speaks (A, B); everything below speaks peft.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

_LORA_PARAM = re.compile(r"^(?P<module>.+)\.lora_(?P<side>[AB])\.(?P<adapter>[^.]+)\.weight$")


@dataclass(frozen=True)
class LoraPair:
    """One LoRA-wrapped linear layer: the names of its two factor parameters.

    ``a_name`` is peft ``lora_B.weight`` (paper A, m×r); ``b_name`` is peft ``lora_A.weight``
    (paper Bᵀ, r×n).
    """

    module: str
    a_name: str
    b_name: str


def lora_pairs(names: Iterable[str]) -> list[LoraPair]:
    """Pair peft LoRA parameter names by module, in the order the modules first appear.

    Raises ``ValueError`` naming the module when one side of a pair is missing.
    """
    sides: dict[tuple[str, str], dict[str, str]] = {}
    for name in names:
        match = _LORA_PARAM.match(name)
        if match is None:
            continue
        key = (match["module"], match["adapter"])
        sides.setdefault(key, {})[match["side"]] = name
    pairs = []
    for (module, _adapter), found in sides.items():
        if set(found) != {"A", "B"}:
            missing = ({"A", "B"} - set(found)).pop()
            raise ValueError(f"LoRA module {module} has no lora_{missing} parameter; cannot pair its factors")
        pairs.append(LoraPair(module=module, a_name=found["B"], b_name=found["A"]))
    return pairs


def paper_factors(lora_A_weight: Tensor, lora_B_weight: Tensor) -> tuple[Tensor, Tensor]:
    """peft ``(lora_A.weight, lora_B.weight)`` → paper ``(A, B)``; leading batch dims are kept.

    ``A = lora_B.weight`` (…, m, r), ``B = lora_A.weight`` transposed (…, n, r). Views, no copies.
    """
    return lora_B_weight, lora_A_weight.transpose(-1, -2)


def peft_factors(A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    """Paper ``(A, B)`` → peft ``(lora_A.weight, lora_B.weight)``; inverse of :func:`paper_factors`."""
    return B.transpose(-1, -2), A


def read_pair(params: Mapping[str, Tensor], pair: LoraPair) -> tuple[Tensor, Tensor]:
    """The paper's ``(A, B)`` of one module from a name → tensor mapping (parameters or gradients)."""
    return paper_factors(params[pair.b_name], params[pair.a_name])


@torch.no_grad()
def write_pair(params: Mapping[str, Tensor], pair: LoraPair, A: Tensor, B: Tensor) -> None:
    """Copy paper factors ``(A, B)`` into the module's peft parameters, in their dtype."""
    lora_A_weight, lora_B_weight = peft_factors(A, B)
    params[pair.b_name].copy_(lora_A_weight)
    params[pair.a_name].copy_(lora_B_weight)
