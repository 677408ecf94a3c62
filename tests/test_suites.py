"""Suite construction: embedded determinism and sizes, paper-scale loading from a local cache, bad rows."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import suite_node

from pipelines.__main__ import main as cli
from prism.data import DataUnavailableError, build_suite
from prism.data.embedded import EMBEDDED_TASKS, train_size
from prism.data.glue import GLUE_TASKS
from prism.evaluation.metrics import extract_choice, extract_number, gold_is_valid

SIZES = {"train_per_task": 24, "eval_per_task": 8}


def _embedded(name: str, seed: int, **extra):
    return build_suite(suite_node(name, embedded={**SIZES, **extra}), seed)


@pytest.mark.parametrize("name", ["glue8", "math10k"])
def test_embedded_deterministic_sizes_columns(name: str) -> None:
    a, b, c = _embedded(name, 7), _embedded(name, 7), _embedded(name, 8)
    assert a.train == b.train and a.eval == b.eval
    assert a.train != c.train and a.eval == c.eval  # eval sets are fixed, training rows follow the seed
    tasks = list(EMBEDDED_TASKS[name])
    assert list(a.eval) == tasks and len(a.train) == 24 * len(tasks)
    assert all(len(rows) == 8 for rows in a.eval.values())
    assert a.task_columns == {t: EMBEDDED_TASKS[name][t][0] for t in tasks}
    assert a.family == ("glue" if name == "glue8" else "math")
    assert a.train_on_inputs is (name == "math10k") and a.skipped == {}
    for task, rows in a.eval.items():
        train_keys = {(ex.instruction, ex.input) for ex in a.train if ex.task == task}
        assert not train_keys & {(ex.instruction, ex.input) for ex in rows}  # disjoint
        assert all(gold_is_valid(a.task_columns[task], ex.answer) for ex in rows)


def test_embedded_glue_uses_paper_instructions_and_balanced_labels() -> None:
    suite = _embedded("glue8", 0)
    spec = {"tweet_sentiment": GLUE_TASKS["sst2"], "syllogism": GLUE_TASKS["rte"]}
    for ex in suite.train:
        assert ex.instruction == spec[ex.task].instruction
        assert ex.output == spec[ex.task].label_words[ex.answer]
    counts = Counter((ex.task, ex.answer) for ex in suite.train)
    assert set(counts.values()) == {12}
    assert all(Counter(ex.answer for ex in rows) == {0: 4, 1: 4} for rows in suite.eval.values())


@pytest.mark.parametrize("target", ["bare", "sentence", "equation"])
def test_embedded_math_targets_extract_to_gold(target: str) -> None:
    suite = _embedded("math10k", 0, target=target)
    for ex in suite.train + [ex for rows in suite.eval.values() for ex in rows]:
        if ex.task == "arith_choice":
            assert extract_choice(ex.output) == ex.answer
        else:
            assert extract_number(ex.output) == ex.answer and ex.output.endswith(".")
        if target == "sentence":
            assert ex.output.startswith("The answer is ")


def test_embedded_math_target_changes_only_the_outputs() -> None:
    """Every target style has the same questions and gold answers (a 0-step model scores them alike)."""
    bare, equation = _embedded("math10k", 5), _embedded("math10k", 5, target="equation")
    strip = lambda rows: [(ex.task, ex.instruction, ex.answer) for ex in rows]  # noqa: E731
    assert strip(bare.train) == strip(equation.train)
    assert {t: strip(r) for t, r in bare.eval.items()} == {t: strip(r) for t, r in equation.eval.items()}
    with pytest.raises(ValueError, match="suite.embedded.target='cot'"):
        _embedded("math10k", 5, target="cot")


def test_embedded_equation_targets_recompute_from_the_question() -> None:
    """``equation``: the MAWPS stand-in's targets state the question's own expression and its value
    (recomputed here from the question text); the others stay bare."""
    suite = _embedded("math10k", 2, target="equation")
    rows = suite.train + [ex for rows in suite.eval.values() for ex in rows]
    for ex in rows:
        if ex.task not in ("basic_arithmetic", "arith_choice"):
            assert " = " not in ex.output
            continue
        (a, op, b), = re.findall(r"(\d+) ([+-]) (\d+)", ex.instruction.split(" Answer Choices:")[0])
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        if ex.task == "basic_arithmetic":
            assert ex.output == f"{a} {op} {b} = {value}." and ex.answer == value
        else:
            options = dict(re.findall(r"\(([A-E])\) (-?\d+)", ex.instruction))
            assert int(options[ex.answer]) == value and ex.output == f"({ex.answer})."


def test_embedded_task_subset_and_eval_limit() -> None:
    suite = build_suite(suite_node("math10k", eval_limit=3, embedded={**SIZES, "tasks": ["leg_counting"]}), 1)
    assert suite.task_columns == {"leg_counting": "SVAMP"} and len(suite.eval["leg_counting"]) == 3


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (suite_node("superglue", embedded=SIZES), "glue8, math10k"),
        (suite_node("glue8", "huge"), "embedded, paper"),
        (suite_node("glue8", embedded=SIZES, family="math"), "family"),
        (suite_node("glue8", embedded={**SIZES, "tasks": ["cola"]}), "tweet_sentiment, syllogism"),
        (suite_node("glue8", "paper", paper={"tasks": ["wnli"]}), "cola, sst2"),
        (suite_node("math10k", "paper", paper={"tests": ["asdiv"]}), "gsm8k, aqua"),
    ],
)
def test_unknown_names_list_valid_ones(cfg: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_suite(cfg, 0)


def test_paper_math_unavailable_names_the_fix(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path))
    with pytest.raises(DataUnavailableError, match=r"make data.* scale=embedded") as err:
        build_suite(suite_node("math10k", "paper", paper={}), 0)
    assert "\n" not in str(err.value) and "math_10k.json" in str(err.value)


def _write_jsonl(path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_paper_glue_from_cache_stratified(tmp_path, monkeypatch) -> None:
    """Paper-scale GLUE reads the `make data` cache: stratified sampling, MNLI's two splits, bad rows."""
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path))
    root = tmp_path / "data" / "glue"
    _write_jsonl(root / "rte" / "train.jsonl",
                 [{"sentence1": f"p{i}", "sentence2": f"h{i}", "label": int(i % 4 == 0)} for i in range(80)])
    _write_jsonl(root / "rte" / "validation.jsonl",
                 [{"sentence1": "a", "sentence2": "b", "label": 1}, {"sentence1": "a", "sentence2": "b", "label": -1},
                  {"sentence1": None, "sentence2": "b", "label": 0}])
    _write_jsonl(root / "stsb" / "train.jsonl",
                 [{"sentence1": f"s{i}", "sentence2": "t", "label": (i % 11) / 2} for i in range(110)])
    _write_jsonl(root / "stsb" / "validation.jsonl", [{"sentence1": "x", "sentence2": "y", "label": 2.25}])
    for split in ("train", "validation_matched", "validation_mismatched"):
        _write_jsonl(root / "mnli" / f"{split}.jsonl",
                     [{"premise": f"p{i}", "hypothesis": "h", "label": i % 3} for i in range(30)])
    node = suite_node("glue8", "paper", paper={"tasks": ["rte", "stsb", "mnli"], "train_per_task": 20})
    suite = build_suite(node, 42)
    by_task = Counter(ex.task for ex in suite.train)
    assert by_task == {"rte": 20, "stsb": 20, "mnli": 20}
    assert Counter(ex.answer for ex in suite.train if ex.task == "rte") == {0: 15, 1: 5}  # 3:1 kept
    assert sorted(Counter(ex.answer for ex in suite.train if ex.task == "mnli").values()) == [6, 7, 7]
    stsb = [ex for ex in suite.train if ex.task == "stsb"]
    assert all(ex.output == f"{ex.answer:.1f}" for ex in stsb)
    assert suite.task_columns == {"rte": "RTE", "stsb": "STS-B", "mnli_matched": "MNLI", "mnli_mismatched": "MNLI"}
    assert [ex.input for ex in suite.eval["rte"]] == ["Premise: a\nHypothesis: b"]
    assert suite.skipped == {"glue/rte": 2}  # label −1 and a missing sentence
    again = build_suite(node, 42)
    assert again.train == suite.train


def test_paper_math_bad_rows_skipped_and_counted(tmp_path) -> None:
    root = tmp_path / "LLM-Adapters"
    train = [{"instruction": "q", "input": "", "output": "The answer is 1.", "answer": "1"}] * 4 + [{"input": ""}]
    (root / "ft").mkdir(parents=True)
    (root / "ft" / "math_10k.json").write_text(json.dumps(train))
    tests = {
        "gsm8k": [{"instruction": "a", "answer": "1,234"}, {"instruction": "b", "answer": "n/a"}],
        "AQuA": [{"instruction": "c", "answer": "B"}, {"instruction": "d", "answer": "F"}],
        "mawps": [{"instruction": "e", "answer": 3}],
        "SVAMP": [{"instruction": "", "answer": "2"}, {"instruction": "f", "answer": "-2.5"}],
    }
    for folder, rows in tests.items():
        (root / "dataset" / folder).mkdir(parents=True)
        (root / "dataset" / folder / "test.json").write_text(json.dumps(rows))
    node = {"train_file": str(root / "ft" / "math_10k.json"), "llm_adapters": str(root), "train_rows": 5}
    suite = build_suite(suite_node("math10k", "paper", paper=node), 0)
    assert len(suite.train) == 4
    assert [ex.answer for ex in suite.eval["gsm8k"]] == [1234.0]
    assert [ex.answer for ex in suite.eval["aqua"]] == ["B"]
    assert [ex.answer for ex in suite.eval["svamp"]] == [-2.5]
    assert suite.skipped == {"math10k/train": 1, "math/gsm8k": 1, "math/aqua": 1, "math/svamp": 1}
    with pytest.raises(DataUnavailableError, match="rows, expected 9919"):
        build_suite(suite_node("math10k", "paper", paper={**node, "train_rows": 9919}), 0)
    with pytest.raises(DataUnavailableError, match="sha256"):
        build_suite(suite_node("math10k", "paper", paper={**node, "train_sha256": "0342d0d8...0418b8"}), 0)


def test_fetch_data_offline_fails_in_one_line(tmp_path, monkeypatch, capsys) -> None:
    from pipelines.verbs import fetch_data

    monkeypatch.setenv("PRISM_CACHE", str(tmp_path))
    monkeypatch.setattr(fetch_data, "reachable", lambda host, timeout=5.0: False)
    assert cli(["fetch-data", "only=math"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "math_10k.json" in err and "SVAMP/test.json" in err and "make data" in err


def test_embedded_arithmetic_is_two_small_terms() -> None:
    """The MAWPS / AQuA stand-ins are sums or differences of two numbers 0-10 (learnable by
    a 135M backbone); every gold answer is the value of the question's expression, recomputed here."""
    suite = _embedded("math10k", 0, tasks=["basic_arithmetic", "arith_choice"])
    for ex in suite.train + suite.eval["basic_arithmetic"]:
        if ex.task != "basic_arithmetic":
            continue
        (a, op, b), = re.findall(r"(\d+) ([+-]) (\d+)", ex.instruction)
        assert int(a) <= 10 and int(b) <= 10  # reasoning-gym draws 1-digit operands from 0..10
        assert float(ex.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    for ex in suite.eval["arith_choice"]:
        (a, op, b), = re.findall(r"(\d+) ([+-]) (\d+)", ex.instruction.split(" Answer Choices:")[0])
        options = dict(re.findall(r"\(([A-E])\) (-?\d+)", ex.instruction))
        assert int(options[ex.answer]) == (int(a) + int(b) if op == "+" else int(a) - int(b))


@pytest.mark.parametrize("scale", ["embedded", "smoke"])
@pytest.mark.parametrize("name", ["glue8", "math10k"])
def test_configured_scale_builds_its_sizes(scale: str, name: str) -> None:
    """The sizes conf/suite_scale/<suite>_<scale>.yaml asks for exist: exact train/eval counts, the same
    training and eval rows for another run seed (``suite.data_seed``), other training rows for another
    data seed, train rows disjoint from the eval rows, GLUE labels balanced."""
    from omegaconf import OmegaConf

    from pipelines.config.compose import job_config

    cfg = job_config([f"suite={name}", f"scale={scale}"])
    node = cfg.suite.embedded
    a, b = build_suite(cfg.suite, 42), build_suite(cfg.suite, 43)
    other = build_suite(OmegaConf.merge(cfg.suite, {"data_seed": 7}), 42)
    sizes = {task: train_size(node.train_per_task, task) for task in node.tasks}
    assert len(a.train) == sum(sizes.values())
    assert a.eval == b.eval and a.train == b.train
    assert other.eval == a.eval and other.train != a.train
    for task, rows in a.eval.items():
        assert len(rows) == node.eval_per_task
        train_keys = {(ex.instruction, ex.input) for ex in a.train if ex.task == task}
        assert len(train_keys) == sizes[task]  # distinct
        assert not train_keys & {(ex.instruction, ex.input) for ex in rows}
        if name == "glue8":
            assert Counter(ex.answer for ex in rows)[0] == node.eval_per_task // 2
    assert a.train_on_inputs is cfg.suite.train_on_inputs


def test_train_per_task_mapping() -> None:
    suite = _embedded("glue8", 3, train_per_task={"tweet_sentiment": 10, "syllogism": 4})
    assert Counter(ex.task for ex in suite.train) == {"tweet_sentiment": 10, "syllogism": 4}
    with pytest.raises(ValueError, match="train_per_task"):
        _embedded("glue8", 3, train_per_task="many")


def test_unscored_tasks_leave_training_rows_and_are_scored_in_neither_split() -> None:
    """``suite.embedded.unscored`` drops those tasks' evaluation rows and nothing else: the training rows
    are those of the unrestricted suite (their evaluation rows are still drawn and kept out of training),
    the scored tasks' evaluation rows are unchanged, and the validation rows (the rate sweep) cover the
    scored tasks only, each the same rows as in a sweep that scores every task."""
    full = _embedded("math10k", 5)
    part = _embedded("math10k", 5, unscored=["arith_choice", "gsm_symbolic"])
    assert part.train == full.train
    assert list(part.eval) == ["basic_arithmetic", "leg_counting"]
    assert all(part.eval[t] == full.eval[t] for t in part.eval)
    assert part.task_columns == {"basic_arithmetic": "MAWPS", "leg_counting": "SVAMP"}
    validation = {"eval_split": "validation", "validation_per_task": 4}
    val = build_suite(suite_node("math10k", **validation, embedded={
        **SIZES, "unscored": ["gsm_symbolic", "arith_choice", "leg_counting"]}), 5)
    every = build_suite(suite_node("math10k", **validation, embedded=SIZES), 5)
    assert list(val.eval) == ["basic_arithmetic"] and val.train == full.train == every.train
    assert list(every.eval) == list(EMBEDDED_TASKS["math10k"])
    assert val.eval["basic_arithmetic"] == every.eval["basic_arithmetic"]
    held_out = {(ex.instruction, ex.input) for ex in val.eval["basic_arithmetic"]}
    assert not held_out & {(ex.instruction, ex.input) for ex in [*full.train, *full.eval["basic_arithmetic"]]}
    for bad in (["basic_arithmetic"], ["syllogism"]):  # nothing left to score / not a math10k task
        with pytest.raises(ValueError, match="suite.embedded.unscored"):
            _embedded("math10k", 5, tasks=["basic_arithmetic", "gsm_symbolic"], unscored=["gsm_symbolic", *bad])


def test_a_first_run_of_the_reasoning_generators_writes_nothing_to_stderr(tmp_path: Path) -> None:
    """A fresh bytecode cache (``-X pycache_prefix``): every dependency is compiled as on a first run."""
    code = "from prism.data.embedded import _gym; assert len(_gym('syllogism', 0, 2)) == 2"
    done = subprocess.run([sys.executable, "-X", f"pycache_prefix={tmp_path}", "-c", code],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stderr == "", done.stderr
