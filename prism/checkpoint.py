"""Atomic checkpoints of everything a run needs to resume bit-identically: the trainable LoRA tensors,
the method's state, the accountant history, the step counter and every RNG state (sampler, noise, torch's
CPU generator and every CUDA device's, which LoRA dropout on a GPU draws from), written through
:func:`prism.fileio.atomic_write`, so a run killed mid-write leaves the previous checkpoint intact.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from prism.fileio import write_bytes_atomic

CHECKPOINT_FILE = "state.pt"


def rng_states() -> dict[str, Any]:
    """torch's global generators: the CPU one and one state per visible CUDA device (none without CUDA)."""
    return {"torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def restore_rng_states(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_states` saved. A checkpoint written with CUDA generators resumes only
    where the same number of CUDA devices is visible (else dropout would silently draw other masks)."""
    torch.set_rng_state(state["torch_rng"])
    cuda = state.get("cuda_rng") or []
    if not cuda:
        return
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible != len(cuda):
        raise RuntimeError(f"the checkpoint holds {len(cuda)} CUDA generator states but {visible} CUDA devices "
                           "are visible; resume with the same CUDA_VISIBLE_DEVICES, or delete the checkpoint")
    torch.cuda.set_rng_state_all(cuda)


def save_checkpoint(directory: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` atomically to ``directory/state.pt``, serialised in memory first so that a full disk fails
    in the file write (whose temporary file is removed), never inside torch's archive writer."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return write_bytes_atomic(Path(directory) / CHECKPOINT_FILE, buffer.getbuffer())


def load_checkpoint(directory: Path) -> dict[str, Any] | None:
    """The last complete checkpoint in ``directory``, or ``None`` when there is none; an unreadable one is an
    error (resuming from a corrupt state would break the privacy accounting)."""
    path = directory / CHECKPOINT_FILE
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same thing
        raise RuntimeError(
            f"checkpoint {path} is unreadable ({exc}); delete it to restart the run from step 0"
        ) from exc
