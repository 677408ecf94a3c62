"""The bad-input sweep (scripts/bad_input_sweep.py) as tests: each case runs in a fresh process
against this checkout. Group 6 (task files and model folders: ids per file, train/eval leakage,
bad bytes, long evaluation rows, truncated or unknown model folders, a short context; no model is
loaded) runs in the fast suite and must be clean or correct; the whole sweep (``make test-all``)
must have no case that is silent or loses an earlier result."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def _sweep() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bad_input_sweep", REPO / "scripts" / "bad_input_sweep.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


SWEEP = _sweep()
FAST = [case for case in SWEEP.cases() if case.group in SWEEP.FAST_GROUPS]


def test_the_fast_groups_hold_cases() -> None:
    assert {case.id for case in FAST} >= {f"f{i}" for i in range(1, 15)}


@pytest.mark.parametrize("case", FAST, ids=[case.id for case in FAST])
def test_task_file_and_model_folder_inputs_are_refused_cleanly_or_accepted(case: Any) -> None:
    cls, note = SWEEP.classify(case, REPO)
    assert cls in ("clean", "correct"), f"{case.id} ({case.what}): {cls}, {note}"


@pytest.mark.slow
def test_no_input_of_the_sweep_is_accepted_silently_or_loses_a_result() -> None:
    outcomes = {case.id: SWEEP.classify(case, REPO) for case in SWEEP.cases()}
    bad = {k: v for k, v in outcomes.items() if v[0] in ("silent", "loss")}
    assert not bad, bad
