"""Host → device copies of micro-batches that never block the host.

On CUDA a tensor is staged in pinned (page-locked) memory and copied with ``non_blocking=True``: the
copy is queued on the current stream behind the kernels already launched, so the host goes on
collating the next micro-batch. Pinned buffers come from torch's caching host allocator (reused, not
re-registered per call). On any other device this is a plain ``.to``.
"""
from __future__ import annotations

import torch
from torch import Tensor


def batch_to_device(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """Every tensor of a collated micro-batch (on the host) on ``device``: pinned and non-blocking on
    CUDA, a plain copy elsewhere."""
    if device.type != "cuda":
        return {key: value.to(device) for key, value in batch.items()}
    return {key: value.pin_memory().to(device, non_blocking=True) for key, value in batch.items()}
