"""pipelines.verbs.tune (rule, edge extension, store/resume, outputs), pipelines.config.tuned_rates (what the grid reads)
and the validation split of prism.data (disjoint from training and evaluation rows)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf

from pipelines.__main__ import main as cli
from pipelines.config import tuned_rates
from pipelines.config.compose import experiment_jobs, job_config
from pipelines.config.validate import load_job
from pipelines.runs import launch
from pipelines.runs.runner import execute
from pipelines.verbs import tune
from prism.record import FinalRecord


def _exact(scores: dict[float, float]) -> dict[float, tune.Score]:
    return {f: tune.Score(s, 0.0) for f, s in scores.items()}


def test_rule_picks_the_best_and_breaks_ties_towards_the_default() -> None:
    assert tune.choose(_exact({0.1: 0.5, 1.0: 0.7, 10.0: 0.6})) == 1.0
    assert tune.choose(_exact({0.1: 0.6, 1.0: 0.6, 10.0: 0.6})) == 1.0  # flat: the default rate
    assert tune.choose(_exact({0.1: 0.6, 10.0: 0.6})) == 0.1  # same distance: the lower rate
    assert tune.choose(_exact({0.1: math.nan, 1.0: math.nan})) is None


def test_rule_takes_the_rate_nearest_the_default_within_one_standard_error_of_the_best() -> None:
    """Against a brute force over random grids: the chosen factor is within one SE (the best's) of the
    best mean, and no factor that is has a smaller |log factor| (ties: the lower factor)."""
    rng = np.random.default_rng(0)
    factors = [0.0316, 0.1, 0.316, 1.0, 3.16, 10.0, 31.6]
    for _ in range(300):
        grid = sorted(rng.choice(factors, size=rng.integers(1, len(factors) + 1), replace=False))
        scores = {float(f): tune.Score(float(rng.uniform(0.3, 0.6)), float(rng.uniform(0, 0.05))) for f in grid}
        best = max(scores.values(), key=lambda s: s.mean)
        eligible = sorted((abs(math.log(f)), f) for f, s in scores.items() if s.mean >= best.mean - best.se)
        assert tune.choose(scores) == eligible[0][1]
    # a noisy grid: ×10 scores best by less than its SE, so the default rate stays
    assert tune.choose({0.1: tune.Score(0.40, 0.02), 1.0: tune.Score(0.50, 0.02), 10.0: tune.Score(0.51, 0.02)}) == 1.0
    assert tune.choose({0.1: tune.Score(0.40, 0.02), 1.0: tune.Score(0.50, 0.02), 10.0: tune.Score(0.53, 0.02)}) == 10.0


def test_a_rates_standard_error_is_the_binomial_one_of_its_validation_rows() -> None:
    """One seed, two accuracy tasks of n rows (p = 0.3, 0.6) in two columns: the suite average's SE is
    √(Σ p(1−p)/n)/2, the closed form of the bootstrap; with no per-row data it is 0."""
    n = 400
    final = {"scores": {"sst2": 0.3, "rte": 0.6}, "columns": {"SST-2": 0.3, "RTE": 0.6}, "average": 0.45,
             "per_example": {"sst2": {"column": "SST-2", "correct": [1] * 120 + [0] * 280, "rows": "a"},
                             "rte": {"column": "RTE", "correct": [1] * 240 + [0] * 160, "rows": "b"}}}
    score = tune.score_of([FinalRecord.from_json(final)], [1], b=4000)
    assert score.mean == pytest.approx(0.45)
    assert score.se == pytest.approx(math.sqrt(0.3 * 0.7 / n + 0.6 * 0.4 / n) / 2, rel=0.08)
    assert tune.score_of([FinalRecord(average=0.45)], [1]) == tune.Score(0.45, 0.0)
    assert math.isnan(tune.score_of([FinalRecord.from_json(final), FinalRecord()], [1, 2]).mean)  # a seed without a score


def _point(cell: tune.Cell, epsilon: float, factor: float, seed: int, score: float) -> tune.Point:
    return tune.Point(cell, factor, factor * 1e-3, 1e-3, seed, None, {"epsilon": epsilon}, FinalRecord(average=score))


def test_pick_changes_count_the_cells_whose_tuning_seeds_pick_different_rates_and_how_far_apart() -> None:
    """Scores without per-row outcomes (SE 0: the rule takes the best): a private cell whose seeds peak at
    ×0.1 and ×10 (four steps of √10 apart), a private cell both of whose seeds peak at ×1, a non-private
    cell peaking at ×1 and ×3.16 (one step); one seed alone measures nothing."""
    far, same, near = (tune.Cell("glue8", p, "prism") for p in ("eps6", "eps3", "nondp"))
    peaks = {(far, 1): 0.1, (far, 2): 10.0, (same, 1): 1.0, (same, 2): 1.0, (near, 1): 1.0, (near, 2): 3.16}
    eps = {far: 6.0, same: 3.0, near: math.inf}
    points = [_point(c, eps[c], f, s, 0.9 if f == peak else 0.5 - abs(math.log(f)) / 100)
              for (c, s), peak in peaks.items() for f in (0.1, 0.316, 1.0, 3.16, 10.0)]
    assert tune.seed_picks(points) == {far: {1: 0.1, 2: 10.0}, same: {1: 1.0, 2: 1.0}, near: {1: 1.0, 2: 3.16}}
    changes = tune.pick_changes(points)
    assert changes == {"private": [1, 2], "non_private": [1, 1], "steps": [1, 0, 0, 1]}
    assert tune.pick_changes_line(changes, [1, 2]) == (
        "Picked from each tuning seed alone (1, 2), the rule's rate differs between seeds in 1 of 2 private cells "
        "and 1 of 1 non-private cells (1 by 1 grid step, 1 by 4 grid steps); the chosen rates use the mean over "
        "the seeds.")
    assert tune.pick_changes([p for p in points if p.seed == 1]) is None


def test_an_edge_optimum_extends_the_grid_by_one_step_at_most_twice() -> None:
    base = [0.1, 0.316, 1.0, 3.16, 10.0]
    rising = {f: f for f in base}
    assert tune.extension(_exact(rising), base) == pytest.approx(10 * 10 / 3.16, rel=1e-5)
    assert tune.extension(_exact({**rising, 31.6: 31.6}), base) == pytest.approx(31.6 * 10 / 3.16, rel=1e-5)
    assert tune.extension(_exact({**rising, 31.6: 31.6, 100.0: 100.0}), base) is None  # limit reached
    falling = {f: -f for f in base}
    assert tune.extension(_exact(falling), base) == pytest.approx(0.1 / (0.316 / 0.1), rel=1e-5)
    assert tune.extension(_exact({0.1: 0.1, 1.0: 0.9, 10.0: 0.2}), [0.1, 1.0, 10.0]) is None  # interior
    assert tune.extension(_exact({**rising, 31.6: 0.0}), base) is None  # the extension found the peak


def _entry(**changes) -> dict:
    cfg = job_config(["experiment=table2", "scale=smoke", "method=adamw", "privacy=eps6", "suite=glue8"])
    return {**tuned_rates.cell_fields(cfg), "lr": 0.0123, **changes}


def _file(*entries: dict) -> str:
    """A tuned-rate file of ``entries`` that says it covers exactly their cells."""
    covers = {key: list(dict.fromkeys(e[field] for e in entries)) for key, field in tuned_rates.COVERS.items()}
    return yaml.safe_dump({"generated": covers, "rates": list(entries)})


def test_the_grid_reads_the_tuned_file_only_for_its_budget(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PRISM_TUNED_DIR", str(tmp_path))
    job = ["experiment=table2", "scale=smoke", "method=adamw", "privacy=eps6", "suite=glue8"]
    default = job_config(job).method.lr
    assert default == pytest.approx(2e-4 * 10)  # no file: Table 8 × lr_multiplier
    (tmp_path / "smoke.yaml").write_text(_file(_entry()))
    assert job_config(job).method.lr == 0.0123
    assert job_config([*job[:-1], "suite=math10k"]).method.lr == pytest.approx(3e-4 * 10)  # other cell
    assert job_config([*job, "train.steps=3"]).method.lr == default  # other budget
    assert job_config([*job, "method.lr=0.5"]).method.lr == 0.5  # an explicit rate wins
    assert job_config(["experiment=table4", *job[1:], "lora=r8"]).method.lr == 0.0123  # every rank: one rate
    assert job_config(["experiment=tune", *job[1:], "tune.lr_factor=3"]).method.lr == pytest.approx(3 * default)
    (tmp_path / "other.yaml").write_text(_file(_entry(lr=0.2)))
    with pytest.raises(ValueError, match="tuned rates for the same cell"):
        job_config(job)


def test_validation_rows_are_disjoint_from_training_and_evaluation_rows() -> None:
    from prism.data import build_suite, row_key

    for suite in ("glue8", "math10k"):
        node = OmegaConf.to_container(job_config(["scale=smoke", f"suite={suite}"]).suite)
        test = build_suite({**node, "embedded": {**node["embedded"], "unscored": []}}, 42)  # every task's eval rows
        val = build_suite({**node, "eval_split": "validation", "validation_per_task": 8}, 42)
        assert [row_key(e) for e in val.train] == [row_key(e) for e in test.train]  # same training rows
        train = {row_key(e) for e in val.train}
        for task, rows in val.eval.items():
            keys = [row_key(e) for e in rows]
            held_out = {row_key(e) for e in test.eval[task]}
            assert len(keys) == 8 == len(set(keys)) and not set(keys) & train and not set(keys) & held_out
            if suite == "glue8":
                assert sorted(e.answer for e in rows) == [0] * 4 + [1] * 4  # label-balanced


class ScoreByRate:
    """A trainer whose validation score rises with the rate up to ×50, then stays (an edge optimum at ×10)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, cfg, folder, log_fn) -> dict:
        assert cfg.suite.eval_split == "validation"  # tuning runs never score the evaluation rows
        self.calls += 1
        factor = float(cfg.tune.lr_factor)
        score = min(factor, 50.0) / 100
        log_fn({"step": 1, "loss": 1.0})
        return {"columns": {"SST-2": score}, "average": score, "n_train": 32}


def _launch_in_process(monkeypatch, trainer: ScoreByRate) -> None:
    """The launcher replaced by training each pending job in this process with ``trainer``."""
    def in_process(experiment, launcher, pending, workers, overrides, log_dir):
        for job in pending:
            execute(load_job(job.overrides), trainer)
        return True, ""

    monkeypatch.setattr(launch, "launch", in_process)


def test_sweep_runs_through_the_store_extends_edges_resumes_and_writes_the_rates(tmp_path: Path, monkeypatch,
                                                                                 capsys) -> None:
    monkeypatch.setenv("PRISM_TUNED_DIR", str(tmp_path / "tuned"))
    trainer = ScoreByRate()

    _launch_in_process(monkeypatch, trainer)
    args = ["scale=smoke", f"results_dir={tmp_path}", "logging=disabled", "method=adamw", "privacy=eps6",
            "suite=glue8", "tune.lr_factor=0.1,1,10"]
    assert cli(["tune", *args]) == 0
    assert trainer.calls == 3 + 2  # base grid, then past the right edge twice (×100, ×1000)
    out = capsys.readouterr().out
    assert "edge extension 2: 1 runs" in out and "wrote" in out
    table = (tmp_path / "tables" / "tune.smoke.md").read_text()
    assert "| glue8 | eps6 | adamw | 0.002 | 0.001 | 0.010 | 0.100 | **0.500** | 0.500 | 0.2 | 0.500 ± 0.000 |" in table
    assert (tmp_path / "tables" / "tune.smoke.png").read_bytes()[:4] == b"\x89PNG"
    conf = yaml.safe_load((tmp_path / "tuned" / "smoke.yaml").read_text())
    assert conf["generated"]["command"].startswith("python -m pipelines tune scale=smoke")
    assert "commit" in conf["generated"] and conf["generated"]["validation_per_task"] == 200
    assert {k: conf["generated"][k] for k in tuned_rates.COVERS} == {"suites": ["glue8"], "methods": ["adamw"],
                                                                     "epsilons": [6.0]}  # the cells it swept
    by_method = {e["method"]: e for e in conf["rates"]}
    assert list(by_method) == ["adamw"] and by_method["adamw"]["factor"] == 100.0
    assert by_method["adamw"]["at_edge"] is False  # ×1000 scored lower than ×100 (the score saturates at 0.5)
    # the Table 2 grid of that budget now reads the chosen rates, and only for the tuned cells
    jobs = {tuple(j[1:4]): job_config(j) for j in experiment_jobs("table2", ["scale=smoke", "privacy=eps6,eps3",
                                                                            "suite=glue8", "method=prism,adamw"])}
    assert jobs["method=adamw", "privacy=eps6", "suite=glue8"].method.lr == pytest.approx(by_method["adamw"]["lr"])
    assert by_method["adamw"]["lr"] == pytest.approx(100 * 2e-3)
    assert jobs["method=prism", "privacy=eps6", "suite=glue8"].method.lr == pytest.approx(2e-3)  # not tuned
    assert jobs["method=adamw", "privacy=eps3", "suite=glue8"].method.lr == pytest.approx(2e-3)  # not tuned
    # rerunning resumes from the store: nothing is trained again, the same file comes back
    assert cli(["tune", *args]) == 0 and trainer.calls == 5
    assert yaml.safe_load((tmp_path / "tuned" / "smoke.yaml").read_text())["rates"] == conf["rates"]


def test_tuning_seeds_sweep_apart_from_the_tables_and_are_recorded(tmp_path: Path, monkeypatch) -> None:
    """Default tuning seed 1 (not a table seed); ``seed=1,2`` trains each rate on both, scores the mean,
    records ``seeds: [1, 2]``; a file written with one ``seed: 42`` reads as [42]."""
    assert job_config(["experiment=tune"]).seed == 1 and job_config(["experiment=table2"]).seed == 42
    monkeypatch.setenv("PRISM_TUNED_DIR", str(tmp_path / "tuned"))
    trainer = ScoreByRate()

    _launch_in_process(monkeypatch, trainer)
    args = ["scale=smoke", f"results_dir={tmp_path}", "logging=disabled", "method=adamw", "privacy=eps6",
            "suite=glue8", "tune.lr_factor=0.1,1", "seed=1,2"]
    assert cli(["tune", *args]) == 0 and trainer.calls == 2 * (2 + 2)  # 2 seeds × (base grid + 2 extensions)
    path = tmp_path / "tuned" / "smoke.yaml"
    assert yaml.safe_load(path.read_text())["generated"]["seeds"] == [1, 2]
    # the same score on both seeds: no pick moves, and the table says so
    assert yaml.safe_load(path.read_text())["generated"]["pick_changes"] == {"private": [0, 1], "non_private": [0, 0],
                                                                             "steps": []}
    assert "differs between seeds in 0 of 1 private cells" in (tmp_path / "tables" / "tune.smoke.md").read_text()
    assert tuned_rates.tuning_seeds(path) == [1, 2]
    legacy = tmp_path / "legacy.yaml"  # a file written before the seed list was recorded
    legacy.write_text("generated:\n  seed: 42\nrates: []\n")
    assert tuned_rates.tuning_seeds(legacy) == [42]


def test_a_bad_validation_size_is_a_config_error_before_any_model_load() -> None:
    from pipelines.config.validate import ConfigError

    with pytest.raises(ConfigError, match="suite.validation_per_task=0 must be an integer >= 1"):
        load_job(["experiment=tune", "scale=smoke", "suite.validation_per_task=0"])


def _task_file(path: Path, n: int = 80) -> Path:
    import json

    path.write_text("".join(json.dumps({"prompt": f"Is {i} even?", "target": "yes" if i % 2 == 0 else "no"}) + "\n"
                            for i in range(n)))
    return path


def test_a_users_task_is_tuned_beside_its_runs_and_only_its_comparison_reads_the_rates(tmp_path: Path, monkeypatch,
                                                                                      capsys) -> None:
    """``make tune TASK=...``: the cells of ``make compare`` on that file, scored on rows held out of its
    training rows; the rates go to ``<results_dir>/tuned/`` and serve ``make compare`` on the same file
    (same sha256) only, never the paper suites' grid or another file."""
    from pipelines.verbs import compare

    monkeypatch.setenv("PRISM_TUNED_DIR", str(tmp_path / "conf_tuned"))
    trainer = ScoreByRate()
    seen = []

    def in_process(experiment, launcher, pending, workers, overrides, log_dir):
        for job in pending:
            cfg = load_job(job.overrides)
            seen.append(cfg)
            execute(cfg, trainer)
        return True, ""

    monkeypatch.setattr(launch, "launch", in_process)
    task = _task_file(tmp_path / "parity.jsonl")
    results = tmp_path / "r"
    common = ["labels=yes,no", "backbone=tiny-llama", "suite.cutoff_len=1024", "scale=smoke", f"results_dir={results}",
              "logging=disabled"]
    assert cli(["tune", f"task={task}", *common, "methods=adamw", "eps=6", "tune.lr_factor=0.1,1,10"]) == 0
    assert trainer.calls == 5 and {(c.suite.name, c.method.name, c.privacy.name) for c in seen} == {
        ("custom", "adamw", "eps6")}
    assert all(c.suite.eval_split == "validation" and c.suite.custom.train == str(task) for c in seen)
    files = list((results / "tuned").glob("*.yaml"))
    assert [f.name for f in files] == [f"custom-parity-{seen[0].suite.custom.train_sha256[:8]}.smoke.yaml"]
    assert not (tmp_path / "conf_tuned").exists()  # the paper suites' tuned rates are not touched
    conf = yaml.safe_load(files[0].read_text())
    assert conf["generated"]["task_sha256"] == seen[0].suite.custom.train_sha256
    assert "held out of the training rows" in (results / "tables" / files[0].name.replace("custom-", "tune-")
                                               .replace(".yaml", ".md")).read_text()
    (entry,) = conf["rates"]
    plan = compare.plan({"task": str(task), "labels": "yes,no", "methods": "adamw,prism", "eps": "6"}, common[1:-1])
    lr = {c.method.name: c.method.lr for c in plan.configs}
    default = job_config(["scale=smoke", "suite=custom", "method=prism", "privacy=eps6"]).method.lr
    assert lr["adamw"] == pytest.approx(entry["lr"]) == pytest.approx(100 * default)  # ScoreByRate's optimum
    assert lr["prism"] == pytest.approx(default)  # not tuned
    other = _task_file(tmp_path / "other.jsonl", 81)
    assert compare.plan({"task": str(other), "labels": "yes,no", "methods": "adamw", "eps": "6"},
                        common[1:-1]).configs[0].method.lr == pytest.approx(default)
    assert job_config(["experiment=table2", "scale=smoke", "method=adamw", "privacy=eps6", "suite=glue8",
                       f"results_dir={results}"]).method.lr == pytest.approx(2e-3)  # Table 2 reads no user's rate
    from types import SimpleNamespace

    rates_line = next(line for line in compare.header(plan, SimpleNamespace(spec=SimpleNamespace(title="t")))
                      if line.startswith("- Learning rates"))
    assert f"tuned on validation rows by `make tune` ({files[0]}; ε covers one training run per cell, not this " \
           "tuning" in rates_line and "AdamW" in rates_line


def test_task_keys_without_a_task_or_with_a_suite_are_refused() -> None:
    with pytest.raises(ValueError, match="give task=FILE.jsonl"):
        tune.sweep_overrides({"labels": "a,b"}, [])
    with pytest.raises(ValueError, match="task= sets suite=custom"):
        tune.sweep_overrides({"task": "x.jsonl"}, ["suite=glue8"])


def test_a_table_of_tuned_private_runs_says_that_its_epsilon_leaves_out_the_tuning(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """The rates come from a real sweep (stub scores), the table's runs from the runner; the table's
    Markdown, LaTeX and CSV then state the tuning's cost, counting only the private runs at tuned rates."""
    monkeypatch.setenv("PRISM_TUNED_DIR", str(tmp_path / "conf_tuned"))

    def in_process(experiment, launcher, pending, workers, overrides, log_dir):
        for job in pending:
            execute(load_job(job.overrides), ScoreByRate())
        return True, ""

    monkeypatch.setattr(launch, "launch", in_process)
    common = ["scale=smoke", f"results_dir={tmp_path}", "logging=disabled", "suite=glue8"]
    assert cli(["tune", *common, "method=adamw", "privacy=eps6", "tune.lr_factor=0.1,1"]) == 0

    def table_run(cfg, folder, log_fn) -> dict:
        log_fn({"step": 1})
        eps = float(cfg.privacy.epsilon)
        return {"columns": {"SST-2": 0.5}, "average": 0.5, "n_train": 32,
                "epsilon_spent": eps - 0.01 if math.isfinite(eps) else math.inf,
                "per_example": {"sst2": {"column": "SST-2", "correct": [1, 0], "rows": "r"}}}

    for method, privacy in (("adamw", "eps6"), ("prism", "eps6"), ("adamw", "nondp")):
        execute(load_job(["experiment=table2", *common, f"method={method}", f"privacy={privacy}"]), table_run)
    out = tmp_path / "tables"
    assert cli(["aggregate", "experiment=table2", f"runs_dir={tmp_path / 'runs'}", f"out_dir={out}",
                           "scale=embedded"]) == 0
    line = tuned_rates.TUNING_COST.format(n=1)  # adamw at ε = 6 only: PRISM untuned, the non-DP run has no ε
    assert line in (out / "table2.embedded.md").read_text()
    assert "Rates tuned on seeds [1]; table seeds [42]." in (out / "table2.embedded.md").read_text()
    grid = [job_config(["experiment=table2", *common, "method=adamw", "privacy=eps6", f"seed={s}"]) for s in (1, 42)]
    assert tuned_rates.seed_overlap_line(grid[1:]) == ""  # the table's seed 42 is not a tuning seed
    overlap = tuned_rates.seed_overlap_line(grid)
    assert "tuned on seeds [1]" in overlap and "at [1]" in overlap and "make tune SEEDS=<seeds outside" in overlap
    assert line.replace("_", r"\_").replace("ε", r"$\varepsilon$") in (out / "table2.embedded.tex").read_text()
    import pandas as pd

    csv = pd.read_csv(out / "table2.embedded.csv")
    cells = csv[csv["row"] == "cell"]
    status = dict(zip(cells["Setting"], cells["dp_guarantee"]))
    assert status["ε=6"] == "(ε, δ)-DP as accounted, rate tuning not included"
    assert status["Non-DP"] == "non-private"
