"""suite=custom: scoring of each task type against hand-computed values, and every bad task file
refused on one line (file, line, what is wrong) with exit code 2 before any model load."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines import run
from pipelines.run import main
from prism.data import build_suite
from prism.data.custom import TaskFileError, check_task, load_task
from prism.metrics import TaskRule, normalize_exact, parse_label, score_task

LABELS = ("positive", "negative", "neutral")


# ------------------------------------------------------------------------------------------ scoring
def test_classification_accuracy_macro_f1_and_unparseable_by_hand() -> None:
    texts = ["Positive!", "negative", "I think neutral", "banana", "positive", "negative"]
    golds = [0, 1, 2, 2, 1, 1]
    # predictions 0, 1, 2, none, 0, 1 -> 4 of 6 right; per class (P, R): 0 (1/2, 1), 1 (1, 2/3), 2 (1, 1/2)
    f1 = [2 * p * r / (p + r) for p, r in ((0.5, 1.0), (1.0, 2 / 3), (1.0, 0.5))]
    metrics, unparseable = score_task(TaskRule("classification", LABELS), texts, golds)
    assert metrics["Accuracy"] == pytest.approx(4 / 6)
    assert metrics["Macro-F1"] == pytest.approx(sum(f1) / 3)
    assert unparseable == 1


def test_label_parsing_whole_words_first_then_longest() -> None:
    nli = ("entailment", "not_entailment")
    assert parse_label("not_entailment.", nli) == 1
    assert parse_label("Answer: entailment", nli) == 0
    assert parse_label("negative, not positive", LABELS) == 1  # the label named first
    assert parse_label("positively", LABELS) is None  # not a whole word
    assert parse_label("", LABELS) is None


def test_number_tolerance_and_last_number_by_hand() -> None:
    texts = ["The answer is 41.7", "3 apples, so 42", "about 1,000", "none"]
    golds = [42.0, 42.0, 1000.0, 3.0]
    assert score_task(TaskRule("number", tolerance=0.5), texts, golds) == ({"Accuracy": 3 / 4}, 1)
    assert score_task(TaskRule("number"), texts, golds) == ({"Accuracy": 2 / 4}, 1)  # default 1e-3: 41.7 is wrong


def test_exact_match_on_normalised_text_by_hand() -> None:
    assert normalize_exact('  "Paris."\nand more') == "paris"
    texts = [" Paris.\nmore", "paris france", "PARIS", ""]
    assert score_task(TaskRule("exact"), texts, ["paris"] * 4) == ({"Accuracy": 2 / 4}, 1)


# ------------------------------------------------------------------------------------------ files
def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _rows(n: int, start: int = 0) -> list[dict]:
    return [{"id": f"r{i}", "prompt": f"Review {i}: {'great' if i % 2 else 'awful'}.",
             "target": LABELS[i % 2 == 0]} for i in range(start, start + n)]


def _node(train: Path, **extra) -> dict:
    return {"train": str(train), "eval": None, "eval_fraction": 0.25, "type": "classification",
            "labels": list(LABELS), "tolerance": 1e-3, **extra}


def test_split_is_fixed_disjoint_and_examples_reuse_the_template(tmp_path: Path) -> None:
    train = _write(tmp_path / "t.jsonl", _rows(40))
    a, _, _ = load_task(_node(train))
    b, _, _ = load_task(_node(train))
    assert (len(a.train), len(a.eval)) == (30, 10) and a.train == b.train and a.eval == b.eval
    assert not {ex.instruction for ex in a.train} & {ex.instruction for ex in a.eval}
    ex = a.train[0]
    assert ex.input == "" and ex.answer == LABELS.index(ex.output)
    suite = build_suite({"name": "custom", "scale": "embedded", "custom": _node(train)}, seed=3)
    assert suite.family == "glue" and suite.task_columns == {"custom": "Accuracy"} and len(suite.train) == 30
    assert suite.source["train_sha256"] and suite.rules["custom"].labels == LABELS


def test_csv_reads_like_jsonl(tmp_path: Path) -> None:
    rows = _rows(8)
    csv = tmp_path / "t.csv"
    csv.write_text("id,prompt,target\n" + "".join(f'{r["id"]},"{r["prompt"]}",{r["target"]}\n' for r in rows))
    jsonl = _write(tmp_path / "t.jsonl", rows)
    a, b = load_task(_node(csv))[0], load_task(_node(jsonl))[0]
    assert set(a.train + a.eval) == set(b.train + b.eval) and len(a.eval) == len(b.eval) == 2


LONG = "x" * 500
# (file rows, extra node fields / batch size, expected line, words the message must hold)
BAD_FILES = {
    "not-json": (["{\"prompt\": \"a\", \"target\": \"positive\"}", "{\"prompt\": \"b\", \"target\": "], {}, 2, "not JSON"),
    "not-an-object": ([["a", "b"]], {}, 1, "not an object"),
    "missing-field": ([*_rows(2), {"prompt": "c"}], {}, 3, "field 'target' is missing"),
    "empty-field": ([*_rows(1), {"prompt": "  ", "target": "positive"}], {}, 2, "field 'prompt' is empty"),
    "label-not-in-set": ([*_rows(3), {"prompt": "d", "target": "maybe"}], {}, 4, "label 'maybe' is not in"),
    "duplicate-id": ([*_rows(4), {"id": "r1", "prompt": "e", "target": "positive"}], {}, 5, "duplicate id 'r1'"),
    "target-cut-off": ([*_rows(2), {"prompt": LONG, "target": "positive"}], {}, 3, "suite.cutoff_len=384"),
    "empty-file": ([], {}, 1, "the file is empty"),
    "fewer-rows-than-batch": (_rows(10), {"batch": 64}, None, "fewer than train.batch_size=64"),
    "number-without-number": ([*({"prompt": f"p{i}", "target": f"{i} m"} for i in range(3)),
                               {"prompt": "q", "target": "seven"}], {"type": "number"}, 4, "holds no number"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_file_is_one_line_naming_file_and_line(case: str, tmp_path: Path) -> None:
    rows, extra, line, words = BAD_FILES[case]
    batch = extra.pop("batch", 2) if "batch" in extra else 2
    path = _write(tmp_path / f"{case}.jsonl", rows)
    with pytest.raises(TaskFileError) as err:
        check_task(_node(path, **extra), batch, 384, lambda text: len(text.encode()), "tiny-llama")
    message = str(err.value)
    assert "\n" not in message and str(path) in message and words in message, message
    if line is not None:
        assert f"line {line}:" in message, message


def _cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], *overrides: str) -> str:
    results = tmp_path / "results"
    code = main(["suite=custom", "backbone=tiny-llama", f"results_dir={results}", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert not results.exists(), "a bad file created the results folder"
    return err


@pytest.mark.parametrize("case", ["not-json", "duplicate-id", "target-cut-off", "fewer-rows-than-batch"])
def test_bad_file_through_the_runner_exits_2_before_any_model(case: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def no_training(*_: object) -> None:
        raise AssertionError("a bad file reached the trainer")

    monkeypatch.setattr(run, "default_trainer", no_training)
    rows, extra, line, words = BAD_FILES[case]
    path = _write(tmp_path / f"{case}.jsonl", rows if case != "fewer-rows-than-batch" else _rows(40))
    err = _cli(tmp_path, capsys, f"suite.custom.train={path}", f"suite.custom.labels=[{','.join(LABELS)}]")
    assert str(path) in err and (words if case != "fewer-rows-than-batch" else "fewer than train.batch_size=64") in err


def test_unset_file_and_labels_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "suite.custom.train" in _cli(tmp_path, capsys)
    path = _write(tmp_path / "t.jsonl", _rows(80))
    assert "suite.custom.labels" in _cli(tmp_path, capsys, f"suite.custom.train={path}")
    assert "suite.custom.type" in _cli(tmp_path, capsys, f"suite.custom.train={path}", "suite.custom.type=regression")


def test_answer_room_warns_when_the_generation_cap_cuts_targets() -> None:
    from prism.data import Example
    from prism.data.custom import answer_room

    train = [Example("custom", "p", "", "abc", 0), Example("custom", "p", "", "a", 0)]
    count = lambda text: len(text.encode())  # noqa: E731
    assert answer_room(train, count, 4) is None  # "abc" + EOS = 4 tokens
    assert "up to 4 tokens" in answer_room(train, count, 3)


def test_validation_rows_are_held_out_of_the_training_rows_never_the_evaluation_rows(tmp_path: Path) -> None:
    """``suite.eval_split=validation`` (a tuning run): a fixed draw of the training rows, the same for
    every seed; the evaluation rows (held out or a file) are neither trained on nor scored."""
    train = _write(tmp_path / "t.jsonl", _rows(40))
    test = load_task(_node(train))[0]
    val = load_task(_node(train), n_validation=8)[0]
    key = lambda rows: [ex.instruction for ex in rows]  # noqa: E731
    assert len(val.eval) == 8 and len(val.train) == 22 and sorted(key(val.train + val.eval)) == sorted(key(test.train))
    assert not set(key(val.eval)) & set(key(test.eval))  # the 10 evaluation rows stay out of both
    node = {"name": "custom", "scale": "embedded", "custom": _node(train), "eval_split": "validation",
            "validation_per_task": 8}
    assert key(build_suite(node, seed=1).eval["custom"]) == key(build_suite(node, seed=2).eval["custom"]) == key(val.eval)
    assert build_suite(node, seed=1).source["split"] == "validation"
    held = _write(tmp_path / "e.jsonl", _rows(6, start=100))  # an evaluation file: the pool is the whole train file
    with_file = load_task(_node(train, eval=str(held)), n_validation=8)[0]
    assert len(with_file.train) == 32 and set(key(with_file.eval)) <= {f"Review {i}: {w}." for i in range(40)
                                                                        for w in ("great", "awful")}
    with pytest.raises(TaskFileError, match=r"30 training row\(s\) leave none .* suite.validation_per_task=30"):
        load_task(_node(train), n_validation=30)
    with pytest.raises(TaskFileError, match="22 training rows after holding out 8 for validation, fewer than "
                                            "train.batch_size=32"):
        check_task(_node(train), 32, 384, None, "tiny-llama", n_validation=8)


def test_macro_f1_is_scikit_learns_on_rows_and_on_stacks_of_draws() -> None:
    """:func:`prism.metrics.macro_f1` against scikit-learn's ``f1_score(average="macro")`` over the label
    set: unparsed responses (−1), a label never predicted, a label absent from gold and prediction."""
    import numpy as np
    from sklearn.metrics import f1_score

    from prism.metrics import macro_f1

    rng = np.random.default_rng(1)
    cases = [(rng.integers(0, 3, 50), rng.integers(-1, 3, 50), 3), (rng.integers(0, 2, 20), np.zeros(20, int), 2),
             (rng.integers(0, 2, 30), rng.integers(0, 2, 30), 4), (np.array([1, 1]), np.array([-1, -1]), 2)]
    for gold, pred, k in cases:
        expected = f1_score(gold, pred, labels=list(range(k)), average="macro", zero_division=0.0)
        assert float(macro_f1(pred, gold, k)) == pytest.approx(expected, abs=1e-12)
    gold, pred, _ = cases[0]
    draws = rng.integers(0, 50, (7, 50))
    expected = [f1_score(gold[d], pred[d], labels=[0, 1, 2], average="macro", zero_division=0.0) for d in draws]
    assert macro_f1(pred[draws], gold[draws], 3) == pytest.approx(expected, abs=1e-12)


def test_the_embedded_backbones_tokenizer_counts_before_any_model_load(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The default backbone: a row whose target ``suite.cutoff_len`` would cut off is refused by
    validation (exit 2, one line, no results folder), counted with the GGUF's own tokenizer before the
    first conversion and with the converted ``tokenizer.json`` after it; both count as transformers'
    tokenizer of that GGUF does."""
    import json as json_

    from transformers import AutoTokenizer

    from prism import backbones
    from prism.fileio import sha256_file
    from prism.models.gguf import gguf_path

    gguf = gguf_path(backbones.BACKBONES["smollm2-135m"])
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text = "Tweet: what a day!\n\n### Response:\n positive" + " word" * 40
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path / "empty_cache"))  # before the first conversion
    from_gguf = backbones.token_counter({"name": "smollm2-135m"})
    assert from_gguf is not None and from_gguf(text) == len(reference(text)["input_ids"])
    converted = tmp_path / "cache" / "backbones" / "smollm2-135m"
    reference.save_pretrained(converted)
    (converted / backbones.MANIFEST).write_text(json_.dumps(
        {"files": {"tokenizer.json": sha256_file(converted / "tokenizer.json")}}))
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path / "cache"))
    assert backbones.token_counter({"name": "smollm2-135m"})(text) == len(reference(text)["input_ids"])

    def no_training(*_: object) -> None:
        raise AssertionError("a bad file reached the trainer")

    monkeypatch.setattr(run, "default_trainer", no_training)
    path = _write(tmp_path / "long.jsonl", [*_rows(80), {"prompt": "word " * 600, "target": "positive"}])
    results = tmp_path / "results"
    code = main(["suite=custom", f"results_dir={results}", f"suite.custom.train={path}",
                 f"suite.custom.labels=[{','.join(LABELS)}]"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "line 81:" in err and "suite.cutoff_len=384" in err, err
    assert "smollm2-135m" in err and not results.exists()
