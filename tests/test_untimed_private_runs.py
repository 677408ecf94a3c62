"""``privacy.log_private_stats=false`` leaves no time of any kind in what a DP run writes or prints.

A step's duration grows with its realised Poisson batch size, which the accountant assumes secret, so
with the switch off no file of the run folder, no W&B call made during training, and no line of the
run's output may carry a time (docs/PRIVACY.md, "What ε does not cover"). The positive control runs the same
job with the switch on and finds each kind of time the check looks for.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import wandb

from pipelines.__main__ import main as cli

CLOCK = re.compile(r"\d\d:\d\d:\d\d|\d{4}-\d\d-\d\dT\d\d")  # a wall-clock time or an ISO-8601 stamp
DURATION = re.compile(r"\bin \d+(\.\d+)? s\b")  # "finished in 12 s"
TIME_KEY = re.compile(r"(^|_)(time|seconds|started|ended|runtime|timestamp)(_|$)|_s$|rss|memory")


def _keys(obj: Any, prefix: str = "") -> list[str]:
    """Every key of a nested JSON-like object, as ``a/b/c`` paths."""
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in [f"{prefix}{k}", *_keys(v, f"{prefix}{k}/")]]
    if isinstance(obj, (list, tuple)):
        return [p for v in obj for p in _keys(v, prefix)]
    return []


def _time_keys(obj: Any) -> list[str]:
    return [k for k in _keys(obj) if TIME_KEY.search(k.rsplit("/", 1)[-1].lower())]


class FakeWandb:
    """Stands in for ``wandb.init`` and the run it returns: records each call and how many steps the run
    folder held then."""

    def __init__(self, runs: Path) -> None:
        self.calls: list[tuple[str, int]] = []
        self.rows: list[dict] = []
        self._runs = runs

    def _steps(self) -> int:
        return sum(len(p.read_text().splitlines()) for p in self._runs.glob("*/metrics.jsonl"))

    def init(self, **_: Any) -> SimpleNamespace:
        self.calls.append(("init", self._steps()))

        def log(row: dict, step: int | None = None) -> None:
            self.calls.append(("log", self._steps()))
            self.rows.append(row)

        return SimpleNamespace(log=log, summary={}, finish=lambda **_: self.calls.append(("finish", self._steps())))


@pytest.mark.parametrize("switch", [False, True])
def test_a_dp_run_without_private_stats_writes_and_prints_no_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], switch: bool
) -> None:
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"Is {i} even?", "target": "yes" if i % 2 == 0 else "no"}) + "\n"
                            for i in range(40)))
    results = tmp_path / "results"
    fake = FakeWandb(results / "runs")
    monkeypatch.setattr(wandb, "init", fake.init)
    code = cli(["run", "suite=custom", f"suite.custom.train={task}", "suite.custom.labels=[yes,no]", "backbone=tiny-llama",
                 "scale=smoke", "method=prism", "privacy=eps6", "privacy.noise_source=os",
                 f"privacy.log_private_stats={str(switch).lower()}", f"results_dir={results}", "logging=offline",
                 f"logging.dir={tmp_path / 'wandb'}"])
    out = capsys.readouterr()
    assert code == 0, out.err
    (folder,) = [p for p in (results / "runs").iterdir() if p.is_dir() and not p.name.startswith("_")]
    steps = len((folder / "metrics.jsonl").read_text().splitlines())
    assert steps == 2

    found: dict[str, list[str]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = str(path.relative_to(folder))
        if path.suffix == ".pt":
            found[name] = _time_keys(torch.load(path, weights_only=False))
            continue
        if path.suffix == ".safetensors":
            continue  # tensors only (the adapter's weights)
        text = path.read_text()
        records = [json.loads(line) for line in text.splitlines()] if path.suffix == ".jsonl" else \
            [json.loads(text)] if path.suffix == ".json" else []
        found[name] = [*_time_keys(records), *CLOCK.findall(text)]
    found["stdout"] = CLOCK.findall(out.out) + [m.group(0) for m in DURATION.finditer(out.out)]
    during_training = [call for call, held in fake.calls if held < steps]
    if switch:  # the control: the check finds every kind of time it looks for
        assert found["final.json"] and found["status.json"] and found["metrics.jsonl"] and found["stdout"]
        assert during_training
    else:
        assert not any(found.values()), {k: v for k, v in found.items() if v}
        assert not during_training, fake.calls  # W&B is opened only once training is over
        assert [c for c, _ in fake.calls] == ["init", "log", "log", "finish"]
        assert not any(_time_keys(row) for row in fake.rows)
