"""Suites (docs/DECISIONS.md D29–D31, D39): GLUE8 and Math-10K at paper scale, and their embedded stand-ins.

A :class:`Suite` is one training set plus evaluation sets per task, each task naming the Table 2 column it
scores; paper and embedded suites share the prompt, tokenisation, decoding and metric code.
``suite.data_seed`` seeds every row draw (``conf/suite/*.yaml``: 42, so every run seed trains on the same
rows, as the paper's runs share one training file; without it the rows follow the run seed).
``suite.eval_split=validation`` scores ``validation_per_task`` rows per task drawn from the training pool,
disjoint from the training and evaluation rows (:func:`validation_split`; the learning-rate sweep of
``pipelines/verbs/tune.py``; ``suite=custom`` holds each training row out by its own draw instead,
``suite.custom.validation_fraction``). The suite node is typed (:class:`prism.data.config.SuiteConfig`); the
scale's own node ``cfg_suite.<scale>`` is read by :mod:`prism.data.embedded`,
:mod:`prism.data.glue` and :mod:`prism.data.math10k`; ``suite=custom`` by :mod:`prism.data.custom`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prism.data.config import SuiteConfig
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
from prism.typed import node_of

__all__ = [
    "PAPER_COLUMNS", "SUITE_FAMILIES", "SCALES", "DataUnavailableError", "Example", "Suite", "cache_dir",
    "sub_seed", "seeded_subset", "row_key", "validation_split", "build_suite",
]


def build_suite(cfg_suite: SuiteConfig | Mapping[str, Any], seed: int) -> Suite:
    """Build the suite named by ``cfg_suite.name`` at ``cfg_suite.scale`` (a :class:`SuiteConfig`, or a
    mapping :func:`prism.typed.node_of` builds one of): deterministic in ``cfg_suite.data_seed``, or in the
    run `seed` where the config sets none."""
    from prism.data import embedded, glue, math10k

    node = node_of(SuiteConfig, cfg_suite)
    draw = seed if node.data_seed is None else node.data_seed
    name, scale, family = node.name, node.scale, node.family
    if name not in SUITE_FAMILIES:
        raise ValueError(f"unknown suite {name!r}; valid suites: {', '.join(SUITE_FAMILIES)}")
    if family != SUITE_FAMILIES[name]:
        raise ValueError(f"suite {name!r} has family {SUITE_FAMILIES[name]!r}, config says {family!r}")
    split = node.eval_split
    if split == "validation" and scale != "embedded" and name != "custom":
        raise ValueError("suite.eval_split=validation is built for embedded-scale suites only; tune at scale=embedded")
    n_validation = node.validation_per_task if split == "validation" else 0
    rules: dict[str, Any] = {}
    source: dict[str, Any] = {}
    if name == "custom":
        from prism.data import custom

        train, evals, columns, rule, source = custom.build(node)
        parts, rules = (train, evals, columns, {}), {task: rule for task in evals}
    elif scale == "embedded":
        parts = embedded.build(name, node.embedded, draw, n_validation)
    elif name == "glue8":
        parts = glue.build_paper(node.paper, draw)
    else:
        parts = math10k.build_paper(node.paper, draw)
    train, evals, columns, skipped = parts
    evals = {task: seeded_subset(rows, node.eval_limit, draw, "eval_limit", task) for task, rows in evals.items()}
    return Suite(
        name=name,
        scale=scale,
        family=family,
        train=train,
        eval=evals,
        train_on_inputs=node.train_on_inputs,
        cutoff_len=node.cutoff_len,
        task_columns=columns,
        skipped=skipped,
        rules=rules,
        source=source,
    )
