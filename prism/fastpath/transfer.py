"""Host → device copies of micro-batches that never block the host: on CUDA each tensor is staged in
pinned memory (torch's caching host allocator) and copied with ``non_blocking=True``, queued behind the
kernels already launched while the host collates the next micro-batch."""
from __future__ import annotations

import torch
from torch import Tensor


def batch_to_device(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """Every tensor of a collated micro-batch (on the host) on ``device``: pinned and non-blocking on
    CUDA, a plain copy elsewhere."""
    if device.type != "cuda":
        return {key: value.to(device) for key, value in batch.items()}
    return {key: value.pin_memory().to(device, non_blocking=True) for key, value in batch.items()}
