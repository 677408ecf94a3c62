"""Shared test set-up: offline, single-threaded, seeded; `slow` tests only under `make test-all`."""
from __future__ import annotations

import os
import random
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def llm_adapters_dir() -> Path:
    """The LLM-Adapters test files beside the checkout; skip when absent (never committed)."""
    path = SHARED_DATA / "llm-adapters"
    if not path.is_dir():
        pytest.skip(f"{path} not present (real data is only available beside the workplace checkout)")
    return path
