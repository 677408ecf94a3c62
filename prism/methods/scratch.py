"""Named scratch tensors of a method's step: kept across calls on the CPU, fresh on other devices.

On the CPU a fresh block above glibc's mmap threshold page-faults on first touch, which costs about as
much as filling it, so the factor-sized temporaries a step fills every time (per-example workspaces,
noise draws, lifts, moments, directions) are kept under a name and overwritten by the next call. On
other devices they are allocated per call, so the caching allocator can hand the block to the next
backward pass. A kept tensor is scratch: it never enters a method's ``state_dict`` or a checkpoint.

The same split decides how much of a batched kernel chain runs at a time (:func:`tile_budget`): on the
CPU, a tile about the size of a core's cache, so a chain that reads its input several times (PRISM's
per-example products, docs/DECISIONS.md D67) reads it from cache after the first kernel; elsewhere the
whole batch, one kernel per op however many modules it holds.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def kept_on(device: torch.device | str) -> bool:
    """Whether scratch tensors on ``device`` are kept across calls (the CPU only)."""
    return torch.device(device).type == "cpu"


CPU_TILE_BYTES = 16 << 20  # accumulate at Gemma-3-4B shapes: 2 MiB 263, 16–32 MiB 255, 64 MiB 328, whole groups 304 ms (D67)


def tile_budget(device: torch.device | str) -> float:
    """Bytes of one tile of a multi-pass kernel chain on ``device``: :data:`CPU_TILE_BYTES` on the CPU, unbounded
    elsewhere (the whole batch, one kernel per op)."""
    return CPU_TILE_BYTES if kept_on(device) else math.inf


def tile_count(device: torch.device | str, item_bytes: int, items: int, tile_bytes: float | None = None) -> int:
    """How many of ``items`` (each ``item_bytes``) one tile of a multi-pass kernel chain holds: as many as fit in
    ``tile_bytes`` (default :func:`tile_budget` of ``device``), at least one; ``math.inf``: all of them."""
    limit = tile_bytes if tile_bytes is not None else tile_budget(device)
    return items if limit >= item_bytes * items else max(1, int(limit // item_bytes))


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
