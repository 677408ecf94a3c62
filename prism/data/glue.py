"""GLUE8 at paper scale (docs/DECISIONS.md D29, D39): instruction strings, label words, stratified sub-sampling.

The paper's training file (`glue8_1250.json`, 10,000 rows) is not retrievable, so it is rebuilt:
``train_per_task`` (1,250) rows per task from the GLUE train split, drawn with ``suite.data_seed`` and
stratified by label (STS-B: by the score rounded to the nearest integer, bins 0–5); the training
target is the label word (STS-B: the score with one decimal). Evaluation uses the validation splits
(MNLI: matched and mismatched as two tasks scored into one column); rows with label −1 are dropped.

Node ``suite.paper`` fields: ``tasks`` (default all eight), ``train_per_task`` (1250).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from prism.data.config import PaperDataConfig
from prism.data.rows import DataUnavailableError, Example, cache_dir, well_formed

GLUE_HUB_ID = "nyu-mll/glue"


@dataclass(frozen=True)
class GlueTask:
    column: str
    instruction: str
    fields: tuple[tuple[str, str], ...]  # (display name, GLUE column) in input order
    label_words: tuple[str, ...] | None  # index = GLUE label; None for the STS-B regression
    eval_splits: tuple[tuple[str, str], ...]  # (eval task name, GLUE split)


def _task(column: str, instruction: str, fields, words, splits=None, name: str = "") -> GlueTask:
    return GlueTask(column, instruction, tuple(fields), words, tuple(splits or [(name, "validation")]))


GLUE_TASKS: dict[str, GlueTask] = {
    "cola": _task(
        "CoLA",
        "Task: CoLA (linguistic acceptability). Determine whether the sentence is grammatically acceptable. "
        "Answer with exactly one label: acceptable, unacceptable.",
        [("Sentence", "sentence")], ("unacceptable", "acceptable"), name="cola"),
    "sst2": _task(
        "SST-2",
        "Task: SST-2 (sentiment). Determine the sentiment of the sentence. "
        "Answer with exactly one label: positive, negative.",
        [("Sentence", "sentence")], ("negative", "positive"), name="sst2"),
    "mrpc": _task(
        "MRPC",
        "Task: MRPC (paraphrase). Determine whether the two sentences are semantically equivalent. "
        "Answer with exactly one label: equivalent, not_equivalent.",
        [("Sentence 1", "sentence1"), ("Sentence 2", "sentence2")], ("not_equivalent", "equivalent"), name="mrpc"),
    "stsb": _task(
        "STS-B",
        "Task: STS-B (semantic textual similarity). Rate the semantic similarity of the two sentences on a "
        "scale from 0 to 5 (0 = completely different, 5 = equivalent in meaning). Answer with a single number "
        "(you may use one decimal place).",
        [("Sentence 1", "sentence1"), ("Sentence 2", "sentence2")], None, name="stsb"),
    "qqp": _task(
        "QQP",
        "Task: QQP (duplicate questions). Determine whether the two questions are duplicates. "
        "Answer with exactly one label: duplicate, not_duplicate.",
        [("Question 1", "question1"), ("Question 2", "question2")], ("not_duplicate", "duplicate"), name="qqp"),
    "mnli": _task(
        "MNLI",
        "Task: MNLI (natural language inference). Given a premise and a hypothesis, determine the relationship. "
        "Answer with exactly one label: entailment, neutral, contradiction.",
        [("Premise", "premise"), ("Hypothesis", "hypothesis")], ("entailment", "neutral", "contradiction"),
        splits=[("mnli_matched", "validation_matched"), ("mnli_mismatched", "validation_mismatched")]),
    "qnli": _task(
        "QNLI",
        "Task: QNLI (question-answering NLI). Given a question and a sentence, determine whether the sentence "
        "entails the answer to the question. Answer with exactly one label: entailment, not_entailment.",
        [("Question", "question"), ("Sentence", "sentence")], ("entailment", "not_entailment"), name="qnli"),
    "rte": _task(
        "RTE",
        "Task: RTE (recognizing textual entailment). Given a premise and a hypothesis, determine whether the "
        "premise entails the hypothesis. Answer with exactly one label: entailment, not_entailment.",
        [("Premise", "sentence1"), ("Hypothesis", "sentence2")], ("entailment", "not_entailment"), name="rte"),
}

# Table 6 validation row counts (label −1 rows already absent there); checked by `make data`.
VALIDATION_ROWS = {
    ("cola", "validation"): 1043, ("sst2", "validation"): 872, ("mrpc", "validation"): 408,
    ("stsb", "validation"): 1500, ("qqp", "validation"): 40430, ("mnli", "validation_matched"): 9815,
    ("mnli", "validation_mismatched"): 9832, ("qnli", "validation"): 5463, ("rte", "validation"): 277,
}


def glue_example(task: str, row: dict, name: str | None = None, input_text: str | None = None) -> Example | None:
    """Instruction-format example from a GLUE row (None when a field is missing or the label is −1/bad); its
    target is the label word, or the STS-B score with one decimal place. `input_text` overrides the
    formatted input (the embedded stand-ins: their own source columns, the same instruction and label words)."""
    spec = GLUE_TASKS[task]
    label = row.get("label")
    try:
        label = float(label) if spec.label_words is None else int(label)
    except (TypeError, ValueError):
        return None
    if label == -1 or (spec.label_words is not None and not 0 <= label < len(spec.label_words)):
        return None
    if input_text is None:
        values = [row.get(col) for _, col in spec.fields]
        if any(not isinstance(v, str) or not v.strip() for v in values):
            return None
        input_text = "\n".join(f"{disp}: {v}" for (disp, _), v in zip(spec.fields, values))
    target = f"{label:.1f}" if spec.label_words is None else spec.label_words[label]
    return Example(name or task, spec.instruction, input_text, target, label)


def load_split(task: str, split: str) -> list[dict]:
    """Rows of one GLUE split: the `make data` cache first, then `datasets` (warm HF cache or network)."""
    cached = cache_dir() / "glue" / task / f"{split}.jsonl"
    if cached.is_file():
        with cached.open(encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    try:
        import datasets

        return list(datasets.load_dataset(GLUE_HUB_ID, task, split=split))
    except Exception as err:  # offline, missing cache, hub error: all mean "not available here"
        raise DataUnavailableError(
            f"GLUE {task}/{split} is neither cached ({cached}) nor reachable ({type(err).__name__}): "
            "run `make data` with network, or use scale=embedded"
        ) from err


def stratified_indices(labels: list[float], n: int, seed: int, regression: bool) -> list[int]:
    """`n` row indices stratified by label (regression: by the label rounded to an integer bin)."""
    if n >= len(labels):
        return list(range(len(labels)))
    strata = np.rint(labels).astype(int) if regression else np.asarray(labels, dtype=int)
    from sklearn.model_selection import train_test_split  # 3 s to import: only when sampling

    picked, _ = train_test_split(np.arange(len(labels)), train_size=n, stratify=strata, random_state=seed)
    return sorted(int(i) for i in picked)


def build_paper(node: PaperDataConfig, seed: int):
    """Paper-scale GLUE8: (train, eval per task, task → column, skipped rows)."""
    tasks = list(node.tasks or GLUE_TASKS)
    unknown = [t for t in tasks if t not in GLUE_TASKS]
    if unknown:
        raise ValueError(f"unknown GLUE task(s) {unknown}; valid tasks: {', '.join(GLUE_TASKS)}")
    per_task = node.train_per_task
    if per_task is None:
        raise ValueError("suite.paper.train_per_task is not set; restore it (suite_scale/glue8_paper.yaml: 1250)")
    train: list[Example] = []
    evals: dict[str, list[Example]] = {}
    columns: dict[str, str] = {}
    skipped: dict[str, int] = {}
    for task in tasks:
        spec = GLUE_TASKS[task]
        pool = well_formed([glue_example(task, row) for row in load_split(task, "train")], skipped, f"glue/{task}")
        keep = stratified_indices([ex.answer for ex in pool], per_task, seed, spec.label_words is None)
        train.extend(pool[i] for i in keep)
        for name, split in spec.eval_splits:
            rows = load_split(task, split)
            evals[name] = well_formed([glue_example(task, row, name) for row in rows], skipped, f"glue/{name}")
            columns[name] = spec.column
    return train, evals, columns, skipped
