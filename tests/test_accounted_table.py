"""Table 2 with ε including the tuning, end to end (pipelines/select.py; docs/PRIVACY.md "ε includes
tuning"): two cells of tiny candidates trained for real through the verb's plan, selection and table.
The published run is the argmax of the recorded noised scores, each cell's K is the draw of its own
generator, the table says that ε includes the tuning, and every candidate's σ is the selection's."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import TINY_RUN

from pipelines import launch, select, store
from pipelines.__main__ import main as cli
from pipelines.aggregate.records import read_run_folders
from pipelines.compose import job_config
from pipelines.run import execute
from prism.data import sub_seed
from prism.privacy.selection import calibrate_candidate_sigma, draw_candidate_count


def test_a_selection_publishes_the_best_noised_candidate_and_its_table_says_epsilon_includes_tuning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    trained: list[str] = []

    def in_process(experiment, launcher, pending, workers, overrides, log_dir):
        for job in pending:
            trained.append(job.run_hash)
            execute(job.cfg)  # the real trainer on the tiny model
        return True, ""

    monkeypatch.setattr(launch, "launch", in_process)
    from matplotlib.figure import Figure

    titles: list[str] = []
    suptitle = Figure.suptitle
    monkeypatch.setattr(Figure, "suptitle", lambda fig, text, **kw: titles.append(text) or suptitle(fig, text, **kw))
    tiny = [o for o in TINY_RUN if o != "suite=glue8"]  # the plan sets the cells
    args = ["select", "methods=prism,adamw", "eps=6", "suites=glue8", *tiny, "suite.validation_per_task=2",
            f"results_dir={tmp_path}"]
    assert cli([*args, "method=lamb"]) == 2  # a cell's key among the overrides is refused in one line
    assert "method=lamb: the plan sets" in capsys.readouterr().err
    assert cli(args) == 0
    out = capsys.readouterr().out
    for phase in ("plan", "train", "select", "render"):
        assert f"table2-accounted, {phase}" in out
    root = tmp_path / "runs"
    candidates = read_run_folders(root, select.CANDIDATES)
    assert job_config(["experiment=table2-accounted"]).experiment == select.CANDIDATES
    published = {r.get("method.name"): r for r in read_run_folders(root, select.EXPERIMENT)}
    assert set(published) == {"prism", "adamw"}
    for method, record in published.items():
        mine = sorted((r for r in candidates if r.get("method.name") == method),
                      key=lambda r: r.get("privacy.selection.candidate"))
        # K is the cell's own draw: a generator seeded from the cell and the table seed
        rng = np.random.default_rng(sub_seed(42, "table2-accounted", "glue8", "eps6", method))
        assert len(mine) == draw_candidate_count(rng, 3.0, 1.0)
        assert [r.get("privacy.selection.candidate") for r in mine] == list(range(len(mine)))
        # the published run is the argmax of the noised scores (ties: the lowest index)
        scores = [store.SelectionBlock.from_final(r.final).score for r in mine]
        assert record.run_id == mine[int(np.argmax(scores))].run_id
        # every candidate trained at the selection's σ for its q and T
        for r in mine:
            block = store.SelectionBlock.from_final(r.final)
            sigma = calibrate_candidate_sigma(6.0, 1e-5, r.final["sample_rate"], r.final["steps"], score_sigma=5.0,
                                              mean=3.0, shape=1.0)
            assert r.final["sigma"] == block.sigma == sigma and block.epsilon <= 6.0
    assert len(trained) == len(candidates) == 3  # K = 1 (PRISM) and K = 2 (AdamW) at seed 42
    md = (tmp_path / "tables" / "table2-accounted.embedded.md").read_text()
    assert md.startswith("# Table 2: Utility on GLUE8 and Math-10K, r=16, ε includes tuning")
    assert "ε includes tuning: each cell and seed is the published run" in md and "Non-DP" not in md
    assert "| Setting | Method | n | K (glue8 / math10k) |" in md and "| ε=6 | AdamW | 1 | 2 / — |" in md
    csv = pd.read_csv(tmp_path / "tables" / "table2-accounted.embedded.csv")
    cells = csv[(csv["row"] == "cell") & (csv["Setting"] == "ε=6")].set_index("Method")
    assert set(cells["tuning"]) == {"ε includes tuning"}
    assert cells.loc["AdamW", "K_glue8"] == 2 and cells.loc["PRISM", "K_glue8"] == 1
    assert set(cells["dp_guarantee"]) == {"(ε, δ)-DP as accounted, ε includes tuning"}
    assert math.isnan(cells.loc["PRISM", "K_math10k"])
    assert (tmp_path / "tables" / "table2-accounted.embedded_privacy_utility.png").read_bytes()[:4] == b"\x89PNG"
    assert len(titles) == 1 and "ε includes tuning" in titles[0]
    # rerunning trains nothing: every candidate is finished in the store
    assert cli(args) == 0 and len(trained) == 3
