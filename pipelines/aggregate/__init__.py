"""Rebuild the paper's Tables 2–5 from the run store (or W&B) beside the paper's numbers.

    python -m pipelines.aggregate experiment=table2 [source=runs|wandb] [runs_dir=results/runs]
                                  [out_dir=results/tables] [scale=embedded|paper]
                                  [protocol=corrected|released]
                                  [wandb_project=prism-dp-lora] [wandb_entity=...]

Input: the runs in the view of the experiment (``<runs_dir>/_views/<experiment>/`` over the shared
store ``<runs_dir>/<hash>/``, plus the old ``<runs_dir>/<experiment>/<hash>/`` layout; see
:mod:`pipelines.store`). Output: ``<out_dir>/<experiment>.<scale>.{md,csv,tex}`` and
``<experiment>.<scale>_missing.csv`` (Table 2 also ``table2.<scale>_privacy_utility.png``); a
protocol other than ``corrected`` adds its name to the stem (``table2.embedded.released.md``), and
when two protocols have runs ``<experiment>.<scale>.protocols.md`` sets them side by side.

Each cell is the mean over the seeds of that cell: runs agreeing on every result-changing field
but the seed; a cell whose runs differ otherwise is refused and listed. A cell shows one number and
its 95 % interval, a percentile bootstrap over evaluation rows and seeds together
(:mod:`.intervals`; the header states it), and each row its number of seeds n. "Best" is marked
within each block only where the paired interval of its difference from the runner-up excludes 0,
else the best value is marked as a tie; each block ends with a "PRISM − best baseline" row (paired
interval) and the baseline it compares with. Columns without any run go in a footnote; the paper's
numbers are a table of their own below the grid. The header gives the runs' backbone, steps, batch,
N, eval rows, protocol and counts per suite; an average over stand-in columns says so. Runs that are
missing, running, stale (killed), failed or corrupt are listed at the bottom instead of failing.
The ``.csv`` holds the same rows (``row`` = cell | PRISM − best baseline | paper) with, per column,
``<col>``, ``_lo``, ``_hi``, ``_n``, ``_ci`` (interval method), ``_mark`` and ``_vs``.

Modules: :mod:`.records` (runs from the store), :mod:`.wandb_source` (runs from W&B),
:mod:`.specs` (the tables), :mod:`.build` (cells), :mod:`.intervals` (95 % intervals),
:mod:`.render` (files), :mod:`.cli`.
"""
from pipelines.aggregate.build import PAPER_DIR, TableResult, build_table, load_paper
from pipelines.aggregate.cli import main, parse_args
from pipelines.aggregate.records import AggregateError, RunRecord, read_run_folder, read_run_folders
from pipelines.aggregate.render import to_latex, to_markdown, write_outputs
from pipelines.aggregate.specs import GLUE8, MATH4, SPECS, TableSpec
from pipelines.aggregate.wandb_source import latest_generation, read_wandb, record_from_wandb

__all__ = ["GLUE8", "MATH4", "PAPER_DIR", "SPECS", "AggregateError", "RunRecord", "TableResult", "TableSpec",
           "build_table", "latest_generation", "load_paper", "main", "parse_args", "read_run_folder",
           "read_run_folders", "read_wandb", "record_from_wandb", "to_latex", "to_markdown", "write_outputs"]
