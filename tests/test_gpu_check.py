"""`make gpu-check` kept alive on a CPU: the tiny multimodal profile end to end, and its parts."""
from __future__ import annotations

import re

import pytest
import torch

from pipelines.__main__ import main as cli
from pipelines.verbs import gpu_check as G
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
    base = float(rows["DP-AdamW"][1])
    for label, row in rows.items():
        step, ratio = float(row[1]), float(row[2])
        rounding = 5e-4 * (1 + ratio) / base + 5e-4  # the printed values carry 3 decimals
        assert ratio == pytest.approx(step / base, abs=rounding), label
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
    assert cli(["gpu-check", "profile=paper"]) == 2
    assert capsys.readouterr().err.startswith("error: no CUDA device")


@pytest.mark.parametrize("methods", ["nope", "prism,nope", ","])
def test_unknown_methods_are_refused_before_any_check(methods: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: an unknown name checked nothing (the resume check skipped too) and printed "ok"."""
    assert cli(["gpu-check", "profile=tiny", f"methods={methods}"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "adamw,loraplus,prism" in out.err


@pytest.mark.slow
def test_paper_width_simulation_through_the_real_loop(capsys: pytest.CaptureFixture[str]) -> None:
    """gemma-3-4b-pt's real widths (hidden 2560, MLP 10240, 8×256 query heads, 4 KV heads), 2 layers,
    4k vocabulary, bf16 base and fp32 LoRA, through the real loop for prism and adamw: prints the
    value reads (host syncs on a GPU) and aten ops per logical step beside the step times."""
    lines: list[str] = []
    failures = G.run_check(G.PROFILES["sim"], torch.device("cpu"), methods=["adamw", "prism"], out=lines.append)
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert failures == 0, "\n".join(lines)
    assert "PRISM" in "\n".join(lines) and "DP-AdamW" in "\n".join(lines)


OFFLINE_WHEELS = ("scipy", "scikit-learn", "pytorch_optimizer", "opacus", "joblib", "hydra-core",
                  "antlr4-python3-runtime", "omegaconf", "opt_einsum", "threadpoolctl")
"""The extra wheels docs/GPU.md lists for a GPU machine without network."""


def _closure(roots: tuple[str, ...]) -> set[str]:
    """Distributions ``roots`` need, transitively (requirements without an ``extra`` marker)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen.add(key)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


@pytest.mark.slow
def test_gpu_check_runs_with_only_torch_transformers_peft_and_the_listed_wheels(tmp_path) -> None:
    """A site directory holding only those distributions (symlinks; no site-packages): the tiny
    profile must import and pass, so the wheel list of docs/GPU.md is complete."""
    import importlib.metadata as md
    import os
    import subprocess
    import sys
    from pathlib import Path

    allowed = _closure(("torch", "transformers", "peft", *OFFLINE_WHEELS))
    site = tmp_path / "site"
    site.mkdir()
    for dist in md.distributions():
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key not in allowed or not dist.files:
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files if not str(f).startswith("..")}
        for top in tops:
            source = Path(dist.locate_file(top))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{site}", "PYTHONNOUSERSITE": "1"}
    result = subprocess.run([sys.executable, "-S", "-m", "pipelines", "gpu-check", "profile=tiny"], cwd=repo,
                            env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "bitwise identical" in result.stdout
