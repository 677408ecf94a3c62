"""Table 2 with ε including the tuning, end to end (pipelines/select.py; docs/PRIVACY.md "ε includes
tuning"): two cells of tiny candidates trained for real through the verb's plan, selection and table.
The published run is the argmax of the recorded noised scores, each cell's K is the draw of its own
generator, the table says that ε includes the tuning and carries no K (the bound holds while K is
unknown), the separate audit file carries K and the candidates under a first line saying ε does not
cover it, and every candidate's σ is the selection's."""
from __future__ import annotations

import re
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
from pipelines.tune import Cell
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
    audit_csv = tmp_path / "tables" / "table2-accounted.embedded.audit.csv"
    first = audit_csv.read_text().splitlines()[0]
    assert first.startswith("# NOT COVERED BY ε, DO NOT PUBLISH with the table table2-accounted.embedded")
    audit = pd.read_csv(audit_csv, skiprows=1)
    assert set(audit["suite"]) == {"glue8"} and set(audit["seed"]) == {42}
    assert (tmp_path / "tables" / "table2-accounted.embedded.audit.md").read_text().startswith(f"{first}\n")
    names = {"prism": "PRISM", "adamw": "AdamW"}
    for method, record in published.items():
        mine = sorted((r for r in candidates if r.get("method.name") == method),
                      key=lambda r: r.get("privacy.selection.candidate"))
        # K is the cell's own draw: a generator seeded from the cell and the table seed
        rng = np.random.default_rng(sub_seed(42, "table2-accounted", "glue8", "eps6", method))
        assert len(mine) == draw_candidate_count(rng, 3.0, 1.0)
        # the audit file: K per cell and seed as the plan drew it, each candidate's factor, rate and noised score
        rows = audit[audit["Method"] == names[method]].sort_values("candidate")
        factors = select.draws(Cell("glue8", "eps6", method), 42, 3.0, 1.0, select.tune_grid())
        assert set(rows["K"]) == {len(factors)} == {len(mine)} and list(rows["candidate"]) == list(range(len(mine)))
        assert list(rows["lr_factor"]) == pytest.approx(factors)
        assert list(rows["lr"]) == pytest.approx([r.get("method.lr") for r in mine])
        assert list(rows["noised_score"]) == pytest.approx([store.SelectionBlock.from_final(r.final).score
                                                             for r in mine], rel=1e-5)
        assert [r.get("privacy.selection.candidate") for r in mine] == list(range(len(mine)))
        # the published run is the argmax of the noised scores (ties: the lowest index)
        scores = [store.SelectionBlock.from_final(r.final).score for r in mine]
        assert record.run_id == mine[int(np.argmax(scores))].run_id
        assert list(rows["published"]) == [k == int(np.argmax(scores)) for k in range(len(mine))]
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
    statement = next(line for line in md.splitlines() if line.startswith("Privacy: "))
    for part in ("accountant RDP at integer orders over the whole private selection", "ε includes the learning-rate "
                 "tuning", "the noise, the batches, K and the rates follow from the printed seed(s) 42; not a release"):
        assert part in statement, part
    # the published table carries no K: neither a column of the Markdown, LaTeX or CSV, nor the figure's title
    assert "| Setting | Method | n | SST-2 | RTE |" in md and "| ε=6 | AdamW | 1 | " in md and "| K" not in md
    assert "table2-accounted.embedded.audit.csv, kept apart from this table" in md
    tex = (tmp_path / "tables" / "table2-accounted.embedded.tex").read_text()
    assert "Setting & Method & n & SST-2 & RTE" in tex and not re.search(r"\bK\b", tex.split("\\toprule")[1])
    csv = pd.read_csv(tmp_path / "tables" / "table2-accounted.embedded.csv")
    assert not [c for c in csv.columns if c == "K" or c.startswith("K_")]
    cells = csv[(csv["row"] == "cell") & (csv["Setting"] == "ε=6")].set_index("Method")
    assert set(cells["tuning"]) == {"ε includes tuning"}
    assert set(cells["dp_guarantee"]) == {"(ε, δ)-DP as accounted, ε includes tuning"}
    assert (tmp_path / "tables" / "table2-accounted.embedded_privacy_utility.png").read_bytes()[:4] == b"\x89PNG"
    assert len(titles) == 1 and "ε includes tuning" in titles[0] and not re.search(r"\bK\b", titles[0])
    # rerunning trains nothing: every candidate is finished in the store
    assert cli(args) == 0 and len(trained) == 3
