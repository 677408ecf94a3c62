"""Answer parsing and task metrics (docs/DECISIONS.md D12, D30, D31), as pure functions: GLUE labels by
the released code's rules and fallbacks, scored per task (:func:`glue_score`); Math: the last number,
correct within 1e-3; AQuA: the last standalone letter A–E; user tasks (``suite=custom``): :func:`score_task`.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

# Table 2 column → parsing/metric rule.
COLUMN_RULES = {
    "CoLA": "cola", "SST-2": "sst2", "MRPC": "mrpc", "STS-B": "stsb", "QQP": "qqp", "MNLI": "mnli",
    "QNLI": "qnli", "RTE": "rte", "GSM8K": "number", "AQuA": "choice", "MAWPS": "number", "SVAMP": "number",
}

# Substring rules, checked in this order (negated words first); value = GLUE label index.
GLUE_LABEL_RULES: dict[str, tuple[tuple[tuple[str, ...], int], ...]] = {
    "cola": ((("unacceptable", "not acceptable"), 0), (("acceptable",), 1)),
    "sst2": ((("positive",), 1), (("negative",), 0)),
    "mrpc": ((("not_equivalent", "not equivalent"), 0), (("equivalent",), 1)),
    "qqp": ((("not_duplicate", "not duplicate"), 0), (("duplicate",), 1)),
    "qnli": ((("not_entailment", "not entailment"), 1), (("entailment",), 0)),
    "rte": ((("not_entailment", "not entailment"), 1), (("entailment",), 0)),
    "mnli": ((("contradiction",), 2), (("neutral",), 1), (("entailment",), 0)),
}
# Fallback for a leading "yes"/"no" (still counted as a parse failure): (label for yes, label for no).
YES_NO_LABELS = {"cola": (1, 0), "sst2": (1, 0), "mrpc": (1, 0), "qqp": (1, 0),
                 "qnli": (0, 1), "rte": (0, 1), "mnli": (0, 2)}

_PREFIX = re.compile(r"^(?:answer|label|prediction|pred)\s*:\s*")
_YES_NO = re.compile(r"^(yes|no)\b")
_NUMBER = re.compile(r"-?\d+\.?\d*")
_STANDALONE_CHOICE = re.compile(r"(?<![A-Z])([A-E])(?![A-Z])")
# The released evaluation's AQuA pattern: the neighbours are consumed, so in "A B" only "A" is found.
_RELEASED_CHOICE = re.compile(r"(?:^|[^A-Z])([A-E])(?:$|[^A-Z])")
CHOICE_RULES = {"lookaround": _STANDALONE_CHOICE, "released": _RELEASED_CHOICE}
MATH_TOLERANCE = 1e-3


def normalize_response(text: str) -> str:
    """Lower-case, collapse whitespace, strip a leading ``answer:``/``label:``/``prediction:``/``pred:``."""
    return _PREFIX.sub("", " ".join(text.lower().split()))


def parse_glue_label(task: str, text: str) -> tuple[int | float, bool]:
    """GLUE label from a generated response and whether the rules parsed it (docs/DECISIONS.md D30):
    STS-B's first number clipped to [0, 5], else the substring rules in order; a leading yes/no is mapped
    but counts as a parse failure; anything else is label 0 (STS-B 0.0), scored, not dropped."""
    text = normalize_response(text)
    if task == "stsb":
        found = _NUMBER.search(text.replace(",", ""))
        return (min(max(float(found.group()), 0.0), 5.0), True) if found else (0.0, False)
    if task not in GLUE_LABEL_RULES:
        raise ValueError(f"unknown GLUE task {task!r}; valid: stsb, {', '.join(GLUE_LABEL_RULES)}")
    for words, label in GLUE_LABEL_RULES[task]:
        if any(word in text for word in words):
            return label, True
    leading = _YES_NO.match(text)
    if leading:
        yes, no = YES_NO_LABELS[task]
        return (yes if leading.group(1) == "yes" else no), False
    return 0, False


def extract_number(text: str) -> float | None:
    """The LAST number matching ``-?\\d+\\.?\\d*`` after removing commas (LLM-Adapters), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def math_correct(pred: float | None, gold: float, tolerance: float = MATH_TOLERANCE) -> bool:
    """Exact-answer accuracy: |gold − pred| ≤ `tolerance` (Math: 1e-3); a missing number is wrong."""
    return pred is not None and math.isfinite(pred) and abs(float(gold) - pred) <= tolerance


def extract_choice(text: str, rule: str = "lookaround") -> str | None:
    """AQuA letter: the last standalone A–E in the upper-cased text, else the last A–E character. ``rule``
    (``suite.decoding.choice_regex``, docs/DECISIONS.md D12): ``lookaround``, which sees both letters of
    "A B", or ``released``, the released pattern with consumed neighbours. Inherited weakness: upper-casing
    makes any word "a" a standalone letter ("A store sells 5 pens.")."""
    if rule not in CHOICE_RULES:
        raise ValueError(f"suite.decoding.choice_regex={rule!r}; choose one of {sorted(CHOICE_RULES)}")
    upper = text.upper()
    found = CHOICE_RULES[rule].findall(upper)
    if found:
        return found[-1]
    letters = [c for c in upper if c in "ABCDE"]
    return letters[-1] if letters else None


def _correlation(fn, preds: Sequence[float], golds: Sequence[float]) -> float:
    """Pearson/Spearman; 0.0 when undefined (constant predictions, e.g. every output unparsed)."""
    if len(preds) < 2 or np.ptp(preds) == 0 or np.ptp(golds) == 0:
        return 0.0
    return float(fn(preds, golds)[0])


def glue_score(task: str, preds: Sequence[int | float], golds: Sequence[int | float]) -> float:
    """Per-task GLUE score: CoLA MCC; MRPC/QQP (acc+F1)/2; STS-B (Pearson+Spearman)/2; else accuracy."""
    # scipy / scikit-learn are imported where a column needs them (≈ 1 s of every run's start-up otherwise)
    if task == "stsb":
        from scipy.stats import pearsonr, spearmanr

        p, g = np.asarray(preds, float), np.asarray(golds, float)
        return (_correlation(pearsonr, p, g) + _correlation(spearmanr, p, g)) / 2
    p, g = np.asarray(preds, int), np.asarray(golds, int)
    if task == "cola":
        from sklearn.metrics import matthews_corrcoef

        return float(matthews_corrcoef(g, p))
    acc = float(np.mean(g == p))
    if task in ("mrpc", "qqp"):
        from sklearn.metrics import f1_score

        return (acc + float(f1_score(g, p, zero_division=0.0))) / 2
    return acc


def score_outputs(column: str, texts: Sequence[str], golds: Sequence, choice_rule: str = "lookaround") -> tuple[float, int]:
    """Score generated responses for one task of Table 2 column `column`: (score, parse failures).
    ``choice_rule``: the AQuA pattern of :func:`extract_choice`."""
    rule = COLUMN_RULES.get(column)
    if rule is None:
        raise ValueError(f"unknown paper column {column!r}; valid: {', '.join(COLUMN_RULES)}")
    if not texts:
        return 0.0, 0
    preds, failures = _predictions(rule, texts, choice_rule)
    if rule in ("number", "choice"):
        correct = _correct(rule, preds, golds)
        return sum(correct) / len(correct), failures
    return glue_score(rule, preds, golds), failures


def _predictions(rule: str, texts: Sequence[str], choice_rule: str) -> tuple[list, int]:
    """The responses parsed under a column's ``rule`` and how many the rule could not parse."""
    if rule == "number":
        preds = [extract_number(t) for t in texts]
    elif rule == "choice":
        preds = [extract_choice(t, choice_rule) for t in texts]
    else:
        parsed = [parse_glue_label(rule, t) for t in texts]
        return [p for p, _ in parsed], sum(not ok for _, ok in parsed)
    return preds, sum(p is None for p in preds)


def _correct(rule: str, preds: Sequence, golds: Sequence) -> list[bool]:
    return [math_correct(p, g) if rule == "number" else p == g for p, g in zip(preds, golds)]


ACCURACY_RULES = frozenset({"sst2", "mnli", "qnli", "rte", "number", "choice"})  # score = mean of per-row correctness


def row_outcomes(column: str, texts: Sequence[str], golds: Sequence, choice_rule: str = "lookaround") -> dict:
    """Per evaluation row, what :func:`score_outputs` scored: ``correct`` (0/1) for a column whose score is
    the accuracy, else the parsed ``pred`` and the ``gold`` (CoLA, MRPC, QQP, STS-B: the score is a
    statistic of all rows, recomputed by :func:`glue_score` on any resample of them)."""
    rule = COLUMN_RULES[column]
    preds, _ = _predictions(rule, texts, choice_rule)
    if rule in ACCURACY_RULES:
        return {"correct": [int(c) for c in _correct(rule, preds, golds)]}
    return {"pred": preds, "gold": list(golds)}


def gold_is_valid(column: str, answer) -> bool:
    """Whether an evaluation row's gold answer fits its column's rule (bad rows are skipped)."""
    rule = COLUMN_RULES[column]
    if rule == "choice":
        return isinstance(answer, str) and answer in tuple("ABCDE")
    if rule in ("number", "stsb"):
        return isinstance(answer, int | float) and not isinstance(answer, bool) and math.isfinite(answer)
    labels = {label for _, label in GLUE_LABEL_RULES[rule]}
    return isinstance(answer, int) and not isinstance(answer, bool) and answer in labels


# ------------------------------------------------------------------ user tasks (suite=custom)
TASK_KINDS = ("classification", "number", "exact")
_EDGE_PUNCT = "\"'`.,;:!?()[]{}"


@dataclass(frozen=True)
class TaskRule:
    """How a user task (``suite=custom``, :mod:`prism.data.custom`) is scored: ``kind`` one of
    :data:`TASK_KINDS`, the label set of a classification, the tolerance of a number task."""

    kind: str
    labels: tuple[str, ...] = ()
    tolerance: float = MATH_TOLERANCE

    @property
    def columns(self) -> tuple[str, ...]:
        """The metrics it reports, first the task's score: accuracy (and a classification's macro-F1)."""
        return ("Accuracy", "Macro-F1") if self.kind == "classification" else ("Accuracy",)


def normalize_exact(text: str) -> str:
    """Exact-match normal form: the first non-empty line, :func:`normalize_response` (lower case,
    whitespace collapsed, a leading ``answer:`` dropped), then quotes and punctuation stripped from
    both ends ("The cat." ≡ "the cat")."""
    line = next((part for part in text.splitlines() if part.strip()), "")
    return normalize_response(line).strip(_EDGE_PUNCT + " ")


def parse_label(text: str, labels: Sequence[str]) -> int | None:
    """The label a response names: of the labels found in the normalised response as whole words,
    the one that starts first, the longest at the same start ("not_entailment" before "entailment");
    None when it names none (scored wrong and counted)."""
    text = normalize_response(text)
    found = [(m.start(), -len(label), i) for i, label in enumerate(labels)
             if (m := re.search(rf"(?<![a-z0-9]){re.escape(normalize_response(label))}(?![a-z0-9])", text))]
    return min(found)[2] if found else None


def task_predictions(rule: TaskRule, texts: Sequence[str], golds: Sequence) -> tuple[list, list[bool]]:
    """A user task's parsed responses (``None``: no label / no number / empty) and per-row correctness."""
    if rule.kind == "classification":
        preds = [parse_label(t, rule.labels) for t in texts]
        return preds, [p == g for p, g in zip(preds, golds)]
    if rule.kind == "number":
        preds = [extract_number(t) for t in texts]
        return preds, [math_correct(p, g, rule.tolerance) for p, g in zip(preds, golds)]
    if rule.kind == "exact":
        preds = [normalize_exact(t) for t in texts]
        return [p or None for p in preds], [p == g for p, g in zip(preds, golds)]
    raise ValueError(f"unknown task type {rule.kind!r}; valid: {', '.join(TASK_KINDS)}")


def macro_f1(preds: ArrayLike, golds: ArrayLike, n_labels: int) -> np.ndarray:
    """Macro-averaged F1 over the labels ``0..n_labels−1`` along the last axis (a ``[n]`` row or a
    ``[b, n]`` stack of bootstrap draws → a float or ``[b]``): the mean over labels of
    ``2·TP / (2·TP + FP + FN)``, 0 for a label neither predicted nor gold. A prediction outside the labels
    (−1: a response naming none) is a miss of its gold label."""
    p, g = np.asarray(preds), np.asarray(golds)
    per_label = []
    for k in range(n_labels):
        tp = ((p == k) & (g == k)).sum(-1)
        wrong = ((p == k) != (g == k)).sum(-1)  # FP + FN
        per_label.append(np.where(2 * tp + wrong > 0, 2 * tp / np.maximum(2 * tp + wrong, 1), 0.0))
    return np.mean(per_label, axis=0)


def score_task(rule: TaskRule, texts: Sequence[str], golds: Sequence) -> tuple[dict[str, float], int]:
    """Score the responses of a user task: ``{Accuracy[, Macro-F1]}`` (:func:`macro_f1`: an unparseable
    response misses its gold class) and the number of responses that parse to no label / hold no number."""
    if not texts:
        return dict.fromkeys(rule.columns, 0.0), 0
    preds, correct = task_predictions(rule, texts, golds)
    metrics = {"Accuracy": sum(correct) / len(correct)}
    if rule.kind == "classification":
        metrics["Macro-F1"] = float(macro_f1([-1 if p is None else p for p in preds], list(golds), len(rule.labels)))
    return metrics, sum(p is None for p in preds)
