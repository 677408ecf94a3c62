"""Answer extraction (docs/DECISIONS.md D12, D30, D31): tricky strings, GLUE rule order and fallbacks, real LLM-Adapters golds."""
from __future__ import annotations

import json

import pytest
from conftest import suite_node

from prism.data import PAPER_COLUMNS, build_suite
from prism.data.math10k import MATH_TESTS
from prism.evaluation.evaluate import extract_choice, extract_number, math_correct, parse_glue_label
from prism.evaluation.metrics import score_outputs


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 1,234.", 1234.0),
        ("so she pays $1,234,567 in total", 1234567.0),
        ("The answer is -7", -7.0),
        ("The answer is 42.", 42.0),
        ("3 apples and 4 pears make 7", 7.0),
        ("10 - 12 = -2. The answer is -2.", -2.0),
        ("It is 0.5 of 3.25", 3.25),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_number(text: str, expected: float | None) -> None:
    assert extract_number(text) == expected


def test_math_correct_tolerance_and_missing() -> None:
    assert math_correct(576.0, 576.0) and math_correct(1.8333, 1.8333333333333335)
    assert math_correct(5.0009, 5.0) and not math_correct(5.002, 5.0)
    assert not math_correct(None, 3.0)
    assert not math_correct(extract_number("I do not know"), 0.0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is (D).", "D"),
        ("A store sells 12 pens for $3. The answer is (D).", "D"),  # the leading article is not the answer
        ("(A) 5 (B) 6, so the answer is B", "B"),
        ("answer: c", "C"),
        ("A B", "B"),  # adjacent standalone letters: the last one wins
        ("A store sells 12 pens.", "A"),  # inherited false positive of the upper-cased rule (documented)
        ("THE ANSWERS", "E"),  # no standalone letter: fallback to the last A–E character
        ("xyz 123", None),
    ],
)
def test_extract_choice(text: str, expected: str | None) -> None:
    assert extract_choice(text) == expected


@pytest.mark.parametrize(
    ("task", "text", "expected"),
    [
        ("cola", "unacceptable", (0, True)),  # contains "acceptable": negation must win
        ("cola", "Not acceptable.", (0, True)),
        ("cola", "  Answer:   acceptable", (1, True)),
        ("sst2", "Positive sentiment", (1, True)),
        ("sst2", "label: negative", (0, True)),
        ("mrpc", "not_equivalent", (0, True)),
        ("mrpc", "equivalent", (1, True)),
        ("qqp", "not duplicate", (0, True)),
        ("qqp", "duplicate", (1, True)),
        ("qnli", "not_entailment", (1, True)),  # contains "entailment": negation must win
        ("rte", "entailment", (0, True)),
        ("mnli", "neutral or entailment", (1, True)),  # order: contradiction, neutral, entailment
        ("mnli", "contradiction", (2, True)),
        ("stsb", "3.8", (3.8, True)),
        ("stsb", "score 1,7 out of 5", (5.0, True)),  # commas removed → 17 → clipped to 5
        ("stsb", "-2", (0.0, True)),
        ("stsb", "similar", (0.0, False)),
        # fallbacks: leading yes/no mapped but counted as a parse failure; else label 0
        ("sst2", "Yes, I liked it", (1, False)),
        ("rte", "no", (1, False)),
        ("mnli", "no way", (2, False)),
        ("cola", "nothing to say", (0, False)),  # "no" must be a whole word
        ("qqp", "maybe", (0, False)),
    ],
)
def test_parse_glue_label(task: str, text: str, expected: tuple) -> None:
    assert parse_glue_label(task, text) == expected


def test_parse_glue_label_unknown_task() -> None:
    with pytest.raises(ValueError, match="valid"):
        parse_glue_label("wnli", "entailment")


def test_real_llm_adapters_golds_score_100(llm_adapters_dir, tmp_path, monkeypatch) -> None:
    """Gold answers of the real GSM8K/AQuA/SVAMP/MAWPS test files, written as model outputs after the
    question (whose numbers and choice letters must not confuse extraction), score 100 %."""
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path))
    paper = {"train_file": str(llm_adapters_dir / "ft-training_set" / "math_data.json"),
             "llm_adapters": str(llm_adapters_dir)}
    cfg = suite_node("math10k", "paper", paper=paper)
    suite = build_suite(cfg, seed=42)
    assert len(suite.train) == 3257 and suite.skipped == {"math10k/train": 3}  # 3 rows have an empty output
    assert {t: len(v) for t, v in suite.eval.items()} == {t: rows for t, (_, _, rows) in MATH_TESTS.items()}
    assert set(suite.task_columns.values()) == set(PAPER_COLUMNS[8:])
    for task, examples in suite.eval.items():
        folder = MATH_TESTS[task][0]
        raw = json.loads((llm_adapters_dir / "dataset" / folder / "test.json").read_text())
        texts = [f"{row['instruction']}\nSo the answer is {row['answer']}" for row in raw]
        score, failures = score_outputs(suite.task_columns[task], texts, [ex.answer for ex in examples])
        assert (score, failures) == (1.0, 0), task
