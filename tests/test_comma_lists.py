"""The comma-separated lists typed on the command line (``methods=``, ``eps=``, ``seed=``, ``cases=``,
``epsilons=``, ...) are read by one parser (:func:`pipelines.config.grids.comma_list`): every verb reads the
same text as the same items, and refuses a bad list with one line that names the key as typed and a list
that works."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipelines.__main__ import main as cli


def _task(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"Is {i} even?", "target": "yes" if i % 2 == 0 else "no"}) + "\n"
                            for i in range(40)))
    return path


@pytest.mark.parametrize("verb, typed", [
    ("compare", "seed=a"),
    ("compare", "seed=1,,x"),
    ("compare", "eps=six"),
    ("compare", "methods=,"),
    ("compare", "labels=[]"),
    ("select", "seed=first"),
    ("audit", "methods=prism,sgd"),
    ("audit", "cases=,"),
    ("audit-run", "epsilons=six"),
    ("audit-run", "methods=sgd"),
    ("gpu-check", "methods=nope"),
])
def test_a_bad_list_is_one_line_naming_the_key_typed_and_a_list_that_works(
        verb: str, typed: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = typed.split("=", 1)[0]
    task = [f"task={_task(tmp_path / 't.jsonl')}", "backbone=tiny-llama", *(["labels=yes,no"] if key != "labels" else [])]
    where = {"compare": [*task, f"results_dir={tmp_path / 'r'}"], "select": [f"results_dir={tmp_path / 'r'}"],
             "audit-run": [f"out={tmp_path / 'r'}"], "gpu-check": ["profile=tiny"]}.get(verb, [])
    assert cli([verb, *where, typed]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {typed}") and "give a comma-separated list" in err, err
    assert f", e.g. {key}=" in err, err
    assert not (tmp_path / "r").exists()


def test_a_list_reads_the_same_however_it_is_spaced_or_bracketed() -> None:
    """``a,b``, `` a , b ``, ``[a,b]`` (Hydra's list syntax) and a trailing comma are the same two items."""
    from pipelines.config.grids import BUDGETS, INTEGERS, NUMBERS, comma_list

    for text in ("prism,adamw", " prism , adamw ", "[prism,adamw]", "prism,adamw,"):
        assert comma_list(text, "methods") == ["prism", "adamw"]
    assert comma_list("inf,6,1.5", "eps", BUDGETS) == [math.inf, 6.0, 1.5]
    assert comma_list("6,3", "epsilons", NUMBERS) == [6.0, 3.0]
    assert comma_list("42,43", "seed", INTEGERS) == [42, 43]
