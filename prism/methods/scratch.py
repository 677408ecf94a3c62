"""Named scratch tensors of a method's step: kept across calls on the CPU, fresh on other devices.

On the CPU a fresh block above glibc's mmap threshold page-faults on first touch, which costs about as
much as filling it, so the factor-sized temporaries a step fills every time (per-example workspaces,
noise draws, lifts, moments, directions) are kept under a name and overwritten by the next call. On
other devices they are allocated per call, so the caching allocator can hand the block to the next
backward pass. A kept tensor is scratch: it never enters a method's ``state_dict`` or a checkpoint.
"""
from __future__ import annotations

import torch
from torch import Tensor


def kept_on(device: torch.device | str) -> bool:
    """Whether scratch tensors on ``device`` are kept across calls (the CPU only)."""
    return torch.device(device).type == "cpu"


class Scratch:
    """Scratch tensors by name, in ``dtype`` unless a call asks for another one."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._kept: dict[str, Tensor] = {}

    def flat(self, name: str, numel: int, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
        """An uninitialised 1-D tensor of ``numel`` elements: the kept tensor ``name`` (grown when too small)
        on the CPU, a fresh one elsewhere."""
        dtype = dtype or self.dtype
        if not kept_on(device):
            return torch.empty(numel, dtype=dtype, device=device)
        kept = self._kept.get(name)
        if kept is None or kept.numel() < numel or kept.dtype != dtype:
            kept = self._kept[name] = torch.empty(numel, dtype=dtype, device=device)
        return kept[:numel]

    def pair(self, name: str, shape_a: torch.Size | tuple[int, ...], shape_b: torch.Size | tuple[int, ...],
             device: torch.device, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """Two contiguous tensors of shapes ``shape_a``, ``shape_b`` (e.g. a group's ``A``, ``B``) in ``name``."""
        a, b = torch.Size(shape_a).numel(), torch.Size(shape_b).numel()
        flat = self.flat(name, a + b, device, dtype)
        return flat[:a].view(shape_a), flat[a:].view(shape_b)
