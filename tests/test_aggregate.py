"""pipelines.tables (`python -m pipelines aggregate`): tables from fake run folders (the aggregator's input format) vs hand-computed values."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import make_run
from filelock import FileLock

from pipelines import tables as agg
from pipelines.__main__ import main as cli
from pipelines.runs import store
from pipelines.tables.render import plot_privacy_utility, to_csv_frame

PAPER = agg.PAPER_DIR
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def table2_runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"

    def make(name: str, **kw) -> None:
        make_run(root, name, experiment="table2", **kw)

    make("a1", method="prism", privacy="eps6", suite="glue8", columns={"SST-2": 0.8, "CoLA": 0.3})
    make("a2", method="prism", privacy="eps6", suite="math10k", columns={"GSM8K": 0.2})
    make("a3", method="prism", privacy="eps6", suite="math10k", columns={"GSM8K": 0.4}, seed=43)  # 2nd seed
    make("b1", method="adamw", privacy="eps6", suite="glue8", columns={"SST-2": 0.9, "CoLA": 0.1})
    make("b2", method="adamw", privacy="eps6", suite="math10k", columns={"GSM8K": 0.5})
    make("c1", method="loraplus", privacy="eps6", suite="glue8", columns={"SST-2": 0.85, "CoLA": 0.2})
    make("c2", method="loraplus", privacy="eps6", suite="math10k", state="failed")
    make("d1", method="prism", privacy="nondp", suite="glue8", final_text="{not json")
    make("d2", method="prism", privacy="nondp", suite="math10k", columns={"GSM8K": 0.6})
    make("e1", method="ffa", privacy="eps3", suite="glue8", status_text="[broken")
    make("f1", method="ffa", privacy="eps3", suite="math10k", state="running")
    make("b3", method="adamw", privacy="eps6", suite="glue8", state="failed")  # superseded by b1
    make("g1", method="adamw", privacy="eps6", suite="glue8", scale="paper", columns={"SST-2": 0.1})
    (root / "h1").mkdir()  # a folder the runner created but never wrote into
    store.tag(root, "table2", "h1")
    return root


def _row(frame: pd.DataFrame, *key) -> pd.Series:
    mask = pd.Series(True, index=frame.index)
    for col, value in zip(frame.columns, key):
        mask &= frame[col] == value
    assert mask.sum() == 1, key
    return frame[mask].iloc[0]


def test_table2_values_means_and_deltas(table2_runs: Path) -> None:
    res = agg.build_table(agg.SPECS["table2"], agg.read_run_folders(table2_runs, "table2"), "embedded")
    f = res.frame
    assert list(f[["Setting", "Method"]].itertuples(index=False, name=None))[:6] == [
        ("Non-DP", m) for m in ("FFA", "RITE", "AdamW", "LoRA+", "LAMB", "PRISM")]
    prism6 = _row(f, "ε=6", "PRISM")
    assert prism6["GSM8K"] == pytest.approx(0.3)  # mean of the two seeds
    assert prism6["Avg"] == pytest.approx((0.8 + 0.3 + 0.3) / 3)  # every available task of both suites
    assert math.isnan(prism6["MRPC"])  # no stand-in at embedded scale
    assert prism6["SST-2_paper"] == 0.919 and prism6["Avg_paper"] == 0.690
    # the interval is the bootstrap over the runs' rows (and, for GSM8K, its two seeds), around the value
    assert prism6["GSM8K_lo"] < 0.3 < prism6["GSM8K_hi"] and prism6["GSM8K_n"] == 2
    assert prism6["SST-2_lo"] < 0.8 < prism6["SST-2_hi"] and prism6["SST-2_n"] == 1
    assert prism6["GSM8K_ci"] == prism6["SST-2_ci"] != "t over seeds"
    assert prism6["eps_spent_glue8"] == pytest.approx(5.99) and prism6["n_runs"] == 3
    adamw6 = _row(f, "ε=6", "AdamW")
    assert adamw6["Avg"] == pytest.approx(0.5)
    assert math.isnan(_row(f, "ε=6", "LoRA+")["Avg"])  # its math10k run failed: no 12-task average
    assert math.isnan(_row(f, "Non-DP", "PRISM")["SST-2"]) and _row(f, "Non-DP", "PRISM")["GSM8K"] == 0.6


def _correct(p: float, n: int, rng: np.random.Generator) -> list[int]:
    """Exactly round(p·n) correct rows, at random positions."""
    return rng.permutation(np.arange(n) < round(p * n)).astype(int).tolist()


def test_best_is_marked_only_where_its_paired_interval_clears_the_runner_up(tmp_path: Path) -> None:
    """Per-row outcomes on the same 400 rows, 3 seeds: SST-2 PRISM 0.8 vs AdamW 0.5 clears; RTE 0.52 vs 0.50
    does not (a tie); the PRISM − best baseline row is PRISM minus the best baseline, paired."""
    rng = np.random.default_rng(3)
    root = tmp_path / "runs"
    for method, sst, rte in (("prism", 0.8, 0.51), ("adamw", 0.5, 0.5), ("lamb", 0.45, 0.4)):
        for seed in (42, 43, 44):
            per = {"tweet_sentiment": {"column": "SST-2", "correct": _correct(sst, 400, rng), "rows": "s"},
                   "syllogism": {"column": "RTE", "correct": _correct(rte, 400, rng), "rows": "r"}}
            cols = {v["column"]: float(np.mean(v["correct"])) for v in per.values()}
            make_run(root, f"{method}{seed}", method=method, privacy="eps6", suite="glue8", columns=cols, seed=seed,
                     experiment="table2", per_example=per)
    res = agg.build_table(agg.SPECS["table2"], agg.read_run_folders(root, "table2"), "embedded")
    prism, adamw = _row(res.frame, "ε=6", "PRISM"), _row(res.frame, "ε=6", "AdamW")
    assert prism["SST-2_mark"] == "best" and prism["SST-2_ci"] == "bootstrap" and prism["SST-2_n"] == 3
    assert prism["SST-2_lo"] < prism["SST-2"] < prism["SST-2_hi"]
    assert prism["RTE"] == pytest.approx(0.51) and adamw["RTE"] == pytest.approx(0.5)
    assert prism["RTE_mark"] == "tie" and not adamw["RTE_mark"]  # 0.51 vs 0.50 on 3 × 400 rows: noise
    diff = res.differences.iloc[0]
    assert diff["Method"] == "PRISM − best baseline" and diff["SST-2_vs"] == "AdamW"
    assert diff["SST-2"] == pytest.approx(prism["SST-2"] - adamw["SST-2"])
    assert diff["SST-2_lo"] > 0 and diff["RTE_vs"] == "AdamW" and diff["RTE_lo"] < 0 < diff["RTE_hi"]
    md = agg.to_markdown(res)
    assert f"**{prism['SST-2']:.3f}** [{prism['SST-2_lo']:.3f}, {prism['SST-2_hi']:.3f}]" in md
    assert "(tie)" in md and "| ε=6 | (best baseline) |" in md and "percentile bootstrap" in md


def test_table2_missing_list_reports_failed_corrupt_running_and_absent(table2_runs: Path) -> None:
    res = agg.build_table(agg.SPECS["table2"], agg.read_run_folders(table2_runs, "table2"), "embedded")
    text = "\n".join(res.missing)
    assert "ε=6 / LoRA+ / math10k: failed: CUDA out of memory" in text
    assert "Non-DP / PRISM / glue8: corrupt: unreadable or missing: final.json" in text
    assert "ε=3 / FFA / glue8: corrupt: unreadable or missing: status.json" in text
    assert "ε=3 / FFA / math10k: stale: started but no live job holds its lock" in text  # nobody holds f1's lock
    assert "ε=3 / PRISM / glue8: no run" in text and "ε=3 / PRISM / math10k: no run" in text
    assert any(m.startswith("no config.yaml") and m.endswith("h1)") for m in res.missing)
    assert "ε=6 / AdamW / glue8: failed: CUDA out of memory" in text and "has a finished run" in text
    assert len(res.missing) == 2 * 18 - 6 + 2  # 36 cell-suites, 6 with a finished run, + b3 + the empty folder
    assert res.ignored and "scale paper" in res.ignored[0]  # the paper-scale run is not mixed in


def test_outputs_written_with_marks_paper_and_scale(table2_runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "tables"
    assert cli(["aggregate", "experiment=table2", f"runs_dir={table2_runs}", f"out_dir={out}", "scale=embedded"]) == 0
    md = (out / "table2.embedded.md").read_text()
    assert "NOT comparable" in md and "Scale: embedded" in md
    # one number and its interval per cell (a binomial ±0.042 on 200 rows at 0.9), no paper number inside
    assert "| ε=6 | AdamW | 1 | 0.100 [0.060, 0.145] | **0.900** [0.855, 0.940] | **0.500** [0.435, 0.570] | 0.500 [0.470, 0.530] (tie) |" in md
    assert "(paper" not in md
    assert ("Columns without an embedded stand-in: MRPC, STS-B, QQP, MNLI, QNLI. "
            "Columns without a finished run: RTE, AQuA, MAWPS, SVAMP.") in md
    assert "| ε=6 | PRISM | 1/2 | **0.300** [0.240, 0.365] | 0.800 [0.745, 0.850] | 0.300 [0.160, 0.445] |" in md  # GSM8K: two seeds
    assert md.index("## The paper's numbers") > md.index("| ε=3 | PRISM |")
    assert "| ε=6 | PRISM | 0.444 | 0.919 | 0.469 | 0.690 |" in md  # the paper's own table, the shown columns
    assert ("| ε=6 | PRISM − best baseline | 1 | **+0.100** [+0.060, +0.140] p=5e-05 | **-0.100** [-0.145, -0.060] "
            "p=5e-05 | **-0.200** [") in md  # CoLA vs LoRA+, …; GSM8K's seeds differ (PRISM 2, AdamW 1): no p
    assert "| ε=6 | (best baseline) |  | PRISM beats LoRA+ | PRISM below AdamW | PRISM below AdamW | AdamW |" in md
    assert md.index("## Missing") > md.index("## The paper's numbers")
    csv = pd.read_csv(out / "table2.embedded.csv")
    assert {"scale", "row", "SST-2", "SST-2_lo", "SST-2_hi", "SST-2_n", "SST-2_ci", "SST-2_mark", "SST-2_vs"} <= set(
        csv.columns) and "MRPC" not in csv.columns
    assert set(csv["row"]) == {"cell", "paper", "PRISM − best baseline"}
    assert (csv["SST-2_mark"] == "best").sum() == 1
    assert csv[csv["row"] == "paper"].set_index("Method").loc["PRISM", "SST-2"].tolist() == [0.921, 0.919, 0.884]
    tex = (out / "table2.embedded.tex").read_text()
    assert r"\textbf{0.900} [0.855, 0.940]" in tex and r"$\varepsilon$=6" in tex and "percentile bootstrap" in tex
    png = out / "table2.embedded_privacy_utility.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(pd.read_csv(out / "table2.embedded_missing.csv")) == 32


def test_columns_trained_on_but_not_scored_have_their_own_footnote(tmp_path: Path) -> None:
    """A Math run with ``suite.embedded.unscored=[gsm_symbolic, arith_choice]``: GSM8K and AQuA are named
    as trained on but not scored, not as columns without a finished run (which SVAMP, with no run that
    scored it, still is)."""
    root = tmp_path / "runs"
    make_run(root, "m1", method="prism", privacy="eps6", suite="math10k", columns={"MAWPS": 0.5},
             experiment="table2", extra_config={"suite": {"name": "math10k", "scale": "embedded", "embedded": {
                 "tasks": ["gsm_symbolic", "arith_choice", "basic_arithmetic", "leg_counting"],
                 "unscored": ["gsm_symbolic", "arith_choice"]}}})
    res = agg.build_table(agg.SPECS["table2"], agg.read_run_folders(root, "table2"), "embedded")
    assert res.unscored == ["GSM8K", "AQuA"]
    md = agg.to_markdown(res)
    assert "Stand-in columns trained on but not scored (suite.embedded.unscored; " in md
    assert "suite.embedded.unscored=[] scores them): GSM8K, AQuA." in md
    assert "Columns without a finished run: SST-2, RTE, SVAMP." in md


def test_table4_and_table5_layouts(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    make_run(root, "r8g", experiment="table4", method="adamw", privacy="eps6", suite="glue8", r=8,
             columns={"SST-2": 0.6, "CoLA": 0.2})
    make_run(root, "r8m", experiment="table4", method="adamw", privacy="eps6", suite="math10k", r=8,
             columns={"GSM8K": 0.3})
    make_run(root, "r8p", experiment="table4", method="prism", privacy="eps6", suite="glue8", r=8,
             columns={"SST-2": 0.7})
    t4 = agg.build_table(agg.SPECS["table4"], agg.read_run_folders(root, "table4"), "embedded").frame
    row = _row(t4, 8, "AdamW")
    assert (row["GLUE8_Avg"], row["Math_Avg"]) == (pytest.approx(0.4), pytest.approx(0.3))
    assert row["Avg_12"] == pytest.approx((0.6 + 0.2 + 0.3) / 3) and row["Avg_12_paper"] == 0.614
    assert _row(t4, 8, "PRISM")["GLUE8_Avg_mark"] == "best" and not row["GLUE8_Avg_mark"]  # 0.7 vs 0.4 on 200 rows
    assert math.isnan(_row(t4, 8, "PRISM")["Avg_12"])

    for name, method, step, mem in (("x", "adamw", 1.5, 900.0), ("y", "prism", 2.5, 800.0)):
        make_run(root, name, experiment="table5", method=method, privacy="eps6", suite="math10k",
                 columns={"GSM8K": 0.1}, step_time_s=step, peak_memory_mb=mem)
    t5 = agg.build_table(agg.SPECS["table5"], agg.read_run_folders(root, "table5"), "embedded").frame
    assert _row(t5, "AdamW")["Step_time_s_mark"] == "tie" and not _row(t5, "PRISM")["Step_time_s_mark"]  # lower wins
    assert _row(t5, "PRISM")["Peak_memory_MB_mark"] == "tie"
    assert _row(t5, "PRISM")["Step_time_s_paper"] == pytest.approx(18.64)
    assert math.isnan(_row(t5, "LoRA+")["Step_time_s"])


def test_table3_backbones_paper_and_embedded(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    make_run(root, "p", experiment="table3", method="prism", privacy="eps6", suite="math10k", scale="paper",
             backbone="gemma-2-9b", paper_name="gemma-2-9b",
             columns={"GSM8K": 0.66, "AQuA": 0.5, "MAWPS": 0.8, "SVAMP": 0.7})
    make_run(root, "e", experiment="table3", method="prism", privacy="eps6", suite="math10k", backbone="gemma3-270m",
             paper_name="gemma-2-9b", columns={"GSM8K": 0.1})
    make_run(root, "x", experiment="table3", method="adamw", privacy="eps6", suite="math10k", backbone="tiny-llama",
             paper_name="tiny-llama", columns={"GSM8K": 0.2})
    records = agg.read_run_folders(root, "table3")
    paper = agg.build_table(agg.SPECS["table3"], records, "paper").frame
    row = _row(paper, "Gemma-2-9B", "PRISM")
    assert row["Avg"] == pytest.approx(0.665) and row["Avg_paper"] == 0.7019 and not row["Avg_mark"]  # alone
    assert len(paper) == 9 and "| 0.6603 |" in agg.to_markdown(agg.build_table(agg.SPECS["table3"], records, "paper"))
    embedded = agg.build_table(agg.SPECS["table3"], records, "embedded")
    # the stand-in run fills the paper's Gemma-2-9B row; a non-paper backbone becomes an extra row
    assert _row(embedded.frame, "Gemma-2-9B", "PRISM")["GSM8K"] == 0.1 and len(embedded.frame) == 10
    assert _row(embedded.frame, "tiny-llama", "AdamW")["Avg"] == 0.2
    assert "Gemma-2-9B" in embedded.frame["Backbone"].iloc[3]
    assert "gemma-2-9b → gemma3-270m" in agg.to_markdown(embedded)


def _as_wandb_run(folder: Path, flatten: bool) -> SimpleNamespace:
    """A W&B public-API-shaped run built from a real run folder (config → run.config, final → summary)."""
    status = json.loads((folder / "status.json").read_text())
    final = json.loads((folder / "final.json").read_text()) if status["state"] == "finished" else {}
    summary = dict(final)
    if flatten:
        summary = {k: v for k, v in final.items() if k != "columns"}
        summary.update({f"columns/{c}": v for c, v in final.get("columns", {}).items()})
    summary["_step"] = 10
    state = {"failed": "crashed"}.get(status["state"], status["state"])
    return SimpleNamespace(id=folder.name, state=state, config=yaml.safe_load((folder / "config.yaml").read_text()),
                           summary=summary)


@pytest.mark.parametrize("flatten", [False, True])
def test_wandb_records_give_the_same_table(table2_runs: Path, flatten: bool) -> None:
    folders = [p for p in sorted(table2_runs.iterdir()) if p.name[0] in "abc"]
    spec = agg.SPECS["table2"]
    from_runs = agg.build_table(spec, [agg.read_run_folder(p) for p in folders], "embedded")
    from_wandb = agg.build_table(spec, [agg.record_from_wandb(_as_wandb_run(p, flatten)) for p in folders],
                                 "embedded")
    pd.testing.assert_frame_equal(from_runs.frame, from_wandb.frame)
    assert any("LoRA+ / math10k: W&B state crashed" in m for m in from_wandb.missing)


def test_wandb_keeps_the_latest_forced_rerun_of_a_folder() -> None:
    a, b = "table2-0123456789ab", "table2-f12345678901"  # b: a hash that itself looks like "-f<k>"
    runs = [SimpleNamespace(id=i) for i in (a, f"{a}-f2", f"{a}-f1", b)]
    assert sorted(r.id for r in agg.latest_generation(runs)) == sorted([f"{a}-f2", b])


def test_bad_arguments_name_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["aggregate", "experiment=table9"]) == 2
    assert "use experiment= one of" in capsys.readouterr().err
    assert cli(["aggregate", "experiment=table2", "runsdir=x"]) == 2
    assert "unknown argument 'runsdir=x'" in capsys.readouterr().err


@pytest.mark.parametrize("name, tasks", [("table2", (*agg.GLUE8, *agg.MATH4)), ("table3", agg.MATH4)])
def test_paper_reference_avg_is_mean_of_tasks(name: str, tasks: tuple[str, ...]) -> None:
    paper = pd.read_csv(PAPER / f"{name}.csv")
    assert (paper[list(tasks)].mean(axis=1) - paper["Avg"]).abs().max() < 0.0006


def test_paper_reference_tables_are_mutually_consistent() -> None:
    t2, t3, t4 = (pd.read_csv(PAPER / f"table{i}.csv") for i in (2, 3, 4))
    eps6 = t2[t2["Setting"] == "ε=6"].set_index("Method")
    # Table 3's 4B rows are Table 2's ε=6 math columns
    for _, row in t3[t3["Backbone"] == "Gemma-3-4B-pt"].iterrows():
        assert list(row[list(agg.MATH4)]) == list(eps6.loc[row["Method"], list(agg.MATH4)])
    # Table 4's r=16 rows are Table 2's ε=6 suite averages; Avg_12 weighs GLUE8 8:4 against Math
    for _, row in t4[t4["Rank"] == 16].iterrows():
        ref = eps6.loc[row["Method"]]
        assert abs(ref[list(agg.GLUE8)].mean() - row["GLUE8_Avg"]) < 0.0006
        assert abs(ref[list(agg.MATH4)].mean() - row["Math_Avg"]) < 0.0006
        assert abs(ref["Avg"] - row["Avg_12"]) < 0.0006
    # three rounded numbers: each within 0.0005, so the weighted identity holds within 0.001
    assert ((8 * t4["GLUE8_Avg"] + 4 * t4["Math_Avg"]) / 12 - t4["Avg_12"]).abs().max() < 0.001


def _build(root: Path, name: str = "table2", scale: str | None = "embedded") -> agg.TableResult:
    return agg.build_table(agg.SPECS[name], agg.read_run_folders(root, name), scale)


def test_cell_averages_seeds_only_and_refuses_mixed_configs(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    kw = {"method": "prism", "privacy": "eps6", "experiment": "table2"}
    make_run(root, "s1", suite="glue8", columns={"SST-2": 0.6}, seed=1, **kw)
    make_run(root, "s2", suite="glue8", columns={"SST-2": 0.8}, seed=2, **kw)  # a seed: averaged
    make_run(root, "m1", suite="math10k", columns={"GSM8K": 0.2}, seed=1, **kw)
    make_run(root, "m2", suite="math10k", columns={"GSM8K": 0.9}, seed=2, steps=60, **kw)  # not a seed
    make_run(root, "m3", suite="math10k", columns={"GSM8K": 0.7}, seed=3, backbone="gemma3-270m", **kw)
    res = _build(root)
    row = _row(res.frame, "ε=6", "PRISM")
    assert row["SST-2"] == pytest.approx(0.7) and row["n_runs"] == 2
    assert math.isnan(row["GSM8K"]) and math.isnan(row["Avg"])  # never averaged with other steps/backbones
    refused = [m for m in res.missing if "REFUSED" in m]
    assert len(refused) == 1 and refused[0].startswith("ε=6 / PRISM / math10k: REFUSED, 3 runs")
    assert "backbone.name: gemma3-270m | smollm2-135m" in refused[0] and "train.steps: 30 | 60" in refused[0]
    assert "seed" not in refused[0].split("(", 1)[1]
    assert any("REFUSED" in w for w in res.warnings) and "WARNING: ε=6 / PRISM / math10k: REFUSED" in agg.to_markdown(res)


def test_setting_row_comes_from_epsilon_and_realised_epsilon_is_checked(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    # privacy=eps6 privacy.epsilon=inf: trained without noise, so it is a Non-DP run whatever its name
    make_run(root, "x1", method="adamw", privacy="eps6", epsilon=math.inf, suite="glue8",
             columns={"SST-2": 0.9}, experiment="table2")
    # a run whose accountant reports more than its row's ε is left out, not shown as ε=3
    make_run(root, "x2", method="adamw", privacy="eps3", suite="glue8", columns={"SST-2": 0.8},
             experiment="table2", epsilon_spent=4.5)
    make_run(root, "x3", method="prism", privacy="eps3", suite="glue8", columns={"SST-2": 0.7}, experiment="table2")
    res = _build(root)
    assert _row(res.frame, "Non-DP", "AdamW")["SST-2"] == 0.9
    assert math.isnan(_row(res.frame, "ε=6", "AdamW")["SST-2"])
    assert math.isnan(_row(res.frame, "ε=3", "AdamW")["SST-2"]) and _row(res.frame, "ε=3", "PRISM")["SST-2"] == 0.7
    assert any(m.startswith("ε=3 / AdamW / glue8: left out, realised ε=4.5 exceeds the row's ε=3") for m in res.missing)


def test_header_gives_the_runs_facts_and_labels_stand_in_averages(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    extra = {"protocol": {"name": "released"}}
    for h, method, suite, cols, rows in (("g1", "prism", "glue8", {"SST-2": 0.8, "CoLA": 0.3}, {"SST-2": 50, "CoLA": 50}),
                                         ("m1", "prism", "math10k", {"GSM8K": 0.2}, {"GSM8K": 40}),
                                         ("g2", "adamw", "glue8", {"SST-2": 0.7, "CoLA": 0.1}, {"SST-2": 50, "CoLA": 30})):
        make_run(root, h, method=method, privacy="eps6", suite=suite, columns=cols, experiment="table2",
                 extra_config=extra, n_train=400, eval_rows=rows, steps=30 if h != "g2" else 45)
    res = _build(root)
    md = agg.to_markdown(res)
    assert "| suite | runs | backbone | steps | batch | N (train) | eval rows | protocol |" in md
    assert "| glue8 | 2 | smollm2-135m (for gemma-3-4b-pt) | 30 (1 runs), 45 (1 runs) | 16 | 400 | " \
           "30–50 per task (2 tasks) (1 runs), 50 per task (2 tasks) (1 runs) | released |" in md
    assert "| math10k | 1 | smollm2-135m (for gemma-3-4b-pt) | 30 | 16 | 400 | 40 per task (1 tasks) | released |" in md
    assert "WARNING: glue8: runs of different rows differ in steps" in md  # steps is not an axis of Table 2
    assert "| Avg (mean of 3 stand-in cols) |" in md and "Avg (12" not in md
    assert "over the 3 stand-in column(s) with runs (CoLA, SST-2, GSM8K)" in md
    assert _row(res.frame, "ε=6", "PRISM")["Avg"] == pytest.approx((0.8 + 0.3 + 0.2) / 3)


def test_missing_runs_dir_is_a_one_line_error(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pipelines", "aggregate", "experiment=table2",
                           f"runs_dir={tmp_path / 'nope'}", f"out_dir={tmp_path / 'tables'}"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"error: runs_dir={tmp_path / 'nope'} does not exist")
    assert not (tmp_path / "tables").exists()


def test_tables_are_written_per_scale_and_never_replaced_by_an_empty_one(tmp_path: Path, capsys) -> None:
    root, out = tmp_path / "runs", tmp_path / "tables"
    make_run(root, "e1", method="prism", privacy="eps6", suite="glue8", columns={"SST-2": 0.8}, experiment="table2")
    assert cli(["aggregate", "experiment=table2", f"runs_dir={root}", f"out_dir={out}"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "table2.embedded.md" in before
    # a failed paper-scale launch has no finished run: nothing written, the embedded table untouched
    assert cli(["aggregate", "experiment=table2", f"runs_dir={root}", f"out_dir={out}", "scale=paper"]) == 0
    assert "no finished run at scale paper under protocol corrected; no table written" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    make_run(root, "p1", method="prism", privacy="eps6", suite="glue8", columns={"SST-2": 0.9}, experiment="table2",
             scale="paper")
    assert cli(["aggregate", "experiment=table2", f"runs_dir={root}", f"out_dir={out}", "scale=paper"]) == 0
    assert "0.900" in (out / "table2.paper.md").read_text() and (out / "table2.embedded.md").read_bytes() == before[
        "table2.embedded.md"]
    (out / "table2.paper.md").unlink()
    assert cli(["aggregate", "experiment=table2", f"runs_dir={root}", f"out_dir={out}"]) == 0  # no scale=: every scale
    assert "0.900" in (out / "table2.paper.md").read_text() and "0.800" in (out / "table2.embedded.md").read_text()


def test_running_and_stale_runs_are_told_apart_by_the_lock(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    folder = make_run(root, "r1", method="prism", privacy="eps6", suite="glue8", state="running", experiment="table2")
    with FileLock(store.lock_path(folder)):
        assert agg.read_run_folder(folder).state == "running"
        assert any("ε=6 / PRISM / glue8: running" in m for m in _build(root).missing)
    assert agg.read_run_folder(folder).state == "stale"
    assert any("ε=6 / PRISM / glue8: stale: started but no live job" in m for m in _build(root).missing)


def test_source_wandb_without_key_or_network_is_a_one_line_error(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    assert cli(["aggregate", "experiment=table2", "source=wandb", f"out_dir={tmp_path / 't'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: source=wandb: no W&B API key") and "wandb login" in err
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    assert cli(["aggregate", "experiment=table2", "source=wandb", f"out_dir={tmp_path / 't'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: source=wandb: cannot reach the W&B server" in err
    assert not (tmp_path / "t").exists()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_protocols_get_their_own_tables_and_a_side_by_side_one(tmp_path: Path, capsys) -> None:
    root, out = tmp_path / "runs", tmp_path / "tables"
    released = {"protocol": {"name": "released"}}
    not_dp = {"protocol": {"name": "released", "dp_guarantee": "not a valid DP guarantee as stated"}}
    make_run(root, "c1", method="prism", privacy="eps6", suite="glue8", columns={"SST-2": 0.75}, experiment="table2")
    make_run(root, "c2", method="adamw", privacy="nondp", suite="glue8", columns={"SST-2": 0.70}, experiment="table2",
             extra_config={"protocol": {"name": "corrected"}})
    make_run(root, "r1", method="prism", privacy="eps6", suite="glue8", columns={"SST-2": 0.60}, experiment="table2",
             extra_config=released, protocol=not_dp["protocol"])
    make_run(root, "r2", method="adamw", privacy="nondp", suite="glue8", columns={"SST-2": 0.90}, experiment="table2",
             extra_config=released)
    records = agg.read_run_folders(root, "table2")
    corrected = agg.build_table(agg.SPECS["table2"], records, "embedded")
    rel = agg.build_table(agg.SPECS["table2"], records, "embedded", protocol="released")
    # one config per cell and protocol: nothing refused, each table holds only its own runs
    assert not [m for m in corrected.missing + rel.missing if "REFUSED" in m]
    assert _row(corrected.frame, "ε=6", "PRISM")["SST-2"] == 0.75 and _row(rel.frame, "ε=6", "PRISM")["SST-2"] == 0.60
    assert _row(corrected.frame, "Non-DP", "AdamW")["SST-2"] == 0.70 and _row(rel.frame, "Non-DP", "AdamW")["SST-2"] == 0.90
    assert rel.not_dp == 1 and corrected.not_dp == 0
    assert "NOT a valid" not in agg.to_markdown(corrected)
    assert "1 private run(s) here are not a valid DP guarantee as stated" in agg.to_markdown(rel)
    csv_rel, csv_cor = to_csv_frame(rel), to_csv_frame(corrected)  # the CSV carries the flag per row
    assert set(csv_rel.loc[(csv_rel["Setting"] == "ε=6") & (csv_rel["row"] == "cell"), "dp_guarantee"]) == {"not a valid DP guarantee as stated"}
    assert set(csv_cor.loc[(csv_cor["Setting"] == "ε=6") & (csv_cor["row"] == "cell"), "dp_guarantee"]) == {"(ε, δ)-DP as accounted"}
    assert set(csv_rel.loc[(csv_rel["Setting"] == "Non-DP") & (csv_rel["row"] == "cell"), "dp_guarantee"]) == {"non-private"}
    titles = []
    import matplotlib.figure
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle", lambda self, t, **kw: titles.append(t))
    plot_privacy_utility(rel, tmp_path / "rel.png")
    plot_privacy_utility(corrected, tmp_path / "cor.png")
    monkeypatch.undo()
    assert "NOT A VALID DP GUARANTEE AS STATED" in titles[0] and "NOT A VALID" not in titles[1]
    with pytest.raises(agg.AggregateError, match="protocol=paper is not known"):
        agg.build_table(agg.SPECS["table2"], records, "embedded", protocol="paper")

    assert cli(["aggregate", "experiment=table2", f"runs_dir={root}", f"out_dir={out}"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"table2.embedded.md", "table2.embedded.released.md", "table2.embedded.protocols.md",
            "table2.embedded_privacy_utility.png", "table2.embedded.released_privacy_utility.png"} <= names
    side = (out / "table2.embedded.protocols.md").read_text()
    assert "| Setting | Method | SST-2: corrected | SST-2: released | SST-2: Δ |" in side
    assert "| ε=6 | PRISM | 0.750 | 0.600 | -0.150 |" in side and "| Non-DP | AdamW | 0.700 | 0.900 | +0.200 |" in side
    # protocol= picks one table; no side-by-side from one protocol
    (out / "table2.embedded.protocols.md").unlink()
    assert cli(["aggregate", "experiment=table2", f"runs_dir={root}", f"out_dir={out}", "protocol=released"]) == 0
    assert not (out / "table2.embedded.protocols.md").exists()
    capsys.readouterr()
    assert cli(["aggregate", "experiment=table2", f"runs_dir={root}", "protocol=nope"]) == 2
    assert capsys.readouterr().err.startswith("error: protocol=nope is not known")


def test_plot_panels_show_each_stand_in_column_at_embedded_scale(table2_runs: Path) -> None:
    from pipelines.tables.render import plot_panels

    res = _build(table2_runs)
    assert plot_panels(res) == ["Avg", "CoLA", "SST-2", "GSM8K"]  # the columns the runs have, in table order
    paper = agg.build_table(agg.SPECS["table2"], agg.read_run_folders(table2_runs, "table2"), "paper")
    assert plot_panels(paper) == ["Avg", "SST-2"]


def test_header_names_the_code_and_flags_cells_of_mixed_mechanisms(tmp_path: Path) -> None:
    """Runs record their commit; the header lists them; a cell whose seeds come from commits whose prism/
    differs (here ada5f82 → HEAD of this repository: the mechanism changed) is flagged, one whose
    commits differ only outside prism/ (c6511f1 → 50fbf60: docs) is not."""
    import subprocess

    from pipelines.tables.build import mechanism_differs

    repo = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    known = subprocess.run(["git", "cat-file", "-e", "ada5f82^{commit}"], cwd=repo).returncode == 0
    if not head or not known:
        pytest.skip("needs this repository's git history")
    assert mechanism_differs("ada5f82", head) and not mechanism_differs("c6511f1", "50fbf60")
    root = tmp_path / "runs"
    for name, seed, commit, method in (("a1", 42, "ada5f82", "prism"), ("a2", 43, head, "prism"),
                                       ("b1", 42, "c6511f1", "adamw"), ("b2", 43, "50fbf60", "adamw")):
        make_run(root, name, method=method, privacy="eps6", suite="glue8", columns={"SST-2": 0.6}, seed=seed,
                 experiment="table2", git_commit=commit, git_dirty=False)
    result = agg.build_table(agg.SPECS["table2"], agg.read_run_folders(root, "table2"), "embedded")
    flagged = [w for w in result.warnings if "MIXED CODE" in w]
    assert len(flagged) == 1 and "PRISM" in flagged[0] and "ada5f82" in flagged[0]
    assert "ada5f82" in result.header["glue8"]["code"] and "50fbf60" in result.header["glue8"]["code"]
    assert "MIXED CODE" in agg.to_markdown(result)


def test_detectable_difference_is_the_closed_form_of_the_interval_and_its_seed_variance() -> None:
    """MDE = (z_0.975 + z_0.8)·h/z_0.975 for half-width h; with per-seed differences of variance A over S
    seeds, SE² = A/S + R and the seeds for 3 points solve (z + z)²(A/S' + R) ≤ 0.03²."""
    z = 1.959964 + 0.841621
    per_seed = {42: 0.0, 43: 0.08, 44: 0.0, 45: 0.08}
    a, rest = float(np.var(list(per_seed.values()), ddof=1)), 5e-5
    se2 = a / 4 + rest
    half = 1.959964 * math.sqrt(se2)
    diff = agg.intervals.Interval(0.04, 0.04 - half, 0.04 + half, 4, "bootstrap", per_seed=per_seed)
    mde, seeds = agg.intervals.detectable(diff)
    assert mde == pytest.approx(z * math.sqrt(se2))
    assert seeds == math.ceil(a / ((0.03 / z) ** 2 - rest))
    assert z * math.sqrt(a / seeds + rest) <= 0.03 < z * math.sqrt(a / (seeds - 1) + rest)
    one_seed = agg.intervals.Interval(0.02, -0.02, 0.06, 1, "bootstrap", per_seed={42: 0.02})
    assert math.isnan(agg.intervals.detectable(one_seed)[1])  # no seed variance from one seed
    assert all(math.isnan(x) for x in agg.intervals.detectable(agg.intervals.Interval(0.0, math.nan, math.nan, 1, "none")))


def test_table_states_what_its_prism_minus_best_baseline_cells_can_detect(tmp_path: Path) -> None:
    """PRISM right on a fixed half of n = 400 rows at every seed, AdamW on none: the paired difference has
    the binomial SE √(p(1−p)/n) = 0.025 and no seed variance, so MDE = (z_0.975 + z_0.8)·0.025 and no
    number of seeds reaches 3 points (∞); the Markdown, LaTeX and CSV carry it."""
    root, n = tmp_path / "runs", 400
    for method, correct in (("prism", [1, 0] * (n // 2)), ("adamw", [0] * n)):
        for seed in (42, 43, 44):
            per = {"tweet_sentiment": {"column": "SST-2", "correct": correct, "rows": "s"}}
            make_run(root, f"{method}{seed}", method=method, privacy="eps6", suite="glue8",
                     columns={"SST-2": float(np.mean(correct))}, seed=seed, experiment="table2", per_example=per)
    res = _build(root)
    diff = res.differences.iloc[0]
    assert diff["SST-2_mde"] == pytest.approx((1.959964 + 0.841621) * math.sqrt(0.25 / n), rel=0.08)
    assert diff["SST-2_seeds3pp"] == math.inf
    md = agg.to_markdown(res)
    assert f"ε=6: SST-2 {diff['SST-2_mde']:.3f} (∞)" in md and "80 % power, 95 % confidence" in md
    assert "(80 \\% power, 95 \\% confidence" in agg.to_latex(res)
    csv = to_csv_frame(res)
    assert csv.loc[csv["row"] == "PRISM − best baseline", "SST-2_mde"].iloc[0] == pytest.approx(diff["SST-2_mde"])


def test_prism_minus_best_carries_the_sign_flip_p_and_beats_only_where_its_interval_excludes_zero(
        tmp_path: Path) -> None:
    """Per seed, on 40 paired rows: SST-2 has PRISM right alone on 5 rows and AdamW alone on 3, so over 3 seeds
    the sign-flip null is T ∝ 2X − 24 with X ~ Bin(24, ½) and p = P(|2X − 24| ≥ 6) (about 0.31: no "beats", no
    bold); RTE has PRISM right on every row and AdamW on none (p at its floor, the interval excludes 0)."""
    from scipy import stats

    root, n = tmp_path / "runs", 40
    sst = {"prism": [1] * 5 + [0] * 3 + [1] * 10 + [0] * 22, "adamw": [0] * 5 + [1] * 3 + [1] * 10 + [0] * 22}
    for method in ("prism", "adamw"):
        rte = [int(method == "prism")] * n
        for seed in (42, 43, 44):
            per = {"tweet_sentiment": {"column": "SST-2", "correct": sst[method], "rows": "s"},
                   "syllogism": {"column": "RTE", "correct": rte, "rows": "r"}}
            make_run(root, f"{method}{seed}", method=method, privacy="eps6", suite="glue8", seed=seed,
                     columns={"SST-2": float(np.mean(sst[method])), "RTE": float(np.mean(rte))}, experiment="table2",
                     per_example=per)
    res = _build(root)
    diff = res.differences.iloc[0]
    closed = float(stats.binom.cdf(9, 24, 0.5) + stats.binom.sf(14, 24, 0.5))
    assert diff["SST-2_p"] == pytest.approx(closed, abs=0.01) and diff["SST-2_lo"] < 0 < diff["SST-2_hi"]
    assert diff["RTE_p"] < 1e-3 and diff["RTE_lo"] > 0
    assert (diff["SST-2_mark"], diff["RTE_mark"]) == ("", "beats")
    md = agg.to_markdown(res)
    assert "| ε=6 | (best baseline) |  | AdamW | PRISM beats AdamW |" in md
    assert f"**+1.000** [+1.000, +1.000] p={diff['RTE_p']:.2g}" in md and "+0.050 [" in md and "**+0.050" not in md
    csv = to_csv_frame(res)
    assert csv.loc[csv["row"] == "PRISM − best baseline", "SST-2_p"].iloc[0] == pytest.approx(diff["SST-2_p"])


def test_a_column_whose_best_is_not_above_the_0_step_model_is_gated_out_of_its_block(tmp_path: Path) -> None:
    """Per seed, 40 rows per task. The 0-step model is right on rows 0–19 of SST-2 and RTE and 0–9 of GSM8K.
    At ε=6 PRISM is right on every SST-2 row, on RTE's rows 0–19 (the 0-step model's rows: difference 0) and on
    30 GSM8K rows; AdamW on 24, 18 and 20. So RTE, and only RTE, has no privacy signal at ε=6: its averages are
    the means of SST-2 and GSM8K, (1 + 0.75)/2 and (0.6 + 0.5)/2, its PRISM − best cell says so, its
    best-baseline cell names none (a dash, while the Non-DP block, AdamW on 30 rows of each, names AdamW there),
    and the best Avg over all columns, Non-DP 1.0 ≥ ε=6 (1 + 0.5 + 0.75)/3, keeps the order."""
    root, n = tmp_path / "runs", 40
    right = {("ref", "SST-2"): 20, ("ref", "RTE"): 20, ("ref", "GSM8K"): 10, ("prism", "SST-2"): 40,
             ("prism", "RTE"): 20, ("prism", "GSM8K"): 30, ("adamw", "SST-2"): 24, ("adamw", "RTE"): 18,
             ("adamw", "GSM8K"): 20, ("nondp", "SST-2"): 40, ("nondp", "RTE"): 40, ("nondp", "GSM8K"): 40,
             ("adamw_nondp", "SST-2"): 30, ("adamw_nondp", "RTE"): 30, ("adamw_nondp", "GSM8K"): 30}
    tasks = {"glue8": {"tweet_sentiment": "SST-2", "syllogism": "RTE"}, "math10k": {"gsm_symbolic": "GSM8K"}}
    runs = {"ref": dict(method="adamw", privacy="nondp", steps=0), "prism": dict(method="prism", privacy="eps6"),
            "adamw": dict(method="adamw", privacy="eps6"), "nondp": dict(method="prism", privacy="nondp"),
            "adamw_nondp": dict(method="adamw", privacy="nondp")}
    for name, kw in runs.items():
        for suite, cols in tasks.items():
            for seed in (42, 43, 44):
                per = {t: {"column": c, "correct": [1] * right[name, c] + [0] * (n - right[name, c]), "rows": c}
                       for t, c in cols.items()}
                make_run(root, f"{name}-{suite}-{seed}", suite=suite, seed=seed, experiment="table2", per_example=per,
                         columns={c: right[name, c] / n for c in cols.values()}, **kw)
    res = _build(root)
    assert res.no_signal == {"ε=6": ["RTE"]}
    assert _row(res.frame, "ε=6", "PRISM")["Avg"] == pytest.approx((1 + 0.75) / 2)
    assert _row(res.frame, "ε=6", "AdamW")["Avg"] == pytest.approx((0.6 + 0.5) / 2)
    assert _row(res.frame, "Non-DP", "PRISM")["Avg"] == pytest.approx(1.0)
    assert _row(res.frame, "0-step model", "no training")["Avg"] == pytest.approx((0.5 + 0.5 + 0.25) / 3)
    diff = res.differences.set_index("Setting").loc["ε=6"]
    assert diff["RTE_mark"] == "no privacy signal" and math.isnan(diff["RTE"])
    assert diff["Avg"] == pytest.approx((1 + 0.75) / 2 - (0.6 + 0.5) / 2)
    md = agg.to_markdown(res)
    assert "| 0-step model | no training | 3 | " in md
    assert "No privacy signal (ε=6: RTE): there the block's best method is not above the 0-step model" in md
    assert "| ε=6 | PRISM − best baseline | 3 | " in md and "| no privacy signal |" in md
    vs_row = next(line for line in md.splitlines() if line.startswith("| ε=6 | (best baseline) |"))
    assert [c.strip() for c in vs_row.strip("|").split("|")][3:6] == ["PRISM beats AdamW", "—", "PRISM beats AdamW"]
    assert (f"Non-DP 1.000 (PRISM) ≥ ε=6 {(1 + 0.5 + 0.75) / 3:.3f} (PRISM): holds.") in md
    assert "no privacy signal" in agg.to_latex(res)
    csv = to_csv_frame(res)
    assert set(csv.loc[csv["Setting"] == "0-step model", "dp_guarantee"]) == {"non-private"}


def _claim_runs(root: Path, right: dict[tuple[str, str], range]) -> agg.TableResult:
    """PRISM and AdamW at Non-DP, ε=6 and ε=3 on an SST-2 and a MAWPS column of 40 rows each, three seeds;
    ``right[method, privacy]`` the rows each gets right in both columns at every seed."""
    for (method, privacy), rows in right.items():
        correct = [int(i in rows) for i in range(40)]
        for seed in (42, 43, 44):
            for suite, task, column in (("glue8", "tweet_sentiment", "SST-2"), ("math10k", "basic_arithmetic", "MAWPS")):
                per = {task: {"column": column, "correct": correct, "rows": column}}
                make_run(root, f"{method}-{privacy}-{suite}-{seed}", method=method, privacy=privacy, suite=suite,
                         seed=seed, columns={column: float(np.mean(correct))}, experiment="table2", per_example=per)
    return _build(root)


def test_each_paper_claim_is_judged_by_the_side_its_paired_interval_excludes(tmp_path: Path) -> None:
    """The same rows right at every seed, so each paired difference is a fixed per-row difference: PRISM − AdamW
    is +10/40 at ε=6 (rows 20–29 PRISM's alone) and +20/40 at ε=3, whose per-row excess over ε=6 is rows 30–39
    (+0.25 on 10 of 40 rows in each column: the bootstrap interval excludes 0); without privacy AdamW is right on every row and
    PRISM on half (the baseline is best beyond noise). Every claim is confirmed; with PRISM and AdamW swapped at
    ε=6 the first is refuted, and with equal rows at ε=3 the second is undecided."""
    confirmed = _claim_runs(tmp_path / "a", {("prism", "eps6"): range(30), ("adamw", "eps6"): range(20),
                                             ("prism", "eps3"): range(40), ("adamw", "eps3"): range(20),
                                             ("prism", "nondp"): range(20), ("adamw", "nondp"): range(40)})
    assert [line.split(": **")[1].split("**")[0] for line in confirmed.claims] == ["confirmed"] * 4
    assert confirmed.claims[0].startswith("PRISM has the best average at ε=6: **confirmed** (PRISM − AdamW on Avg +0.250 [")
    assert confirmed.claims[2].startswith("PRISM's lead at ε=3 is larger than at ε=6: **confirmed** (")
    assert "+0.250 [" in confirmed.claims[2] and "PRISM − AdamW on Avg -0.500 [" in confirmed.claims[3]
    md = agg.to_markdown(confirmed)
    assert "The paper's claims, judged on this table" in md and f"- {confirmed.claims[3]}" in md
    assert "% - PRISM has the best average at $\\varepsilon$=3: **confirmed**" in agg.to_latex(confirmed)
    mixed = _claim_runs(tmp_path / "b", {("prism", "eps6"): range(20), ("adamw", "eps6"): range(30),
                                         ("prism", "eps3"): range(25), ("adamw", "eps3"): range(25)})
    assert [line.split(": **")[1].split("**")[0] for line in mixed.claims] == ["refuted", "undecided", "confirmed"]


def test_the_0_step_model_is_non_private_only() -> None:
    from conftest import TINY_RUN

    from pipelines.config.validate import ConfigError, load_job

    assert load_job([*TINY_RUN, "privacy=nondp", "train.steps=0"]).train.steps == 0
    with pytest.raises(ConfigError, match=r"train.steps=0 \(the untrained reference model\) releases nothing"):
        load_job([*TINY_RUN, "privacy=eps6", "train.steps=0"])


def test_every_format_states_one_privacy_statement_with_q_t_and_delta_of_the_runs(tmp_path: Path) -> None:
    """Real tiny runs (a private and a non-private one) through the aggregator: the Markdown, the LaTeX, the
    CSV and the figure carry one and the same statement, whose q, T and δ are the configs' B/N, steps and δ."""
    from conftest import tiny_cfg
    from PIL import Image

    from pipelines.runs.runner import execute
    from prism.data.embedded import EMBEDDED_TASKS

    cfgs = [tiny_cfg(f"method={m}", f"privacy={p}", "privacy.delta=2e-5", "experiment=table2", f"train.steps={t}",
                     f"results_dir={tmp_path}") for m, p, t in (("prism", "eps6", 3), ("adamw", "nondp", 3),
                                                               ("adamw", "nondp", 0))]  # the last: the 0-step model
    for cfg in cfgs:
        assert execute(cfg) == "finished"
    out = tmp_path / "tables"
    assert cli(["aggregate", "experiment=table2", f"runs_dir={tmp_path / 'runs'}", f"out_dir={out}"]) == 0
    stems = out / "table2.embedded"
    md = [x for x in Path(f"{stems}.md").read_text().splitlines() if x.startswith("Privacy: ")]
    tex = [x.removeprefix("% ") for x in Path(f"{stems}.tex").read_text().splitlines() if x.startswith("% Privacy: ")]
    csv = pd.read_csv(f"{stems}.csv")
    ours = set(csv.loc[csv["row"] != "paper", "privacy"])
    png = Image.open(out / "table2.embedded_privacy_utility.png").text["Description"]
    assert len(md) == 1 and md == tex and ours == {md[0]} and png == md[0]
    assert "| 0-step model | no training | 1 | " in Path(f"{stems}.md").read_text()
    cfg = cfgs[0]
    q = cfg.train.batch_size / (cfg.suite.embedded.train_per_task * len(EMBEDDED_TASKS["glue8"]))
    for part in ("unit one training row, add/remove adjacency", f"Poisson sampling, glue8 q = {q:.4g}, "
                 f"T = {cfg.train.steps};", "accountant PRV", "δ = 2e-05;", "ε without tuning",
                 "seeded PRNG (seeded): a measurement", "printed seed(s) 42; not a release",
                 "ε does not cover the evaluation rows", "modification times"):
        assert part in md[0], part

@pytest.mark.parametrize("columns", ["absent", None, [0.8], "0.8"])
def test_a_final_json_without_a_columns_mapping_is_listed_as_refused_not_a_traceback(
        columns: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "runs"
    make_run(root, "a1", method="prism", privacy="eps6", suite="glue8", columns={"SST-2": 0.8}, experiment="table2")
    bad = make_run(root, "b1", method="adamw", privacy="eps6", suite="glue8", columns={"SST-2": 0.6}, experiment="table2")
    final = json.loads((bad / "final.json").read_text())
    if columns == "absent":
        del final["columns"]
    else:
        final["columns"] = columns
    (bad / "final.json").write_text(json.dumps(final))
    assert cli(["aggregate", "experiment=table2", f"runs_dir={root}", f"out_dir={tmp_path / 'tables'}"]) == 0
    out = capsys.readouterr().out
    refused = [line for line in out.splitlines() if str(bad) in line]
    assert len(refused) == 1 and "refused: final.json" in refused[0] and "`columns`" in refused[0], out
    records = {Path(r.run_id).name: r for r in agg.read_run_folders(root, "table2")}
    assert (records["a1"].state, records["b1"].state) == ("finished", "refused")
