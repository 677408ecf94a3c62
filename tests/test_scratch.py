"""Kept CPU scratch tensors (prism.methods.scratch): reused by name on the CPU, fresh elsewhere."""
from __future__ import annotations

import math

import torch

from prism.methods.scratch import CPU_TILE_BYTES, Scratch, kept_on, tile_count


def test_cpu_scratch_is_kept_by_name_and_grows() -> None:
    scratch = Scratch(torch.float64)
    first = scratch.flat("x", 10, torch.device("cpu"))
    again = scratch.flat("x", 6, torch.device("cpu"))
    assert first.dtype == torch.float64 and again.numel() == 6
    assert again.data_ptr() == first.data_ptr()  # the same storage, overwritten by the next user
    other = scratch.flat("y", 6, torch.device("cpu"))
    assert other.data_ptr() != first.data_ptr()
    bigger = scratch.flat("x", 100, torch.device("cpu"))
    assert bigger.numel() == 100 and scratch.flat("x", 100, torch.device("cpu")).data_ptr() == bigger.data_ptr()
    as32 = scratch.flat("x", 4, torch.device("cpu"), torch.float32)
    assert as32.dtype == torch.float32


def test_pair_views_one_buffer_in_two_shapes() -> None:
    scratch = Scratch(torch.float32)
    a, b = scratch.pair("p", (3, 2), (2, 5), torch.device("cpu"))
    assert a.shape == (3, 2) and b.shape == (2, 5) and a.is_contiguous() and b.is_contiguous()
    a.fill_(1.0), b.fill_(2.0)
    flat = scratch.flat("p", 16, torch.device("cpu"))
    assert torch.equal(flat, torch.tensor([1.0] * 6 + [2.0] * 10))


def test_other_devices_get_fresh_tensors() -> None:
    meta = torch.device("meta")
    assert kept_on("cpu") and not kept_on(meta)
    scratch = Scratch(torch.float64)
    x, y = scratch.flat("x", 8, meta), scratch.flat("x", 8, meta)
    assert x.device.type == "meta" and x is not y and not scratch._kept


def test_tile_count_fits_the_cpu_tile_and_takes_everything_elsewhere() -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert tile_count(cpu, 3, 10, tile_bytes=10) == 3  # ⌊10 / 3⌋ items of 3 bytes
    assert tile_count(cpu, 11, 10, tile_bytes=10) == 1  # at least one item, even a larger one
    assert tile_count(cpu, 1, 10, tile_bytes=10) == 10 == tile_count(cpu, 1, 10, tile_bytes=math.inf)
    assert tile_count(cpu, CPU_TILE_BYTES // 4, 10) == 4  # the default tile on the CPU
    assert tile_count(meta, CPU_TILE_BYTES, 10) == 10  # off the CPU: the whole batch, one kernel per op
    assert tile_count(meta, 3, 10, tile_bytes=10) == 3
