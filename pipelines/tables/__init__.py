"""Rebuild the paper's Tables 2–5 from the run store (or W&B) beside the paper's numbers.

    python -m pipelines aggregate experiment=table2 [source=runs|wandb] [scale=embedded|paper] ...

Input: the runs in the view of the experiment (:mod:`pipelines.runs.store`). Output:
``<out_dir>/<experiment>.<scale>.{md,csv,tex}`` and ``<experiment>.<scale>_missing.csv`` (Table 2 also
``table2.<scale>_privacy_utility.png``; a protocol other than ``corrected`` adds its name to the stem, and
``<experiment>.<scale>.protocols.md`` sets two protocols side by side). Each cell is the mean over the
seeds of one config with its 95 % interval; docs/comparison.md explains the cells, marks, the
"PRISM − best baseline" row and the csv columns. Runs that are missing, running, stale, failed or corrupt
are listed at the bottom instead of failing.

Modules: :mod:`.records` (runs from the store), :mod:`.wandb_source` (runs from W&B),
:mod:`.specs` (the tables), :mod:`.build` (cells), :mod:`.intervals` (95 % intervals),
:mod:`.render` (files), ``paper/`` (the paper's numbers); the verb is :mod:`pipelines.verbs.aggregate`.
"""
from __future__ import annotations

from pipelines.tables.build import PAPER_DIR, TableResult, build_table
from pipelines.tables.records import AggregateError, RunRecord, read_run_folder, read_run_folders
from pipelines.tables.render import to_latex, to_markdown, write_outputs
from pipelines.tables.specs import GLUE8, MATH4, SPECS, TableSpec
from pipelines.tables.wandb_source import latest_generation, read_wandb, record_from_wandb

__all__ = ["GLUE8", "MATH4", "PAPER_DIR", "SPECS", "AggregateError", "RunRecord", "TableResult", "TableSpec",
           "build_table", "latest_generation", "read_run_folder", "read_run_folders", "read_wandb",
           "record_from_wandb", "to_latex", "to_markdown", "write_outputs"]


