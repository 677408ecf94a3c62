"""Rendering a built table: Markdown, CSV, LaTeX and Table 2's privacy–utility plot, per scale.

Every file name carries the scale (``table2.embedded.md``, ``table2.paper.md``, …) and, for a
protocol other than the default ``corrected``, the protocol (``table2.embedded.released.md``), so no
table replaces another, and nothing is written for a table without a single finished run. When both
protocols have runs, ``<table>.<scale>.protocols.md`` sets them side by side, cell by cell.
"""
from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from pipelines.config.tuned_rates import TUNING_COST
from pipelines.tables.build import DIFF_LABEL, FACTS, NO_SIGNAL, TableResult, blocks
from pipelines.tables.intervals import METHOD_TEXT
from pipelines.tables.specs import REFERENCE, SUITE_TASKS
from pipelines.tables.statement import statement
from prism.privacy.protocol import NOT_DP_AS_STATED

DASH = "—"
TUNING_INCLUDED = "ε includes tuning"
LABELS = {"GLUE8_Avg": "GLUE8 Avg", "Math_Avg": "Math Avg", "Avg_12": "Avg (12 tasks)",
          "Step_time_s": "Step time (s)", "Peak_memory_MB": "Peak memory (MB)"}


def _md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _tex_tabular(header: Sequence[str], rows: Iterable[Sequence[str] | None], values: int) -> list[str]:
    """A booktabs ``tabular`` whose last ``values`` columns are right-aligned; a None row is a ``\\midrule``."""
    def line(cells: Sequence[str]) -> str:
        return " & ".join(_tex_escape(c).replace("\x00", r"\textbf{").replace("\x01", "}") for c in cells) + r" \\"

    return [r"\begin{tabular}{" + "l" * (len(header) - values) + "r" * values + "}", r"\toprule", line(header),
            r"\midrule", *(r"\midrule" if r is None else line(r) for r in rows), r"\bottomrule", r"\end{tabular}"]


def _digits(result: TableResult, col: str) -> int:
    spec = result.spec
    return spec.digits[spec.columns.index(col)] if spec.digits else 3


def column_label(result: TableResult, col: str) -> str:
    """A value column's header; an average that does not cover every task of its suites says how many
    stand-in columns it averages (a stand-in table's Avg is not the paper's 12-task mean)."""
    label, suites = LABELS.get(col, col), (result.spec.averages or {}).get(col)
    seen = sum(len(result.columns_seen.get(s, [])) for s in suites or ())
    if not suites or seen == 0 or seen >= sum(len(SUITE_TASKS[s]) for s in suites):
        return label
    return f"{label.replace(' (12 tasks)', '')} (mean of {seen} stand-in col{'s' * (seen != 1)})"


def shown_columns(result: TableResult) -> list[str]:
    """The value columns with at least one cell; the others go in a footnote, not the grid."""
    return [c for c in result.spec.columns if result.frame[c].notna().any()]


def not_shown_line(result: TableResult) -> str:
    """The footnote naming the columns left out of the grid ('' when none is)."""
    from prism.data.embedded import EMBEDDED_TASKS

    averages = result.spec.averages or {}
    stand_ins = {col for tasks in EMBEDDED_TASKS.values() for col, _ in tasks.values()}
    gone = [c for c in result.spec.columns if c not in shown_columns(result)]
    none = [c for c in gone if c not in averages and result.scale == "embedded" and c not in stand_ins]
    unscored = [c for c in gone if c in result.unscored]
    unrun = [c for c in gone if c not in averages and c not in none and c not in unscored]
    means = [c for c in gone if c in averages]
    parts = [(none, "Columns without an embedded stand-in"),
             (unscored, "Stand-in columns trained on but not scored (suite.embedded.unscored; why: docs/embedded-scale.md, "
                        "\"Columns that stay at chance\"; suite.embedded.unscored=[] scores them)"),
             (unrun, "Columns without a finished run"),
             (means, "Averages without a row that has finished runs of every suite they average")]
    return " ".join(f"{what}: {', '.join(column_label(result, c) for c in cols)}." for cols, what in parts if cols)


def _interval_text(result: TableResult, row: pd.Series, col: str, signed: bool = False) -> str:
    value, lo, hi = row[col], row[f"{col}_lo"], row[f"{col}_hi"]
    if pd.isna(value):
        return DASH
    fmt = f"{{:{'+' if signed else ''}.{_digits(result, col)}f}}"
    text = fmt.format(value)
    if not (pd.isna(lo) or pd.isna(hi)):
        text += f" [{fmt.format(lo)}, {fmt.format(hi)}]"
    return text


def _cell_text(result: TableResult, row: pd.Series, col: str, bold: tuple[str, str], signed: bool) -> str:
    """``value [lo, hi]`` (``signed``: with its sign, and ``p=`` its sign-flip p-value where it has one); the
    value in bold when it is best beyond noise or a difference whose interval excludes 0, ``(tie)`` after it
    when it is the best value but not separated from the runner-up."""
    mark = row.get(f"{col}_mark", "")
    if mark == NO_SIGNAL:
        return NO_SIGNAL
    text = _interval_text(result, row, col, signed)
    p = row.get(f"{col}_p", math.nan)
    if signed and not pd.isna(p):
        text += f" p={p:.2g}"
    if mark in ("best", "beats", "below"):
        head, _, tail = text.partition(" ")
        text = f"{bold[0]}{head}{bold[1]}" + (f" {tail}" if tail else "")
    elif mark == "tie":
        text += " (tie)"
    return text


def _n_text(row: pd.Series, cols: Sequence[str]) -> str:
    seen = sorted({int(row[f"{c}_n"]) for c in cols if not pd.isna(row[c]) and not pd.isna(row[f"{c}_n"])})
    return "/".join(str(n) for n in seen) or DASH


def interval_line(result: TableResult) -> str:
    """How the intervals were made (stated in every table's header)."""
    methods = {str(m) for c in shown_columns(result) for m in result.frame[f"{c}_ci"].dropna()} - {"none"}
    line = METHOD_TEXT + ". n = seeds per cell (eval rows per task: see the run facts)."
    if methods - {"bootstrap"}:
        line += (" Cells whose runs carry no per-row outcomes use Student's t over their seeds' values "
                 "(csv column <col>_ci names each cell's method); with one such seed they have no interval.")
    return line


def display_blocks(result: TableResult) -> list[list[tuple[str, pd.Series]]]:
    """Per block, (kind, row) in display order: its method rows (``cell``), then its ``PRISM − best
    baseline`` row (``diff``)."""
    spec, diffs = result.spec, result.differences
    out = []
    for block, part in blocks(spec, result.frame):
        mine = diffs[diffs[spec.block] == block] if spec.block and not diffs.empty else diffs
        out.append([("cell", row) for _, row in part.iterrows()] + [("diff", row) for _, row in mine.iterrows()])
    return out


def _grid(result: TableResult, bold: tuple[str, str]) -> tuple[list[str], list[list[str] | None]]:
    """The table's header and rows as text (``bold`` around a best value); None where a new block starts;
    a ``diff`` row's signed cells are followed by a row naming the baseline of each."""
    spec, cols = result.spec, shown_columns(result)
    rows: list[list[str] | None] = []
    for i, block in enumerate(display_blocks(result)):
        rows += [None] if i else []
        for kind, row in block:
            keys = [str(row[k]) for k in spec.keys]
            rows.append(keys + [_n_text(row, cols)] + [_cell_text(result, row, c, bold, kind == "diff") for c in cols])
            if kind == "diff":
                rows.append([*keys[:-1], "(best baseline)", ""] + [_vs_text(row, c) for c in cols])
    return [*spec.keys, "n", *(column_label(result, c) for c in cols)], rows


def _vs_text(row: pd.Series, col: str) -> str:
    """The baseline a difference is against, ``PRISM beats <it>`` (``PRISM below <it>``) where the difference's
    interval excludes 0; a dash where the column has none (a column without privacy signal in its block)."""
    vs, mark = row.get(f"{col}_vs"), row.get(f"{col}_mark", "")
    vs = DASH if vs is None or pd.isna(vs) or vs == "" else str(vs)
    return f"PRISM {mark} {vs}" if mark in ("beats", "below") else vs


def scale_line(result: TableResult) -> str:
    """What the scale means for comparing with the paper."""
    if result.scale == "paper":
        return "Scale: paper (the paper's backbones and full suites; comparable with the paper's numbers)."
    return ("Scale: embedded (small CPU backbone, stand-in tasks for the columns shown; these numbers are "
            "NOT comparable with the paper's — the paper's numbers are shown for layout only).")


def protocol_line(result: TableResult) -> str:
    """Which protocol produced the table, and whether its ε is a DP guarantee (docs/DECISIONS.md D1–D12)."""
    if result.protocol == "corrected":
        return "Protocol: corrected (this project's DP-SGD semantics; the default)."
    line = (f"Protocol: {result.protocol} (the paper's released code as it ran, docs/DECISIONS.md D1–D12; "
            "compare with the corrected table to see what the corrections change).")
    if result.not_dp:
        line += (f" WARNING: {result.not_dp} private run(s) here are {NOT_DP_AS_STATED} — their ε is what "
                 "the accountant reports for a mechanism they did not run (final.json protocol.dp_caveats).")
    return line


def selection_line(result: TableResult) -> str:
    """What ε covers in a table of private selections' published runs (:mod:`pipelines.verbs.select`; '' otherwise)."""
    if not result.spec.candidates:
        return ""
    return (f"{TUNING_INCLUDED}: each cell and seed is the published run of a private learning-rate selection "
            "(Papernot & Steinke 2022): a random number K of candidates, each DP-SGD at a rate drawn from the "
            "tuning grid and scored by a noised count of its correct validation rows; the best one's test rows are "
            "the cell. ε (RDP accounting of the whole selection) covers what is published: that model, its rate "
            "and its noised score, while K stays unknown. K, the candidate index and the other candidates' runs "
            "are audit material outside the table: released, they void the bound (docs/PRIVACY.md, "
            "\"ε includes tuning\").")


def audit_line(result: TableResult) -> str:
    """Under the Markdown table of private selections: where the audit file is and why it is apart."""
    return (f"The realised K of each selection and every candidate's rate and noised score are in "
            f"{output_stem(result)}.audit.csv, kept apart from this table: ε holds only while K stays unknown, "
            "so that file is not covered by ε and must not be published with the table.")


def notes(result: TableResult) -> list[tuple[str, bool]]:
    """The lines above the run facts, each with whether LaTeX escapes it: the scale, the protocol, the privacy
    statement (:func:`pipelines.tables.statement.statement`), what ε covers in a table of private selections,
    what ε leaves out when private runs trained at tuned rates, and the seeds those rates were tuned on beside
    the table's own; the last three only where they apply."""
    lines = [(scale_line(result), False), (protocol_line(result), False), (statement(result.privacy), False),
             (selection_line(result), True)]
    if result.tuned:
        lines.append((TUNING_COST.format(n=result.tuned), True))
    if result.tuning_seeds:
        lines.append((f"Rates tuned on seeds {result.tuning_seeds}; table seeds {result.table_seeds}.", False))
    return [(line, escape) for line, escape in lines if line]


def claims_lines(result: TableResult) -> list[str]:
    """The paper's claims and their verdicts (:func:`pipelines.tables.build.claims`) under a heading line
    ([] when the table judges none)."""
    if not result.claims:
        return []
    return ["The paper's claims, judged on this table (95 % paired intervals; the best baseline picked on point "
            "estimates):", *(f"- {line}" for line in result.claims)]


def detectable_line(result: TableResult) -> str:
    """What each shown column's "PRISM − best baseline" cell can detect (docs/comparison.md, "What the
    table can detect"): its minimum detectable difference and the seeds to detect 3 points ('' if none)."""
    spec, parts = result.spec, []
    for _, row in result.differences.iterrows():
        cells = [f"{column_label(result, c)} {row[f'{c}_mde']:.3f} ({_seeds_text(row[f'{c}_seeds3pp'])})"
                 for c in shown_columns(result) if not pd.isna(row.get(f"{c}_mde", math.nan))]
        if cells:
            parts.append((f"{row[spec.block]}: " if spec.block else "") + ", ".join(cells))
    if not parts:
        return ""
    return (f"Detectable {DIFF_LABEL} difference (80 % power, 95 % confidence; in brackets the seeds that "
            "detect 3 points, ∞: the evaluation rows alone are too few): " + "; ".join(parts) + ".")


def _seeds_text(seeds: float) -> str:
    return DASH if pd.isna(seeds) else "∞" if math.isinf(seeds) else str(int(seeds))


def header_lines(result: TableResult) -> list[str]:
    """The runs behind the table (a row of :data:`FACTS` per suite), the average note and any warnings."""
    if not result.header:
        return []
    names = ["runs", *(n for n, _, _ in FACTS if any(n in f for f in result.header.values()))]
    rows = ([suite, *(facts.get(n, DASH) for n in names)] for suite, facts in result.header.items())
    lines = [f"Runs behind the table ({result.n_finished} finished):", "", *_md_table(["suite", *names], rows), ""]
    seen = [c for cols in result.columns_seen.values() for c in cols]
    relabelled = [c for c in result.spec.columns if column_label(result, c) != LABELS.get(c, c)]
    if relabelled:
        lines += [f"Averages are unweighted means over the {len(seen)} stand-in column(s) with runs "
                  f"({', '.join(seen)}), not over the paper's tasks; the paper's number beside them "
                  "covers all of its tasks.", ""]
    lines += [f"WARNING: {w}" for w in result.warnings]
    return lines + ([""] if result.warnings else [])


def gate_line(result: TableResult) -> str:
    """Which columns of which privacy rows have no privacy signal and what that changes ('' when none)."""
    if not result.no_signal:
        return ""
    gated = "; ".join(f"{block}: {', '.join(cols)}" for block, cols in result.no_signal.items())
    return (f"{NO_SIGNAL.capitalize()} ({gated}): there the block's best method is not above the {REFERENCE[0]} "
            "beyond noise (the 95 % interval of their paired difference includes 0), so these columns are left out "
            f"of that block's averages and of its {DIFF_LABEL} row (docs/comparison.md, \"The 0-step model and "
            "the gates\").")


def _marks_line(result: TableResult) -> str:
    spec = result.spec
    within = f" within each {spec.block} block" if spec.block else ""
    line = (f"Best per column{within} in **bold** only where the 95 % interval of its paired difference from "
            "the runner-up excludes 0; otherwise the best value is marked (tie).")
    if not result.differences.empty:
        line += (f" Row \"{DIFF_LABEL}\": PRISM's cell minus the cell of the baseline with the best value in "
                 "that column (named in the row below it), with the paired interval and p, the two-sided sign-flip "
                 "permutation p-value over seeds and evaluation rows (0/1 columns only); in bold, and \"PRISM beats\" "
                 "(\"below\") the baseline, only where the interval excludes 0.")
    return line


def paper_rows(result: TableResult) -> pd.DataFrame:
    """The paper's numbers of the rows in the table, for the columns the grid shows."""
    cols = shown_columns(result)
    frame = result.frame[[*result.spec.keys, *(f"{c}_paper" for c in cols)]]
    present = frame[[f"{c}_paper" for c in cols]].notna().any(axis=1)
    return frame[present].rename(columns={f"{c}_paper": c for c in cols})


def _paper_text(value: float) -> str:
    """A paper number with its own digits (at least 3: 0.870, 0.6603)."""
    if pd.isna(value):
        return DASH
    digits = next((i for i in range(3, 6) if abs(value - round(value, i)) < 1e-9), 6)
    return f"{value:.{digits}f}"


def paper_grid(result: TableResult) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the paper's table (:func:`paper_rows`) as text."""
    keys, cols = result.spec.keys, shown_columns(result)
    rows = [[*(str(row[k]) for k in keys), *(_paper_text(row[c]) for c in cols)] for _, row in paper_rows(result).iterrows()]
    return [*keys, *(LABELS.get(c, c) for c in cols)], rows


def _paper_md(result: TableResult) -> list[str]:
    header, rows = paper_grid(result)
    if not rows:
        return []
    note = ("the paper's backbone and full tasks; not comparable with the stand-in cells above"
            if result.scale == "embedded" else "for comparison with the cells above")
    return [f"## The paper's numbers ({note})", "", *_md_table(header, rows), ""]


def to_markdown(result: TableResult) -> str:
    """The table as Markdown: header lines, the grid, footnotes, the paper's numbers, the missing runs."""
    spec = result.spec
    number = spec.name.removeprefix("table").partition("-")[0]
    head = [f"# Table {number}: {spec.title}", "", *(x for line, _ in notes(result) for x in (line, ""))]
    head += header_lines(result)
    if result.stand_ins:
        head += ["Backbones run in place of the paper's: " + ", ".join(result.stand_ins) + ".", ""]
    head += [interval_line(result), "", _marks_line(result), ""]
    head += [x for line in (gate_line(result), result.order) if line for x in (line, "")]
    header, rows = _grid(result, ("**", "**"))
    lines = _md_table(header, [r for r in rows if r is not None])
    foot = [line for line in (detectable_line(result), not_shown_line(result)) if line]
    foot += [audit_line(result)] if spec.candidates else []
    foot += ["", *claims_lines(result)] if result.claims else []
    return "\n".join(head + lines + ["", *foot, *([""] if foot else []), *_paper_md(result), *_missing_md(result)]) + "\n"


def _missing_md(result: TableResult) -> list[str]:
    out = ["## Missing, running, stale, failed, corrupt or refused runs", ""]
    out += [f"- {m}" for m in result.missing] or ["- none"]
    if result.ignored:
        out += ["", f"Ignored (other scale than {result.scale} or other protocol than {result.protocol}):",
                *(f"- {m}" for m in result.ignored)]
    return out


def _tex_escape(text: str) -> str:
    return (text.replace("\\", r"\textbackslash{}").replace("&", r"\&").replace("%", r"\%")
            .replace("_", r"\_").replace("#", r"\#").replace("ε", r"$\varepsilon$").replace("—", "--"))


def to_latex(result: TableResult) -> str:
    """The Markdown's grid and paper table as booktabs tabulars, its other lines as comments."""
    values = len(shown_columns(result))
    lines = [*(f"% {_tex_escape(line) if escape else line}" for line, escape in notes(result)),
             *(f"% {line}" for line in header_lines(result) if line),
             f"% {_tex_escape(interval_line(result))}", f"% {_tex_escape(_marks_line(result))}",
             *(f"% {_tex_escape(line)}" for line in (gate_line(result), result.order) if line),
             *_tex_tabular(*_grid(result, ("\x00", "\x01")), values)]
    lines += [f"% {_tex_escape(foot)}" for foot in (detectable_line(result), not_shown_line(result),
                                                    *claims_lines(result)) if foot]
    header, rows = paper_grid(result)
    if rows:
        lines += ["", "% The paper's numbers (its backbone and full tasks)", *_tex_tabular(header, rows, values)]
    lines += [f"% missing: {_tex_escape(m)}" for m in result.missing]
    return "\n".join(lines) + "\n"


def to_csv_frame(result: TableResult) -> pd.DataFrame:
    """The CSV: the Markdown's rows (``row`` = cell | PRISM − best baseline | paper) with the columns
    docs/comparison.md ("Layout") lists, ``privacy`` (the privacy statement) on the rows of these runs; in a
    table of private selections also ``tuning`` (ε includes tuning)."""
    spec, cols = result.spec, shown_columns(result)
    parts = ("", "_lo", "_hi", "_n", "_ci", "_mark", "_vs", "_p", "_mde", "_seeds3pp")
    seeds = {"tuning_seeds": " ".join(map(str, result.tuning_seeds)),
             "table_seeds": " ".join(map(str, result.table_seeds))}
    drawn = ["tuning"] if spec.candidates else []
    out = []
    for kind, row in (x for block in display_blocks(result) for x in block):
        rec = {"scale": result.scale, "row": "cell" if kind == "cell" else DIFF_LABEL,
               **{k: row[k] for k in spec.keys}, "dp_guarantee": dp_status(result, row.get("Setting")),
               "privacy": statement(result.privacy), **seeds}
        if drawn and kind == "cell":
            rec["tuning"] = TUNING_INCLUDED
        rec.update({f"{c}{p}": row.get(f"{c}{p}", "") for c in cols for p in parts})
        out.append(rec)
    for _, row in paper_rows(result).iterrows():
        out.append({"scale": result.scale, "row": "paper", **{k: row[k] for k in spec.keys},
                    **{c: row[c] for c in cols}, **seeds})
    return pd.DataFrame(out, columns=["scale", "row", *spec.keys, "dp_guarantee", "privacy", *seeds, *drawn,
                                      *(f"{c}{p}" for c in cols for p in parts)])


def dp_status(result: TableResult, setting: Any) -> str:
    """A CSV row's DP status: non-private, :data:`NOT_DP_AS_STATED` when the table holds such runs, else
    as accounted (and whether rate tuning is included)."""
    if setting is None or str(setting) in ("Non-DP", REFERENCE[0]):
        return "non-private"
    if result.not_dp:
        return NOT_DP_AS_STATED
    if result.spec.candidates:
        return f"(ε, δ)-DP as accounted, {TUNING_INCLUDED}" + (f"; {result.spec.dp_note}" if result.spec.dp_note else "")
    return "(ε, δ)-DP as accounted, rate tuning not included" if result.tuned else "(ε, δ)-DP as accounted"


def plot_panels(result: TableResult) -> list[str]:
    """The value columns Table 2's plot draws: the average, then every column with runs (at embedded
    scale an average over stand-ins hides the one column that moves)."""
    seen = {c for cols in result.columns_seen.values() for c in cols}
    average = ["Avg"] if "Avg" in result.spec.columns else []
    return [*average, *(c for c in result.spec.columns if c in seen and c != "Avg")]


def plot_privacy_utility(result: TableResult, path: Path) -> Path:
    """Utility vs ε per method, one panel per column of :func:`plot_panels` (ours solid, paper dashed);
    ε=∞ (Non-DP) drawn at the right end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = result.frame[result.frame["Setting"] != REFERENCE[0]].copy()
    reference = result.frame[result.frame["Setting"] == REFERENCE[0]]
    frame["eps"] = [math.inf if s == "Non-DP" else float(str(s).split("=")[-1]) for s in frame["Setting"]]
    finite = sorted(e for e in frame["eps"].unique() if not math.isinf(e)) or [1.0]
    inf_x = finite[-1] * 2
    frame["x"] = frame["eps"].replace(math.inf, inf_x)
    panels = plot_panels(result)
    ncols = min(len(panels), 4)
    nrows = math.ceil(len(panels) / ncols)
    caption = textwrap.wrap(statement(result.privacy), width=int(3.6 * ncols * 17))
    height = 3.0 * nrows + 0.13 * len(caption)  # inches: the panels, then the caption's lines of 7 pt
    below = 0.13 * len(caption) / height  # the caption's share of the figure, under the legend
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, height), squeeze=False)
    methods = list(dict.fromkeys(frame["Method"]))
    for ax, col in zip(axes.flat, panels):
        for i, method in enumerate(methods):
            part = frame[frame["Method"] == method].sort_values("x")
            color = f"C{i % 10}"
            ours = part.dropna(subset=[col])
            if not ours.empty:
                low = (ours[col] - ours[f"{col}_lo"]).fillna(0).clip(lower=0)
                high = (ours[f"{col}_hi"] - ours[col]).fillna(0).clip(lower=0)
                ax.errorbar(ours["x"], ours[col], yerr=[low, high], fmt="o-", color=color, capsize=2, label=method)
            ref = part.dropna(subset=[f"{col}_paper"])
            if not ref.empty:
                ax.plot(ref["x"], ref[f"{col}_paper"], "x--", color=color, alpha=0.4,
                        label=None if not ours.empty else f"{method} (paper only)")
        for value in pd.to_numeric(reference[col], errors="coerce").dropna():
            ax.axhline(value, color="grey", linestyle=":", label=REFERENCE[0])
        ax.set_xticks([*finite, inf_x], [f"{e:g}" for e in finite] + ["∞"])
        ax.set_title(column_label(result, col), fontsize=9)
        ax.tick_params(labelsize=8)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, below), ncol=len(labels), fontsize=8,
               frameon=False)
    fig.text(0.5, 0.005, "\n".join(caption), ha="center", va="bottom", fontsize=7)
    warning = f"\n{result.not_dp} private run(s) are {NOT_DP_AS_STATED.upper()}" if result.not_dp else ""
    warning += "\nε excludes the rate tuning (`make tune`): it covers one training run per cell" if result.tuned else ""
    warning += f"\n{TUNING_INCLUDED}: each point is the published run of a private rate selection" \
        if result.spec.candidates else ""
    fig.suptitle(f"Privacy–utility, {result.scale} scale, {result.protocol} protocol: accuracy vs ε "
                 f"(∞ = non-DP; privacy statement below); solid = these runs with 95 % intervals, dashed = paper{warning}",
                 fontsize=9, color="red" if result.not_dp else "black")
    fig.tight_layout(rect=(0, below + 0.18 / height, 1, 0.95))
    fig.savefig(path, dpi=120, metadata={"Description": statement(result.privacy)})
    plt.close(fig)
    return path


def output_stem(result: TableResult) -> str:
    """``<table>.<scale>``, plus ``.<protocol>`` for a protocol other than ``corrected``."""
    suffix = "" if result.protocol == "corrected" else f".{result.protocol}"
    return f"{result.spec.name}.{result.scale}{suffix}"


def to_protocols_markdown(results: Sequence[TableResult]) -> str:
    """The same table under each protocol, side by side: per value column one sub-column per protocol
    and the difference of the last from the first (``released − corrected``)."""
    first, spec = results[0], results[0].spec
    cols = [c for c in spec.columns if any(r.frame[c].notna().any() for r in results)]
    names = [r.protocol for r in results]
    lines = [f"# Table {spec.name[-1]} by protocol: {spec.title}", "", scale_line(first), "",
             f"Each column: {' | '.join(names)} | Δ ({names[-1]} − {names[0]}). The tables themselves, with "
             f"their run facts and missing runs: {', '.join(output_stem(r) + '.md' for r in results)}.", ""]
    lines += [f"WARNING: {r.protocol}: {r.not_dp} private run(s) are {NOT_DP_AS_STATED}." for r in results if r.not_dp]
    header = [*spec.keys, *(f"{column_label(first, c)}: {n}" for c in cols for n in [*names, "Δ"])]
    by_key = [{tuple(row[k] for k in spec.keys): row for _, row in r.frame.iterrows()} for r in results]
    table = []
    for key in dict.fromkeys(k for rows in by_key for k in rows):
        cells = [str(k) for k in key]
        for c in cols:
            d = _digits(first, c)
            values = [rows[key][c] if key in rows else math.nan for rows in by_key]
            delta = values[-1] - values[0]
            cells += [DASH if pd.isna(v) else f"{v:.{d}f}" for v in values]
            cells.append(DASH if pd.isna(delta) else f"{delta:+.{d}f}")
        table.append(cells)
    return "\n".join([*lines, "", *_md_table(header, table)]) + "\n"


def write_protocols(results: Sequence[TableResult], out_dir: Path) -> Path | None:
    """``<table>.<scale>.protocols.md`` when two or more protocols have finished runs, else nothing."""
    results = [r for r in results if r.n_finished]
    if len(results) < 2:
        return None
    path = Path(out_dir) / f"{results[0].spec.name}.{results[0].scale}.protocols.md"
    path.write_text(to_protocols_markdown(results))
    return path


def write_audit(result: TableResult, out_dir: Path) -> list[Path]:
    """``<table>.<scale>.audit.{csv,md}``: per cell, suite and seed of a table of private selections, the realised
    K and each candidate's rate and noised score, under a first line that says ε does not cover them."""
    frame, stem = result.audit.sort_values([*result.spec.keys, "suite", "seed", "candidate"]), output_stem(result)
    warning = (f"NOT COVERED BY ε, DO NOT PUBLISH with the table {stem}: the realised K of each private selection and "
               "every candidate's rate and noised score, for an audit of the compute; given K, the published run "
               "is a best-of-K that the table's ε does not bound (docs/PRIVACY.md, \"ε includes tuning\").")
    csv, md = out_dir / f"{stem}.audit.csv", out_dir / f"{stem}.audit.md"
    csv.write_text(f"# {warning}\n" + frame.to_csv(index=False, float_format="%.6g"))
    md.write_text("\n".join([f"# {warning}", "", *_md_table(list(frame.columns), frame.map(
        lambda v: f"{v:.6g}" if isinstance(v, float) else str(v)).values)]) + "\n")
    return [csv, md]


def write_outputs(result: TableResult, out_dir: Path) -> list[Path]:
    """Write ``<table>.<scale>.{md,csv,tex}``, ``<table>.<scale>_missing.csv`` (and Table 2's plot, and a table of
    private selections' audit files, :func:`write_audit`); return the paths. Writes nothing (returns ``[]``) for
    a table without a finished run."""
    if result.n_finished == 0:
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = output_stem(result)
    paths = [out_dir / f"{stem}.{ext}" for ext in ("md", "csv", "tex")]
    paths[0].write_text(to_markdown(result))
    to_csv_frame(result).to_csv(paths[1], index=False, float_format="%.6g")
    paths[2].write_text(to_latex(result))
    missing = out_dir / f"{stem}_missing.csv"
    pd.DataFrame({"missing": result.missing}).to_csv(missing, index=False)
    paths.append(missing)
    if result.spec.plot:
        paths.append(plot_privacy_utility(result, out_dir / f"{stem}_privacy_utility.png"))
    if result.spec.candidates:
        paths += write_audit(result, out_dir)
    return paths
