"""make compare / `python -m pipelines compare`: the grid it plans, bad input refused before any run, and the
table it renders from finished runs (cells = mean over seeds, computed by hand here)."""
from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from pipelines.__main__ import function, parse
from pipelines.__main__ import main as cli
from pipelines.runs import store
from pipelines.verbs import compare


def _task(path: Path, n: int = 100) -> Path:
    rows = [{"id": i, "prompt": f"Is {i} even?", "target": "yes" if i % 2 == 0 else "no"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _args(task: Path, results: Path, *extra: str) -> list[str]:
    return [f"task={task}", "labels=yes,no", "backbone=tiny-llama", "suite.cutoff_len=1024", f"results_dir={results}", *extra]


def _plan(argv: list[str]) -> compare.Plan:
    """The plan of ``python -m pipelines compare <argv>``."""
    [overrides], keys = parse("compare", function("compare"), argv)
    return compare.plan(keys, overrides)


def test_plan_is_methods_by_settings_by_seeds_and_pins_the_file(tmp_path: Path) -> None:
    task = _task(tmp_path / "t.jsonl")
    p = _plan(_args(task, tmp_path / "r", "methods=prism,adamw", "eps=inf,6,1.5", "seed=1,2"))
    got = sorted((c.method.name, c.privacy.epsilon, c.privacy.name, c.seed) for c in p.configs)
    assert got == sorted((m, e, n, s) for m in ("prism", "adamw")
                         for e, n in ((math.inf, "nondp"), (6.0, "eps6"), (1.5, "eps1.5")) for s in (1, 2))
    assert all(c.suite.custom.train_sha256 == task_id(task) for c in p.configs)
    assert len({j.run_hash for j in p.jobs}) == 12
    before = {j.run_hash for j in p.jobs}
    _task(task, 101)  # an edited file is a new run, never the old result
    assert not before & {j.run_hash for j in _plan(_args(task, tmp_path / "r", "methods=prism,adamw",
                                                                "eps=inf,6,1.5", "seed=1,2")).jobs}


def test_slurm_job_list_of_compare_is_the_runs_of_make_compare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``slurm/submit.sh compare`` writes ``python -m pipelines grid experiment=compare`` lines: with the task named
    by a relative path and no sha256, each line is a run that ``make compare`` plans for the same file."""
    from pipelines.config.compose import job_config

    task = _task(tmp_path / "t.jsonl")
    monkeypatch.chdir(tmp_path)
    fixed = ["suite.custom.train=t.jsonl", "suite.custom.labels=[yes,no]", "backbone=tiny-llama",
             "suite.cutoff_len=1024", f"results_dir={tmp_path / 'r'}"]
    assert cli(["grid", "experiment=compare", *fixed, "method=prism,adamw", "privacy=eps6", "--remote"]) == 0
    lines = [shlex.split(line) for line in capsys.readouterr().out.splitlines()]
    from_grid = {store.run_hash(job_config(line)) for line in lines}
    planned = {j.run_hash for j in _plan(_args(task, tmp_path / "r", "methods=prism,adamw", "eps=6")).jobs}
    assert len(from_grid) == 2 and from_grid == planned


def test_compare_plans_each_run_once_as_the_grid_verb_plans_the_same_sweep(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """compare expands its grid as every verb does (experiment=compare's sweep, one per privacy setting): a method
    or seed listed twice is one run, and the runs are those of ``grid experiment=compare`` on the same sweep."""
    from pipelines.config.compose import job_config

    task = _task(tmp_path / "t.jsonl")
    planned = [j.run_hash for j in _plan(_args(task, tmp_path / "r", "methods=prism,adamw,prism", "eps=inf,6",
                                               "seed=1,1")).jobs]
    fixed = [f"suite.custom.train={task}", "suite.custom.labels=[yes,no]", "backbone=tiny-llama", "suite.cutoff_len=1024",
             f"results_dir={tmp_path / 'r'}"]
    assert cli(["grid", "experiment=compare", *fixed, "method=prism,adamw,prism", "privacy=nondp,eps6", "seed=1,1",
                "--remote"]) == 0
    from_grid = [store.run_hash(job_config(shlex.split(line))) for line in capsys.readouterr().out.splitlines()]
    assert len(planned) == 4 and sorted(planned) == sorted(from_grid)


def task_id(path: Path) -> str:
    """The identifier ``make compare`` pins: the file's keyed hash on this machine (prism.data.custom.file_id)."""
    from prism.data.custom import file_id

    return file_id(path)


@pytest.mark.parametrize("extra, words", [
    (["eps=0"], "eps=0 must be > 0"),
    (["methods=prism,sgd"], "methods=sgd"),  # the key typed, not the override it became (method=)
    (["seed=a"], "seed=a: 'a' is not an integer"),
    (["model=/nonexistent/model"], "model= and backbone= both"),
])
def test_bad_input_is_one_line_before_any_run(extra: list[str], words: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results"
    assert cli(["compare", *_args(_task(tmp_path / "t.jsonl"), results, *extra)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and words in err, err
    assert not results.exists()


def test_missing_model_folder_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    task = _task(tmp_path / "t.jsonl")
    assert cli(["compare", f"task={task}", "labels=yes,no", "model=/nonexistent/model", f"results_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "model=/nonexistent/model: no such folder" in err, err
    assert not (tmp_path / "r").exists()


def test_bad_file_is_one_line_before_any_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "target": "yes"}\n{"prompt": "b", "target": "maybe"}\n')
    assert cli(["compare", *_args(bad, tmp_path / "results")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"{bad} line 2: label 'maybe'" in err, err
    assert not (tmp_path / "results").exists()


def _finish(job: compare.Job, cfg, accuracy: float, f1: float) -> None:
    folder = job.folder
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    dp = math.isfinite(cfg.privacy.epsilon)
    final = {"columns": {"Accuracy": accuracy, "Macro-F1": f1}, "n_train": 64, "eval_rows": {"custom": 16},
             "sample_rate": 0.125, "sigma": 0.6 if dp else 0.0, "epsilon_spent": cfg.privacy.epsilon - 0.01 if dp else math.inf,
             "per_example": {key: {"column": column, "correct": [1] * round(100 * score) + [0] * (100 - round(100 * score)),
                                   "rows": "r"} for key, column, score in (("custom", "Accuracy", accuracy),
                                                                          ("custom/Macro-F1", "Macro-F1", f1))},
             "run": store.RunBlock(hash=folder.name, experiment="compare", attempts=1, versions={}, git_commit=None,
                                   git_dirty=None, hostname="test").to_json()}
    store.write_json_atomic(folder / "final.json", final)
    store.write_status(folder, "finished", started="x", attempts=1)


def test_table_cells_are_means_over_seeds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    task = _task(tmp_path / "t.jsonl")
    argv = _args(task, tmp_path / "results", "methods=prism,adamw", "eps=inf,6", "seed=1,2")
    p = _plan(argv)
    score = {("prism", 1): 0.5, ("prism", 2): 0.7, ("adamw", 1): 0.4, ("adamw", 2): 0.2}
    for job, cfg in zip(p.jobs, p.configs):
        base = score[cfg.method.name, cfg.seed] - (0.1 if math.isfinite(cfg.privacy.epsilon) else 0.0)
        _finish(job, cfg, base, base / 2)
    assert cli(["compare", *argv]) == 0  # everything finished: nothing runs, the table is rendered
    out = capsys.readouterr().out
    assert "0 to run" in out and f"identifier `{task_id(task)}`" in out
    csv = pd.read_csv(tmp_path / "results" / "tables" / f"compare-t-{task_id(task)[:8]}.embedded.csv")
    cell = {
        (r["Setting"], r["Method"]): (r["Accuracy"], r["Macro-F1"]) for _, r in csv.iterrows()}
    assert cell[("Non-DP", "PRISM")] == pytest.approx((0.6, 0.3))
    assert cell[("Non-DP", "AdamW")] == pytest.approx((0.3, 0.15))
    assert cell[("ε=6", "PRISM")] == pytest.approx((0.5, 0.25))
    assert cell[("ε=6", "AdamW")] == pytest.approx((0.2, 0.1))
    assert (tmp_path / "results" / "tables" / f"compare-t-{task_id(task)[:8]}.embedded_privacy_utility.png").is_file()


def test_accuracy_cells_of_a_user_task_carry_the_row_bootstrap_interval(tmp_path: Path) -> None:
    """One seed, 400 rows at accuracy 0.6: the cell's interval is the evaluation-row bootstrap, within
    0.01 of the binomial normal interval 0.6 ± 1.96·√(0.6·0.4/400) = [0.552, 0.648]."""
    task = _task(tmp_path / "t.jsonl")
    argv = _args(task, tmp_path / "results", "methods=prism", "eps=inf")
    p = _plan(argv)
    (job,), (cfg,) = p.jobs, p.configs
    _finish(job, cfg, 0.6, 0.5)
    final = store.read_json(job.folder / "final.json")
    final["per_example"]["custom"] = {"column": "Accuracy", "correct": [1] * 240 + [0] * 160, "rows": "r400"}
    store.write_json_atomic(job.folder / "final.json", final)
    assert cli(["compare", *argv]) == 0
    row = pd.read_csv(tmp_path / "results" / "tables" / f"compare-t-{task_id(task)[:8]}.embedded.csv").iloc[0]
    half = 1.96 * math.sqrt(0.6 * 0.4 / 400)
    assert row["Accuracy_ci"] == "bootstrap"
    assert row["Accuracy_lo"] == pytest.approx(0.6 - half, abs=0.01) and row["Accuracy_hi"] == pytest.approx(0.6 + half, abs=0.01)


def test_macro_f1_cells_of_a_user_task_carry_the_row_bootstrap_interval(tmp_path: Path) -> None:
    """The Macro-F1 cell's interval is the percentile interval of scikit-learn's macro-F1 recomputed on
    each bootstrap draw of the rows (the draws the aggregator makes: a function of the rows' hash)."""
    from sklearn.metrics import f1_score

    from pipelines.tables.intervals import B, row_draws

    rng = np.random.default_rng(0)
    gold = rng.integers(0, 2, 300)
    pred = np.where(rng.random(300) < 0.7, gold, rng.integers(-1, 2, 300))  # -1: a response naming no label
    f1 = f1_score(gold, pred, labels=[0, 1], average="macro", zero_division=0.0)
    task = _task(tmp_path / "t.jsonl")
    argv = _args(task, tmp_path / "results", "methods=prism", "eps=inf")
    p = _plan(argv)
    (job,), (cfg,) = p.jobs, p.configs
    _finish(job, cfg, float(np.mean(pred == gold)), f1)
    final = store.read_json(job.folder / "final.json")
    final["per_example"] = {"custom": {"column": "Accuracy", "correct": (pred == gold).astype(int).tolist(), "rows": "r300"},
                            "custom/Macro-F1": {"column": "Macro-F1", "pred": pred.tolist(), "gold": gold.tolist(),
                                                "labels": 2, "rows": "r300"}}
    store.write_json_atomic(job.folder / "final.json", final)
    assert cli(["compare", *argv]) == 0
    row = pd.read_csv(tmp_path / "results" / "tables" / f"compare-t-{task_id(task)[:8]}.embedded.csv").iloc[0]
    brute = [f1_score(gold[idx], pred[idx], labels=[0, 1], average="macro", zero_division=0.0)
             for draws in row_draws("r300", 300, B) for idx in draws]
    lo, hi = np.quantile(brute, [0.025, 0.975])
    assert row["Macro-F1_ci"] == "bootstrap" and row["Macro-F1"] == pytest.approx(f1)
    assert (row["Macro-F1_lo"], row["Macro-F1_hi"]) == pytest.approx((lo, hi), abs=1e-6)  # the CSV keeps 6 digits


def test_the_comparison_states_the_tables_bold_and_tie_rule(tmp_path: Path) -> None:
    """A user's table says what bold means as Table 2 does: better beyond noise, else (tie)."""
    task = _task(tmp_path / "t.jsonl")
    argv = _args(task, tmp_path / "results", "methods=prism,adamw", "eps=inf")
    p = _plan(argv)
    for job, cfg, score in zip(p.jobs, p.configs, (0.6, 0.5)):
        _finish(job, cfg, score, score)
    assert cli(["compare", *argv]) == 0
    md = (tmp_path / "results" / "tables" / f"compare-t-{task_id(task)[:8]}.embedded.md").read_text()
    assert "in **bold** only where the 95 % interval of its paired difference from the runner-up excludes 0" in md
    assert "otherwise the best value is marked (tie)" in md


@pytest.mark.parametrize("key", ["task", "eval", "model"])
def test_a_path_that_loops_back_on_itself_is_one_line_naming_its_key(key: str, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    task = _task(tmp_path / "t.jsonl")
    given = {"task": task, "labels": "yes,no", "results_dir": tmp_path / "r", key: tmp_path / "a"}
    assert cli(["compare", *(f"{k}={v}" for k, v in given.items())]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {key}={tmp_path / 'a'} "), err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("labels", ["1,2,3", "true,false,maybe"])
def test_labels_hydra_would_read_as_values_are_the_text_typed(labels: str, tmp_path: Path) -> None:
    typed = labels.split(",")
    task = tmp_path / "t.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"Q{i}?", "target": typed[i % len(typed)]}) + "\n" for i in range(80)))
    p = _plan([f"task={task}", f"labels={labels}", "backbone=tiny-llama", "methods=adamw", "eps=inf",
               f"results_dir={tmp_path / 'r'}"])
    assert [list(c.suite.custom.labels) for c in p.configs] == [typed]


@pytest.mark.parametrize("folder", ["a,b", "x y", "l[1]", "q'q", 'd"q', "b\\s", "$x", "k=v", "{a}"])
def test_a_task_file_whose_path_hydra_would_read_is_the_file_named(tmp_path: Path, folder: str) -> None:
    """``task=`` is typed as a plain path; the overrides compare builds from it name that same file in every
    job (not a sweep over pieces of it, not a parse error about a key the user never typed)."""
    (tmp_path / folder).mkdir()
    task = _task(tmp_path / folder / "t.jsonl")
    p = _plan(_args(task, tmp_path / "r", "methods=adamw", "eps=6"))
    assert [str(c.suite.custom.train) for c in p.configs] == [str(task)]
