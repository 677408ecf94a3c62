"""Suites (docs/DECISIONS.md D29–D31, D39): GLUE8 and Math-10K at paper scale, and their embedded stand-ins.

A :class:`Suite` is one training set plus evaluation sets per task, each task naming the Table 2 column it
scores; paper and embedded suites share the prompt, tokenisation, decoding and metric code.
``suite.data_seed`` seeds every row draw (``conf/suite/*.yaml``: 42, so every run seed trains on the same
rows, as the paper's runs share one training file; without it the rows follow the run seed).
``suite.eval_split=validation`` scores ``validation_per_task`` rows per task drawn from the training pool,
disjoint from the training and evaluation rows (:func:`validation_split`; the learning-rate sweep of
``pipelines/verbs/tune.py``; ``suite=custom`` holds each training row out by its own draw instead,
``suite.custom.validation_fraction``). The scale's own node ``cfg_suite[scale]`` is read by :mod:`prism.data.embedded`,
:mod:`prism.data.glue` and :mod:`prism.data.math10k`; ``suite=custom`` by :mod:`prism.data.custom`.
"""
from __future__ import annotations

from typing import Any

from prism.data.rows import (
    PAPER_COLUMNS,
    SCALES,
    SUITE_FAMILIES,
    DataUnavailableError,
    Example,
    Suite,
    cache_dir,
    row_key,
    seeded_subset,
    sub_seed,
    validation_split,
)

__all__ = [
    "PAPER_COLUMNS", "SUITE_FAMILIES", "SCALES", "DataUnavailableError", "Example", "Suite", "cache_dir",
    "sub_seed", "seeded_subset", "row_key", "validation_split", "build_suite",
]


def build_suite(cfg_suite: Any, seed: int) -> Suite:
    """Build the suite named by ``cfg_suite.name`` at ``cfg_suite.scale``: deterministic in
    ``cfg_suite.data_seed``, or in the run `seed` where the config sets none."""
    from prism.data import embedded, glue, math10k

    data_seed = cfg_suite.get("data_seed")
    draw = seed if data_seed is None else int(data_seed)
    name, scale = cfg_suite.get("name"), cfg_suite.get("scale", "embedded")
    if name not in SUITE_FAMILIES:
        raise ValueError(f"unknown suite {name!r}; valid suites: {', '.join(SUITE_FAMILIES)}")
    if scale not in SCALES:
        raise ValueError(f"unknown suite.scale {scale!r}; valid scales: {', '.join(SCALES)}")
    family = cfg_suite.get("family", SUITE_FAMILIES[name])
    if family != SUITE_FAMILIES[name]:
        raise ValueError(f"suite {name!r} has family {SUITE_FAMILIES[name]!r}, config says {family!r}")
    node = cfg_suite.get(scale) or {}
    split = cfg_suite.get("eval_split", "test")
    if split not in ("test", "validation"):
        raise ValueError(f"suite.eval_split={split!r}: use test (the fixed evaluation rows) or validation")
    if split == "validation" and scale != "embedded" and name != "custom":
        raise ValueError("suite.eval_split=validation is built for embedded-scale suites only; tune at scale=embedded")
    n_validation = int(cfg_suite.get("validation_per_task", 0)) if split == "validation" else 0
    rules: dict[str, Any] = {}
    source: dict[str, Any] = {}
    if name == "custom":
        from prism.data import custom

        train, evals, columns, rule, source = custom.build(cfg_suite)
        parts, rules = (train, evals, columns, {}), {task: rule for task in evals}
    elif scale == "embedded":
        parts = embedded.build(name, node, draw, n_validation)
    elif name == "glue8":
        parts = glue.build_paper(node, draw)
    else:
        parts = math10k.build_paper(node, draw)
    train, evals, columns, skipped = parts
    limit = cfg_suite.get("eval_limit")
    evals = {task: seeded_subset(rows, limit, draw, "eval_limit", task) for task, rows in evals.items()}
    return Suite(
        name=name,
        scale=scale,
        family=family,
        train=train,
        eval=evals,
        train_on_inputs=bool(cfg_suite.get("train_on_inputs", family == "math")),
        cutoff_len=int(cfg_suite.get("cutoff_len", 384 if family == "glue" else 256)),
        task_columns=columns,
        skipped=skipped,
        rules=rules,
        source=source,
    )
