"""Caches whose content reaches a result are verified against the sha256 recorded at build: bytes
flipped inside the evaluation prompt cache, at the same size, are detected, logged and rebuilt.

Independent expectation: the rebuilt store is byte-for-byte the store first built (the frozen
layers' forward is deterministic), and the generation inputs read from it equal the first ones.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from prism.fastpath.prompt_cache import FrozenPrompts  # noqa: E402
from prism.models import attach_lora, load_backbone  # noqa: E402

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}


def _model() -> torch.nn.Module:
    model, _ = load_backbone({"name": "tiny-llama"}, "cpu")
    return attach_lora(model, LORA, {"name": "tiny-llama", "lora_layers": 1}, init="peft",
                       generator=torch.Generator().manual_seed(0))


def _inputs(store: FrozenPrompts, rows: list[list[int]]) -> torch.Tensor:
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    cache = store.generate_inputs(list(range(len(rows))), ids, mask)["cache"]
    return torch.cat([layer.keys.flatten() for layer in cache.layers])


def test_flipped_bytes_at_the_same_size_are_rebuilt_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = _model()
    rows = [[5, 6, 7, 8, 9], [5, 6, 11], [12, 13, 14, 15]]
    first = FrozenPrompts.build(model, rows, cache_dir=tmp_path)
    assert first is not None
    tensors = first.path
    original, expected = tensors.read_bytes(), _inputs(first, rows)
    assert json.loads((tensors.parent / "meta.json").read_text())["sha256"]

    tampered = bytearray(original)
    for i in range(len(tampered) - 64, len(tampered) - 32):  # inside the tensor data, past the header
        tampered[i] ^= 0xFF
    tensors.write_bytes(bytes(tampered))
    assert tensors.stat().st_size == len(original)

    with caplog.at_level(logging.WARNING, logger="prism.fastpath.prompt_cache"):
        again = FrozenPrompts.build(model, rows, cache_dir=tmp_path)
    assert any("does not match the sha256" in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records)
    assert tensors.read_bytes() == original
    assert torch.equal(_inputs(again, rows), expected)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prism.fastpath.prompt_cache"):
        third = FrozenPrompts.build(model, rows, cache_dir=tmp_path)  # intact now: reused silently
    assert not caplog.records and again.build_seconds > 0 and third.build_seconds == 0


def test_a_store_of_the_old_format_is_rebuilt(tmp_path: Path) -> None:
    """A store that recorded only its byte count carries no content hash: rebuilt, not trusted."""
    model = _model()
    rows = [[5, 6, 7, 8], [9, 10, 11]]
    store = FrozenPrompts.build(model, rows, cache_dir=tmp_path)
    meta_path = store.path.parent / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({"format": 1, "key": meta["key"], "rows": meta["rows"],
                                     "bytes": store.path.stat().st_size}))
    assert FrozenPrompts.build(model, rows, cache_dir=tmp_path).build_seconds > 0
    assert json.loads(meta_path.read_text())["sha256"] == meta["sha256"]
