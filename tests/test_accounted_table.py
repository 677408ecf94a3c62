"""Table 2 with ε including the tuning, end to end (pipelines/verbs/select.py; docs/PRIVACY.md "ε includes
tuning"): two cells of tiny candidates trained for real through the verb's plan, the local pool, selection
and table. The published run is the argmax of the recorded noised scores, K is the draw of a generator per
suite × ε × seed shared by its methods (or of the OS CSPRNG, kept in the store's plan file), the table says
that ε includes the tuning and carries no K (the bound holds while K is unknown), the separate audit file
carries K and the candidates under a first line saying ε does not cover it, every candidate's σ is the
selection's, W&B holds the published run of each selection only, and no printed line counts candidates."""
from __future__ import annotations

import re
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import TINY_RUN

from pipelines.__main__ import main as cli
from pipelines.config.compose import job_config
from pipelines.config.grids import Cell
from pipelines.runs import launch, store
from pipelines.tables.records import read_run_folders
from pipelines.verbs import select
from prism.data import sub_seed
from prism.privacy.selection import SEEDED_PLAN, calibrate_candidate_sigma, draw_candidate_count


class InProcessPool:
    """The local launcher's worker pool run in this process: each job runs when submitted (the real
    :func:`pipelines.runs.worker.run_job` and trainer on the tiny model), its run hash noted in ``trained``."""

    trained: list[str] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def submit(self, fn, cfg, *args) -> Future:
        InProcessPool.trained.append(store.run_hash(cfg))
        future: Future = Future()
        future.set_result(fn(cfg, *args))
        return future

    def shutdown(self, **kwargs: object) -> None:
        pass


def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Overrides that log offline W&B runs under ``tmp_path/wandb`` (as the default ``logging=offline`` does),
    with no key or settings of this machine's user in reach."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for var, sub in (("HOME", "home"), ("NETRC", "home/.netrc"), ("WANDB_CONFIG_DIR", "home/wandb")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    return ["logging=offline", f"logging.dir={tmp_path / 'wandb'}"]


def test_a_selection_publishes_the_best_noised_candidate_and_its_table_says_epsilon_includes_tuning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    trained = InProcessPool.trained = []
    monkeypatch.setattr(launch, "ProcessPoolExecutor", InProcessPool)
    from matplotlib.figure import Figure

    titles: list[str] = []
    suptitle = Figure.suptitle
    monkeypatch.setattr(Figure, "suptitle", lambda fig, text, **kw: titles.append(text) or suptitle(fig, text, **kw))
    tiny = [o for o in TINY_RUN if o not in ("suite=glue8", "logging=disabled")]  # the plan sets the cells
    args = ["select", "methods=prism,adamw", "eps=6", "suites=glue8", *tiny, "suite.validation_per_task=2",
            "suite.embedded.unscored=[]",  # both GLUE8 stand-ins scored: two columns
            f"results_dir={tmp_path}", "jobs=1", *offline_wandb(tmp_path, monkeypatch)]
    assert cli([*args, "method=lamb"]) == 2  # a cell's key among the overrides is refused in one line
    assert "method=lamb: the plan sets" in capsys.readouterr().err
    assert cli(args) == 0
    out, err = capsys.readouterr()
    for phase in ("plan", "train", "select", "render"):
        assert f"table2-accounted, {phase}" in out
    # stdout and the launcher's progress count selections, never candidates (4 here), nor name an index
    assert "plan: 2 selections (cell x seed), 0 trained, 2 to train" in out and "train: 2 selections" in out
    assert not re.search(r"\b4 candidates|candidate \d|selection\.candidate|lr_factor", out + err)
    assert "grid: 2 selection(s) on" in out and "grid: 2 selection(s) finished" in out  # plain lines: no terminal
    assert not re.search(r"\b4 (run|job)", out + err)
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
        # K is the suite × ε's draw, shared by the methods: a generator seeded from them and the table seed
        rng = np.random.default_rng(sub_seed(42, "table2-accounted", "glue8", "eps6"))
        assert len(mine) == draw_candidate_count(rng, 3.0, 1.0)
        # the audit file: K per cell and seed as the plan drew it, each candidate's factor, rate and noised score
        rows = audit[audit["Method"] == names[method]].sort_values("candidate")
        factors = select.draws(Cell("glue8", "eps6", method), 42, 3.0, 1.0, select.tune_grid())
        assert set(rows["K"]) == {len(factors)} == {len(mine)} and list(rows["candidate"]) == list(range(len(mine)))
        assert list(rows["lr_factor"]) == pytest.approx(factors)
        assert list(rows["lr"]) == pytest.approx([r.get("method.lr") for r in mine])
        assert list(rows["noised_score"]) == pytest.approx([r.final.selection.score
                                                             for r in mine], rel=1e-5)
        assert [r.get("privacy.selection.candidate") for r in mine] == list(range(len(mine)))
        # the published run is the argmax of the noised scores (ties: the lowest index)
        scores = [r.final.selection.score for r in mine]
        assert record.run_id == mine[int(np.argmax(scores))].run_id
        assert list(rows["published"]) == [k == int(np.argmax(scores)) for k in range(len(mine))]
        # every candidate trained at the selection's σ for its q and T
        for r in mine:
            block = r.final.selection
            sigma = calibrate_candidate_sigma(6.0, 1e-5, r.final.sample_rate, r.final.steps, score_sigma=5.0,
                                              mean=3.0, shape=1.0)
            assert r.final.sigma == block.sigma == sigma and block.epsilon <= 6.0
    assert len(trained) == len(candidates) == 4  # K = 2 for both methods at seed 42
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
    assert set(cells["dp_guarantee"]) == {f"(ε, δ)-DP as accounted, ε includes tuning; {SEEDED_PLAN}"}
    assert md.startswith(f"# Table 2: Utility on GLUE8 and Math-10K, r=16, ε includes tuning ({SEEDED_PLAN})")
    assert (tmp_path / "tables" / "table2-accounted.embedded_privacy_utility.png").read_bytes()[:4] == b"\x89PNG"
    assert len(titles) == 1 and "ε includes tuning" in titles[0] and not re.search(r"\bK\b", titles[0])
    # W&B holds one run per selection: the published one, without its candidate index, under an id that does not
    # hash the index; no loser's rate or score is there
    logged = sorted((tmp_path / "wandb").rglob("offline-run-*"))
    candidate_hashes = {r.run_id for r in candidates}
    assert len(logged) == 2 and all("-table2-accounted-" in p.name for p in logged)
    assert not any(h in p.name for p in logged for h in candidate_hashes)
    scores = {r.final.selection.score for r in published.values()}
    for p in logged:  # the offline log holds the run's config and summary as JSON text
        log = next(p.glob("run-*.wandb")).read_bytes()
        assert b'"score_noise"' in log and b"selection/score" in log and b"candidate" not in log
        assert sum(repr(score).encode() in log for score in scores) == 1
    # rerunning trains nothing (every candidate is finished in the store) and logs nothing again
    assert cli(args) == 0 and len(trained) == 4
    assert sorted((tmp_path / "wandb").rglob("offline-run-*")) == logged


def test_os_plans_from_the_same_seed_draw_different_candidates_and_a_rerun_reads_its_own_back(tmp_path: Path) -> None:
    def plans(results: Path, source: str) -> select.Plans:
        return select.Plans(job_config(["experiment=table2-accounted", f"privacy.noise_source={source}",
                                        f"results_dir={results}"]))

    cell, seeds = Cell("glue8", "eps6", "prism"), range(30)
    first, second = (plans(tmp_path / name, "os") for name in ("a", "b"))
    drawn = [[first.factors(cell, s) for s in seeds], [second.factors(cell, s) for s in seeds]]
    # K per seed is secret: the two stores drew their own (30 equal draws of a geometric K: probability 0.2^30)
    assert [len(f) for f in drawn[0]] != [len(f) for f in drawn[1]]
    grid = select.tune_grid()
    assert all(f in grid for fs in drawn[0] + drawn[1] for f in fs) and min(map(len, drawn[0] + drawn[1])) >= 1
    # a rerun on the same store plans the same candidates, from the store's private plan file
    assert [plans(tmp_path / "a", "os").factors(cell, s) for s in seeds] == drawn[0]
    assert len(store.read_json(tmp_path / "a" / "runs" / select.PLAN_FILE)) == 30
    # a seeded plan is the table seed's draw, and writes no plan file
    seeded = plans(tmp_path / "c", "seeded")
    assert seeded.factors(cell, 42) == select.draws(cell, 42, 3.0, 1.0, grid)
    assert not (tmp_path / "c" / "runs" / select.PLAN_FILE).exists()


def test_an_os_selection_publishes_no_k_and_its_rerun_trains_the_planned_candidates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    trained = InProcessPool.trained = []
    monkeypatch.setattr(launch, "ProcessPoolExecutor", InProcessPool)
    tiny = [o for o in TINY_RUN if o not in ("suite=glue8", "logging=disabled")]
    args = ["select", "methods=adamw", "eps=6", "suites=glue8", *tiny, "suite.validation_per_task=2",
            "privacy.noise_source=os", f"results_dir={tmp_path}", "jobs=1", *offline_wandb(tmp_path, monkeypatch)]
    assert cli(args) == 0
    out, err = capsys.readouterr()
    (factors,) = store.read_json(tmp_path / "runs" / select.PLAN_FILE).values()
    assert len(trained) == len(factors) >= 1  # the candidates the private plan drew, and no other
    assert not re.search(r"\bcandidates?\b \d|\d candidates|selection\.candidate|lr_factor", out + err)
    # the published table is no measurement of a seeded plan, and carries no K; the audit lists the plan's rates
    md = (tmp_path / "tables" / "table2-accounted.embedded.md").read_text()
    assert SEEDED_PLAN not in md and "| K" not in md
    csv = pd.read_csv(tmp_path / "tables" / "table2-accounted.embedded.csv")
    assert "K" not in csv.columns and set(csv.loc[csv["row"] == "cell", "dp_guarantee"]) == {
        "(ε, δ)-DP as accounted, ε includes tuning"}
    audit = pd.read_csv(tmp_path / "tables" / "table2-accounted.embedded.audit.csv", skiprows=1)
    assert list(audit.sort_values("candidate")["lr_factor"]) == pytest.approx(factors)
    (logged,) = (tmp_path / "wandb").rglob("offline-run-*")
    assert b"candidate" not in next(logged.glob("run-*.wandb")).read_bytes()
    # a rerun finds the same candidates finished: nothing trains, nothing is drawn again
    assert cli(args) == 0 and len(trained) == len(factors)
    assert list(store.read_json(tmp_path / "runs" / select.PLAN_FILE).values()) == [factors]


@pytest.mark.parametrize("source", ["seeded", "os"])
def test_every_method_of_a_suite_eps_and_seed_gets_the_same_candidates(tmp_path: Path, source: str) -> None:
    cfg = job_config(["experiment=table2-accounted", f"privacy.noise_source={source}", f"results_dir={tmp_path}"])
    tiny = [o for o in TINY_RUN if o != "suite=glue8"]
    selections = select.plan(cfg, tiny, ["prism", "adamw"], [6.0, 3.0], ["glue8"], [42, 43])
    by = {(s.cell.privacy, s.seed, s.cell.method): s for s in selections}
    for eps in ("eps6", "eps3"):
        for seed in (42, 43):
            prism, adamw = by[eps, seed, "prism"], by[eps, seed, "adamw"]
            # the same K and rate factors, and so the same tune.lr_factor per candidate index in the jobs
            assert prism.factors == adamw.factors
            assert [j.cfg.tune.lr_factor for j in prism.jobs] == [j.cfg.tune.lr_factor for j in adamw.jobs] \
                == prism.factors
            assert {j.cfg.method.name for j in adamw.jobs} == {"adamw"} and len(adamw.jobs) == len(prism.factors)
    if source == "seeded":  # ε and the seed still draw plans of their own: the 4 plans are not one draw repeated
        assert len({tuple(s.factors) for s in selections}) > 1
