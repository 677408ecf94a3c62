"""suite=custom: scoring of each task type against hand-computed values, every bad task file
refused on one line (file, line, what is wrong) with exit code 2 before any model load, ids unique
per file, a train/eval prompt overlap warned about, evaluation rows length-checked like training rows."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from conftest import suite_node

from pipelines.__main__ import main as cli
from pipelines.runs import runner
from prism.data import build_suite
from prism.data.custom import TaskFileError, check_task, load_task
from prism.evaluation.metrics import TaskRule, normalize_exact, parse_label, score_task

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
    return {"train": str(train), "eval": None, "eval_fraction": 0.25, "validation_fraction": 0.25,
            "type": "classification", "labels": list(LABELS), "tolerance": 1e-3, "train_sha256": None,
            "eval_sha256": None, **extra}


def test_split_is_fixed_disjoint_and_examples_reuse_the_template(tmp_path: Path) -> None:
    train = _write(tmp_path / "t.jsonl", _rows(40))
    a, _ = load_task(_node(train))
    b, _ = load_task(_node(train))
    assert len(a.train) + len(a.eval) == 40 and a.train == b.train and a.eval == b.eval
    assert not {ex.instruction for ex in a.train} & {ex.instruction for ex in a.eval}
    ex = a.train[0]
    assert ex.input == "" and ex.answer == LABELS.index(ex.output)
    suite = build_suite(suite_node("custom", custom=_node(train)), seed=3)
    assert suite.family == "glue" and suite.task_columns == {"custom": "Accuracy"} and suite.train == a.train
    assert suite.source["train_sha256"] and suite.rules["custom"].labels == LABELS


def test_csv_reads_like_jsonl(tmp_path: Path) -> None:
    rows = _rows(8)
    csv = tmp_path / "t.csv"
    csv.write_text("id,prompt,target\n" + "".join(f'{r["id"]},"{r["prompt"]}",{r["target"]}\n' for r in rows))
    jsonl = _write(tmp_path / "t.jsonl", rows)
    a, b = load_task(_node(csv))[0], load_task(_node(jsonl))[0]
    assert (a.train, a.eval) == (b.train, b.eval) and a.eval


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
    code = cli(["run", "suite=custom", "backbone=tiny-llama", f"results_dir={results}", *overrides])
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

    monkeypatch.setattr(runner, "default_trainer", no_training)
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
    val = load_task(_node(train), validating=True)[0]
    key = lambda rows: [ex.instruction for ex in rows]  # noqa: E731
    assert val.eval and val.train and sorted(key(val.train + val.eval)) == sorted(key(test.train))
    assert not set(key(val.eval)) & set(key(test.eval))  # the evaluation rows stay out of both
    node = suite_node("custom", custom=_node(train), eval_split="validation",
                      validation_per_task=200)  # as experiment/tune.yaml; a custom task's draw ignores it
    assert key(build_suite(node, seed=1).eval["custom"]) == key(build_suite(node, seed=2).eval["custom"]) == key(val.eval)
    assert build_suite(node, seed=1).source["split"] == "validation"
    held = _write(tmp_path / "e.jsonl", _rows(6, start=100))  # an evaluation file: the pool is the whole train file
    with_file = load_task(_node(train, eval=str(held)), validating=True)[0]
    assert len(with_file.train) + len(with_file.eval) == 40 and set(key(with_file.eval)) <= {
        f"Review {i}: {w}." for i in range(40) for w in ("great", "awful")}
    with pytest.raises(TaskFileError, match=r"every row fell .* suite.custom.validation_fraction=0.999999"):
        load_task(_node(train, validation_fraction=1 - 1e-6), validating=True)
    n = len(val.train)
    with pytest.raises(TaskFileError, match=f"{n} training rows after holding out {len(val.eval)} for validation, "
                                            f"fewer than train.batch_size={n + 1}"):
        check_task(_node(train), n + 1, 384, None, "tiny-llama", validation=True)


def test_macro_f1_is_scikit_learns_on_rows_and_on_stacks_of_draws() -> None:
    """:func:`prism.evaluation.metrics.macro_f1` against scikit-learn's ``f1_score(average="macro")`` over the label
    set: unparsed responses (−1), a label never predicted, a label absent from gold and prediction."""
    import numpy as np
    from sklearn.metrics import f1_score

    from prism.evaluation.metrics import macro_f1

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
    from prism.backbones import gguf_path
    from prism.fileio import sha256_file

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

    monkeypatch.setattr(runner, "default_trainer", no_training)
    path = _write(tmp_path / "long.jsonl", [*_rows(80), {"prompt": "word " * 600, "target": "positive"}])
    results = tmp_path / "results"
    code = cli(["run", "suite=custom", f"results_dir={results}", f"suite.custom.train={path}",
                 f"suite.custom.labels=[{','.join(LABELS)}]"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "line 81:" in err and "suite.cutoff_len=384" in err, err
    assert "smollm2-135m" in err and not results.exists()


# ------------------------------------------------------------------------------------ ids, leakage
def test_ids_are_unique_within_a_file_not_across_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Both files numbered from r0 (GLUE's splits are): accepted, no warning; a repeat inside one file
    is refused at its own line of that file."""
    train = _write(tmp_path / "train.jsonl", _rows(40))
    test = [{"id": f"r{i}", "prompt": f"Held-out review {i}.", "target": "neutral"} for i in range(6)]
    held = _write(tmp_path / "eval.jsonl", test)
    with caplog.at_level(logging.WARNING):
        task = check_task(_node(train, eval=str(held)), 2, 384, None, "tiny-llama")
    assert (len(task.train), len(task.eval)) == (40, 6) and task.warning is None and not caplog.records
    repeat = _write(tmp_path / "repeat.jsonl", [*test, {"id": "r4", "prompt": "Another.", "target": "neutral"}])
    with pytest.raises(TaskFileError, match=rf"{repeat} line 7: duplicate id 'r4' \(first on line 5\)"):
        load_task(_node(train, eval=str(repeat)))


def test_evaluation_examples_carry_no_id(tmp_path: Path) -> None:
    """Nothing downstream can key on ids: the suite's examples (what evaluation, its per-row records
    and the prompt caches see) are the same whatever the ids are."""
    rows = _rows(12)
    numbered = _write(tmp_path / "a.jsonl", rows)
    renamed = _write(tmp_path / "b.jsonl", [{**r, "id": f"x{k * 7}"} for k, r in enumerate(rows)])
    plain = _write(tmp_path / "c.jsonl", [{k: v for k, v in r.items() if k != "id"} for r in rows])
    held = _write(tmp_path / "e.jsonl", _rows(4, start=0))  # ids r0..r3 again, and the same prompts
    suites = [build_suite(suite_node("custom", custom=_node(f, eval=str(held))), seed=0)
              for f in (numbered, renamed, plain)]
    assert all(s.train == suites[0].train and s.eval == suites[0].eval for s in suites)


def test_leakage_is_one_warning_naming_the_count_and_first_pair(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Evaluation rows whose prompt is a training row's (whitespace aside), whatever their ids: one
    warning line with how many and the first pair's line numbers, once per process."""
    train = _write(tmp_path / "train.jsonl", _rows(10))  # line k + 1 holds "Review k: ..."
    test = [{"id": "r0", "prompt": "Fresh one.", "target": "neutral"},
            {"id": "r1", "prompt": "Review  6:  awful.", "target": "positive"},  # = train line 7
            {"prompt": "Another fresh one.", "target": "neutral"},
            {"id": "q", "prompt": "Review 1: great.", "target": "negative"}]  # = train line 2
    held = _write(tmp_path / "eval.jsonl", test)
    with caplog.at_level(logging.WARNING):
        check_task(_node(train, eval=str(held)), 2, 384, None, "tiny-llama")
        check_task(_node(train, eval=str(held)), 2, 384, None, "tiny-llama")
    (record,) = caplog.records
    message = record.getMessage()
    assert "\n" not in message and message.startswith("warning: 2 of 4 evaluation rows repeat a training prompt")
    assert f"{held} line 2 = {train} line 7" in message


# ------------------------------------------------------------------------------------- bad bytes
def test_a_bad_byte_is_reported_at_its_line_and_column(tmp_path: Path) -> None:
    """Line 100 of a file, column 16 of that line (the 'é' of 'café' in Latin-1), not the byte offset
    inside a decoder chunk; the same for CSV; a UTF-16 file by its byte-order mark."""
    good = "".join(json.dumps(r) + "\n" for r in _rows(99)).encode()
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(good + '{"prompt": "café au lait", "target": "neutral"}\n'.encode("latin-1"))
    with pytest.raises(TaskFileError) as err:
        load_task(_node(bad))
    assert str(err.value).startswith(f"{bad} line 100 column 16: byte 0xe9 is not UTF-8"), err.value
    csv = tmp_path / "latin1.csv"
    csv.write_bytes("prompt,target\ngood,neutral\nna\u00efve,neutral\n".encode("latin-1"))
    with pytest.raises(TaskFileError, match=rf"{csv} line 3 column 3: byte 0xef"):
        load_task(_node(csv))
    wide = tmp_path / "utf16.jsonl"
    wide.write_text("".join(json.dumps(r) + "\n" for r in _rows(8)), encoding="utf-16")
    with pytest.raises(TaskFileError, match=rf"{wide} line 1: the file is UTF-16 .* save it as UTF-8"):
        load_task(_node(wide))


def test_a_utf8_byte_order_mark_reads_as_without_it(tmp_path: Path) -> None:
    rows = _rows(8)
    plain = _write(tmp_path / "plain.jsonl", rows)
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    csv_text = "id,prompt,target\n" + "".join(f'{r["id"]},"{r["prompt"]}",{r["target"]}\n' for r in rows)
    marked_csv = tmp_path / "marked.csv"
    marked_csv.write_bytes(b"\xef\xbb\xbf" + csv_text.encode())
    expected = load_task(_node(plain))[0]
    for path in (marked, marked_csv):  # each row's side follows the row alone: the same split
        got = load_task(_node(path))[0]
        assert (got.train, got.eval) == (expected.train, expected.eval)


# ---------------------------------------------------------------------------- evaluation lengths
def test_an_evaluation_row_is_refused_exactly_when_it_would_be_as_a_training_row(tmp_path: Path) -> None:
    """The same long row: in the evaluation file it is refused at its own line with the count the
    training file's check gives it; rows that fit pass in either file."""
    count = lambda text: len(text.encode())  # noqa: E731
    long = {"prompt": "word " * 2000, "target": "positive"}
    train = _write(tmp_path / "train.jsonl", _rows(40))
    held = _write(tmp_path / "eval.jsonl", [*_rows(2, start=100), long])
    as_train = _write(tmp_path / "as_train.jsonl", [*_rows(40), long])
    with pytest.raises(TaskFileError) as in_eval:
        check_task(_node(train, eval=str(held)), 2, 384, count, "tiny-llama")
    with pytest.raises(TaskFileError) as in_train:
        check_task(_node(as_train), 2, 384, count, "tiny-llama")
    needed = str(in_train.value).rpartition("raise suite.cutoff_len to ")[2]
    assert str(in_eval.value).startswith(f"{held} line 3: prompt and target are {needed} tokens"), in_eval.value
    assert str(in_eval.value).endswith(f"raise suite.cutoff_len to {needed}")
    assert check_task(_node(train, eval=str(held)), 2, int(needed), count, "tiny-llama").eval[-1].instruction == long["prompt"]


def test_a_long_evaluation_row_exits_2_before_any_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def no_training(*_: object) -> None:
        raise AssertionError("a bad evaluation file reached the trainer")

    monkeypatch.setattr(runner, "default_trainer", no_training)
    train = _write(tmp_path / "train.jsonl", _rows(80))
    held = _write(tmp_path / "eval.jsonl", [*_rows(4, start=100), {"prompt": "x" * 10_000, "target": "neutral"}])
    err = _cli(tmp_path, capsys, f"suite.custom.train={train}", f"suite.custom.eval={held}",
               f"suite.custom.labels=[{','.join(LABELS)}]")
    assert f"{held} line 5:" in err and "suite.cutoff_len=384" in err, err


@pytest.mark.parametrize("labels", ["[1,2,3]", "[true,false,maybe]"])
def test_labels_read_as_values_are_named_with_the_quoting_that_works(labels: str, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Unquoted, Hydra reads true/false and numbers as values; the message's quoted form is the fix."""
    from pipelines.config.validate import load_job

    typed = labels.strip("[]").split(",")
    path = _write(tmp_path / "t.jsonl", [{"prompt": f"Q{i}?", "target": typed[i % len(typed)]} for i in range(80)])
    err = _cli(tmp_path, capsys, f"suite.custom.train={path}", f"suite.custom.labels={labels}")
    assert f"suite.custom.labels={labels}" in err and "quote each label" in err, err
    fix = err.split("'")[1]
    cfg = load_job(["suite=custom", "backbone=tiny-llama", f"suite.custom.train={path}", fix,
                    f"results_dir={tmp_path / 'results'}"])
    assert list(cfg.suite.custom.labels) == typed
