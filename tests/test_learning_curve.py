"""benchmarks/learning_curve.py: evaluating along the way leaves the run the pipeline would train."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import TINY_RUN, adapter_tensors, tiny_cfg

from prism import train as T

_SPEC = importlib.util.spec_from_file_location(
    "learning_curve", Path(__file__).resolve().parents[1] / "benchmarks" / "learning_curve.py")
curve = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(curve)


def test_top_answer_and_parsed_answer() -> None:
    assert curve.top_answer([3.0, None, 3.0, 5.0]) == (3.0, 0.5)  # share of all responses, unparsed included
    assert curve.top_answer([None, None]) == (None, 0.0)
    assert curve.parsed_answer("MAWPS", "The answer is 12.") == 12.0
    assert curve.parsed_answer("AQuA", "The answer is (C).") == "C"
    assert curve.parsed_answer("SST-2", "positive") == 1 and curve.parsed_answer("SST-2", "maybe") is None


def test_curve_trains_the_pipeline_run_and_scores_it(tmp_path: Path, monkeypatch) -> None:
    cfg = tiny_cfg("method=adamw", "privacy=nondp")
    final = T.train_and_evaluate(cfg, tmp_path / "run", lambda record: None)
    built, build = [], T.build

    def keep(c):
        built.append(build(c))
        return built[-1]

    monkeypatch.setattr(T, "build", keep)
    records = curve.learning_curve(cfg, [0, 1, cfg.train.steps], emit=lambda line: None)
    assert [r["step"] for r in records] == [s for s in (0, 1, 3) for _ in final["scores"]]
    last = {r["task"]: r for r in records if r["step"] == cfg.train.steps}
    assert {t: r["score"] for t, r in last.items()} == final["scores"]
    assert {t: r["unparsed"] for t, r in last.items()} == final["parse_failure"]
    saved = {k.replace(".weight", ""): v for k, v in adapter_tensors(tmp_path / "run").items()}
    params = {k.replace(".default.weight", ""): v for k, v in built[0].params.items()}
    assert saved.keys() == params.keys()
    for name, value in params.items():  # the same weights as the pipeline's run after train.steps steps
        torch.testing.assert_close(value.detach().cpu(), saved[name], rtol=0, atol=0)


@pytest.mark.parametrize("args, fragment", [
    (["--at", "0", "9"], "--at [9] lies outside [0, train.steps=3]"),
    (["--eval-tasks", "cola"], "--eval-tasks ['cola'] are not tasks of this run"),
])
def test_bad_input_is_one_line_exit_2(args, fragment, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert curve.main([*args, "--", *TINY_RUN]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())  # no run folder
