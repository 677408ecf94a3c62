"""`make gpu-check` kept alive on a CPU: the tiny multimodal profile end to end, and its parts."""
from __future__ import annotations

import re

import pytest
import torch

from pipelines import gpu_check as G
from prism.data.prompts import tokenize_example
from prism.models import byte_tokenizer


def test_tiny_profile_runs_every_check_and_prints_table5() -> None:
    lines: list[str] = []
    failures = G.run_check(G.PROFILES["tiny"], torch.device("cpu"), out=lines.append)
    text = "\n".join(lines)
    assert failures == 0, text
    table = text[text.index("Table 5"):].splitlines()
    rows = {line.split()[0]: line.split() for line in table[2:6]}
    assert set(rows) == {"DP-AdamW", "DP-LoRA+", "PRISM", "non-private"}
    assert rows["DP-AdamW"][2] == "1.000" and rows["DP-AdamW"][4] == "1.000"  # ratios are to DP-AdamW
    for label, row in rows.items():
        step, ratio = float(row[1]), float(row[2])
        assert ratio == pytest.approx(step / float(rows["DP-AdamW"][1]), abs=2e-3), label
        assert int(row[5]) > 0 and int(row[6]) > 0, label  # syncs and ops were counted
    assert re.search(r"save/kill/resume after 1 of 2 steps: bitwise identical", text)
    assert "generate: " in text


def test_synthetic_rows_fill_the_cutoff_and_carry_loss() -> None:
    tokenizer = byte_tokenizer()
    suite = G.synthetic_suite(4, 256)
    for example in suite.train:
        feature = tokenize_example(tokenizer, example, suite.cutoff_len, suite.train_on_inputs)
        assert len(feature["input_ids"]) >= 240
        assert sum(label != -100 for label in feature["labels"]) >= 16


def test_count_step_counts_value_reads_and_ops_on_cpu() -> None:
    x = torch.ones(8)

    def step() -> None:
        y = (x * 2).sum()
        bool(torch.isfinite(y))
        float(y)

    syncs, ops = G.count_step(step, torch.device("cpu"))
    assert syncs == 2 and ops >= 4


def test_without_a_gpu_the_paper_profile_says_how_to_run(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert G.main(["--profile", "paper"]) == 2
    assert capsys.readouterr().out.startswith("error: no CUDA device")
