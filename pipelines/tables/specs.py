"""The paper's Tables 2–5 as specs: each carries its own row-key and cell-value functions.

A row key comes from what the run *is* (its config and its realised ε), never from a group name:
Table 2's Setting is read from ``privacy.epsilon`` (∞ → Non-DP), so a run composed with
``privacy=eps6 privacy.epsilon=inf`` lands in the Non-DP block.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from pipelines.tables.records import RunRecord
from prism.methods import registry

GLUE8 = ("CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI", "QNLI", "RTE")
MATH4 = ("GSM8K", "AQuA", "MAWPS", "SVAMP")
SUITE_TASKS = {"glue8": GLUE8, "math10k": MATH4}

BySuite = Mapping[str, Sequence[RunRecord]]


def as_float(value: Any) -> float | None:
    """``float(value)``, or None for missing / non-numeric values."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def mean(values: Iterable[float | None]) -> float:
    """Mean of the present, non-NaN values (NaN when there are none)."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def norm_name(name: str) -> str:
    """A name reduced to lower-case letters and digits (Gemma-3-4B-pt ≡ gemma-3-4b-pt)."""
    return re.sub(r"[^a-z0-9]", "", str(name).lower())


# ----------------------------------------------------------------------------------------- row keys

def method_label(record: RunRecord) -> str:
    """The method's ``label`` (Table 2's Method column); its name for a method this checkout lacks."""
    node = record.get("method")
    try:
        return registry.lookup(node if isinstance(node, Mapping) else str(record.get("method.name"))).label
    except registry.SchemaError:
        return str(record.get("method.name"))


def setting_label(record: RunRecord) -> str:
    """Table 2's Setting from the run's target ε: Non-DP for ε = ∞, else ``ε=<epsilon>``."""
    eps = as_float(record.get("privacy.epsilon"))
    return "Non-DP" if eps is None or math.isinf(eps) else f"ε={eps:g}"


REFERENCE = ("0-step model", "no training")
"""Table 2's key of a run with ``train.steps`` = 0 (the untrained model, :data:`pipelines.config.compose.REFERENCE_JOBS`):
its own block, the row the private rows are gated against (docs/comparison.md, "The 0-step model and the gates")."""


def is_reference(record: RunRecord) -> bool:
    """Whether the run is the untrained reference model (``train.steps`` = 0)."""
    return as_float(record.get("train.steps")) == 0


def table2_key(record: RunRecord, paper: pd.DataFrame) -> tuple:
    """Table 2's row: :data:`REFERENCE` for the 0-step model, else (Setting, Method)."""
    return REFERENCE if is_reference(record) else (setting_label(record), method_label(record))


def backbone_label(record: RunRecord, paper_backbones: Iterable[str]) -> str:
    """Table 3's row: the paper backbone the run stands for (``backbone.paper_name``, else its name)."""
    name = str(record.get("backbone.paper_name") or record.get("backbone.name", "?"))
    return next((b for b in paper_backbones if norm_name(b) == norm_name(name)), name)


# ----------------------------------------------------------------------------------------- cell values

def suite_columns(records: Sequence[RunRecord]) -> dict[str, float]:
    """Per paper column, the mean over the finished runs (seeds) of one cell and suite."""
    names = sorted({c for r in records for c in r.final.columns or {}})
    return {c: mean(as_float(r.final.columns.get(c)) for r in records) for c in names}


def _task_values(spec: TableSpec, by_suite: BySuite) -> dict[str, float]:
    """Task columns and Avg: the unweighted mean of every task score of the cell's suites, as the
    paper's "unweighted mean over the 12 tasks" [P Tab 2] (NaN until every suite has a run)."""
    cols = {s: suite_columns(rs) for s, rs in by_suite.items() if rs}
    merged = {c: v for suite in spec.suites for c, v in cols.get(suite, {}).items()}
    row = {c: merged.get(c, math.nan) for c in spec.columns if c != "Avg"}
    row["Avg"] = mean(merged.values()) if all(by_suite.get(s) for s in spec.suites) else math.nan
    return row


def _rank_values(spec: TableSpec, by_suite: BySuite) -> dict[str, float]:
    """Table 4: per-suite averages and the mean over all tasks of both suites."""
    glue = list(suite_columns(by_suite.get("glue8", [])).values())
    math_ = list(suite_columns(by_suite.get("math10k", [])).values())
    complete = all(by_suite.get(s) for s in spec.suites)
    return {"GLUE8_Avg": mean(glue), "Math_Avg": mean(math_), "Avg_12": mean(glue + math_) if complete else math.nan}


def _cost_values(spec: TableSpec, by_suite: BySuite) -> dict[str, float]:
    """Table 5: mean step time and peak memory of the benchmark runs."""
    rs = by_suite.get("math10k", [])
    return {"Step_time_s": mean(as_float(r.final.step_time_s) for r in rs),
            "Peak_memory_MB": mean(as_float(r.final.peak_memory_mb) for r in rs)}


# ----------------------------------------------------------------------------------------- specs

@dataclass(frozen=True)
class TableSpec:
    """Layout of one paper table: ``cell_key(record, paper)`` is a run's row, ``cell_values(spec, by_suite)``
    a row's values from its finished runs per suite; ``axes`` are the config fields the rows may vary,
    ``averages`` maps an average column to the suites it averages over; ``candidates(record)``, in a table of
    private selections' published runs (ε includes tuning, :mod:`pipelines.verbs.select`), is the audit of a run's
    selection: one mapping per candidate (``candidate``, its index, first), never part of the table itself, and
    ``dp_note`` what its private cells' ``dp_guarantee`` adds (e.g. :data:`prism.privacy.selection.SEEDED_PLAN`)."""

    name: str
    title: str
    keys: tuple[str, ...]
    block: str | None
    suites: tuple[str, ...]
    columns: tuple[str, ...]
    cell_key: Callable[[RunRecord, pd.DataFrame], tuple]
    cell_values: Callable[[TableSpec, BySuite], dict[str, float]]
    axes: tuple[str, ...] = ()
    averages: Mapping[str, tuple[str, ...]] | None = None
    lower_is_better: bool = False
    digits: tuple[int, ...] = ()
    plot: bool = False
    candidates: Callable[[RunRecord], list[dict[str, Any]]] | None = None
    dp_note: str = ""


SPECS = {
    "table2": TableSpec("table2", "Utility on GLUE8 and Math-10K, r=16 [P Tab 2]", ("Setting", "Method"),
                        "Setting", ("glue8", "math10k"), (*GLUE8, *MATH4, "Avg"),
                        table2_key, _task_values,
                        axes=("method", "privacy"), averages={"Avg": ("glue8", "math10k")}, plot=True),
    "table3": TableSpec("table3", "Math-10K on larger backbones, DP ε=6, r=16 [P Tab 3]",
                        ("Backbone", "Method"), "Backbone", ("math10k",), (*MATH4, "Avg"),
                        lambda r, paper: (backbone_label(r, paper["Backbone"].unique()), method_label(r)), _task_values,
                        axes=("method", "backbone"), averages={"Avg": ("math10k",)}),
    "table4": TableSpec("table4", "Rank sensitivity, DP ε=6 [P Tab 4]", ("Rank", "Method"), "Rank",
                        ("glue8", "math10k"), ("GLUE8_Avg", "Math_Avg", "Avg_12"),
                        lambda r, paper: (int(r.get("lora.r", -1)), method_label(r)), _rank_values,
                        axes=("method", "lora"),
                        averages={"GLUE8_Avg": ("glue8",), "Math_Avg": ("math10k",), "Avg_12": ("glue8", "math10k")}),
    "table5": TableSpec("table5", "Step time and peak memory, Math-10K, r=16, ε=6 [P Tab 5]", ("Method",), None,
                        ("math10k",), ("Step_time_s", "Peak_memory_MB"), lambda r, paper: (method_label(r),),
                        _cost_values, axes=("method",), lower_is_better=True, digits=(2, 1)),
}
