"""Rendering a built table: Markdown, CSV, LaTeX and Table 2's privacy–utility plot, per scale.

Every file name carries the scale (``table2.embedded.md``, ``table2.paper.md``, …) and, for a
protocol other than the default ``corrected``, the protocol (``table2.embedded.released.md``), so no
table replaces another, and nothing is written for a table without a single finished run. When both
protocols have runs, ``<table>.<scale>.protocols.md`` sets them side by side, cell by cell.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from pipelines.aggregate.build import FACTS, TableResult, average_label
from prism.protocol import NOT_DP_AS_STATED

DASH = "—"
LABELS = {"GLUE8_Avg": "GLUE8 Avg", "Math_Avg": "Math Avg", "Avg_12": "Avg (12 tasks)",
          "Step_time_s": "Step time (s)", "Peak_memory_MB": "Peak memory (MB)"}


def _digits(result: TableResult, col: str) -> int:
    spec = result.spec
    return spec.digits[spec.columns.index(col)] if spec.digits else 3


def column_label(result: TableResult, col: str) -> str:
    """A value column's header (an average says how many stand-in columns it covers)."""
    return average_label(result, col, LABELS.get(col, col))


def _cell_text(result: TableResult, row: pd.Series, col: str, bold: tuple[str, str]) -> str:
    d = _digits(result, col)
    value, ref, delta = row[col], row[f"{col}_paper"], row[f"{col}_delta"]
    text = DASH if pd.isna(value) else f"{value:.{d}f}"
    if not pd.isna(value) and row[f"{col}_best"]:
        text = f"{bold[0]}{text}{bold[1]}"
    if not pd.isna(ref):
        ref_digits = next((i for i in range(d, 6) if abs(ref - round(ref, i)) < 1e-9), 6)
        text += f" (paper {ref:.{ref_digits}f}"
        text += f", {delta:+.{d}f})" if not pd.isna(delta) else ")"
    return text


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


def header_lines(result: TableResult) -> list[str]:
    """The runs behind the table: one Markdown row per suite (backbone, steps, batch, N, eval rows,
    protocol, run count), then the stand-in and average notes and any warnings."""
    if not result.header:
        return []
    names = ["runs", *(n for n, _, _ in FACTS if any(n in f for f in result.header.values()))]
    lines = [f"Runs behind the table ({result.n_finished} finished):", "",
             "| suite | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for suite, facts in result.header.items():
        lines.append(f"| {suite} | " + " | ".join(facts.get(n, DASH) for n in names) + " |")
    lines.append("")
    seen = [c for cols in result.columns_seen.values() for c in cols]
    relabelled = [c for c in result.spec.columns if column_label(result, c) != LABELS.get(c, c)]
    if relabelled:
        lines += [f"Averages are unweighted means over the {len(seen)} stand-in column(s) with runs "
                  f"({', '.join(seen)}), not over the paper's tasks; the paper's number beside them "
                  "covers all of its tasks.", ""]
    lines += [f"WARNING: {w}" for w in result.warnings]
    return lines + ([""] if result.warnings else [])


def to_markdown(result: TableResult) -> str:
    """The table as Markdown: title, scale, run facts, rows, then the missing runs."""
    spec, frame = result.spec, result.frame
    head = [f"# Table {spec.name[-1]}: {spec.title}", "", scale_line(result), "", protocol_line(result), ""]
    head += header_lines(result)
    if result.stand_ins:
        head += ["Backbones run in place of the paper's: " + ", ".join(result.stand_ins) + ".", ""]
    head += ["Best per column " + (f"within each {spec.block} block " if spec.block else "")
             + "in **bold**; beside each cell: the paper's number and our difference.", ""]
    header = [*spec.keys, *(column_label(result, c) for c in spec.columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, row in frame.iterrows():
        cells = [str(row[k]) for k in spec.keys] + [_cell_text(result, row, c, ("**", "**")) for c in spec.columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(head + lines + ["", *_missing_md(result)]) + "\n"


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
    """The table as a booktabs ``tabular`` (scale, run facts and missing runs as comments)."""
    spec, frame = result.spec, result.frame
    cols = "l" * len(spec.keys) + "r" * len(spec.columns)
    lines = [f"% {scale_line(result)}", f"% {protocol_line(result)}",
             *(f"% {line}" for line in header_lines(result) if line),
             r"\begin{tabular}{" + cols + "}", r"\toprule",
             " & ".join(_tex_escape(h) for h in (*spec.keys, *(column_label(result, c) for c in spec.columns)))
             + r" \\", r"\midrule"]
    previous = None
    for _, row in frame.iterrows():
        if spec.block and previous is not None and row[spec.block] != previous:
            lines.append(r"\midrule")
        previous = row[spec.block] if spec.block else None
        cells = [_tex_escape(str(row[k])) for k in spec.keys]
        cells += [_tex_escape(_cell_text(result, row, c, ("\x00", "\x01"))).replace("\x00", r"\textbf{")
                  .replace("\x01", "}") for c in spec.columns]
        lines.append(" & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    lines += [f"% missing: {_tex_escape(m)}" for m in result.missing]
    return "\n".join(lines) + "\n"


def plot_panels(result: TableResult) -> list[str]:
    """The value columns Table 2's plot draws: the average, then every column with runs (at embedded
    scale an average over stand-ins hides the one column that moves)."""
    seen = {c for cols in result.columns_seen.values() for c in cols}
    return ["Avg", *(c for c in result.spec.columns if c in seen)]


def plot_privacy_utility(result: TableResult, path: Path) -> Path:
    """Utility vs ε per method, one panel per column of :func:`plot_panels` (ours solid, paper dashed);
    ε=∞ (Non-DP) drawn at the right end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = result.frame.copy()
    frame["eps"] = [math.inf if s == "Non-DP" else float(str(s).split("=")[-1]) for s in frame["Setting"]]
    finite = sorted(e for e in frame["eps"].unique() if not math.isinf(e)) or [1.0]
    inf_x = finite[-1] * 2
    frame["x"] = frame["eps"].replace(math.inf, inf_x)
    panels = plot_panels(result)
    ncols = min(len(panels), 4)
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 3.0 * nrows), squeeze=False)
    methods = list(dict.fromkeys(frame["Method"]))
    for ax, col in zip(axes.flat, panels):
        for i, method in enumerate(methods):
            part = frame[frame["Method"] == method].sort_values("x")
            color = f"C{i % 10}"
            ours = part.dropna(subset=[col])
            if not ours.empty:
                ax.plot(ours["x"], ours[col], "o-", color=color, label=method)
            ref = part.dropna(subset=[f"{col}_paper"])
            if not ref.empty:
                ax.plot(ref["x"], ref[f"{col}_paper"], "x--", color=color, alpha=0.4,
                        label=None if not ours.empty else f"{method} (paper only)")
        ax.set_xticks([*finite, inf_x], [f"{e:g}" for e in finite] + ["∞"])
        ax.set_title(column_label(result, col), fontsize=9)
        ax.tick_params(labelsize=8)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"Privacy–utility, {result.scale} scale, {result.protocol} protocol: accuracy vs ε "
                 "(δ = 1e-5; ∞ = non-DP); solid = these runs, dashed = paper", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def output_stem(result: TableResult) -> str:
    """``<table>.<scale>`` (``<table>.<scale>.<protocol>`` for a protocol other than ``corrected``):
    the stem of every file of this table."""
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
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    by_key = [{tuple(row[k] for k in spec.keys): row for _, row in r.frame.iterrows()} for r in results]
    for key in dict.fromkeys(k for rows in by_key for k in rows):
        cells = [str(k) for k in key]
        for c in cols:
            d = _digits(first, c)
            values = [rows[key][c] if key in rows else math.nan for rows in by_key]
            delta = values[-1] - values[0]
            cells += [DASH if pd.isna(v) else f"{v:.{d}f}" for v in values]
            cells.append(DASH if pd.isna(delta) else f"{delta:+.{d}f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_protocols(results: Sequence[TableResult], out_dir: Path) -> Path | None:
    """``<table>.<scale>.protocols.md`` when two or more protocols have finished runs, else nothing."""
    results = [r for r in results if r.n_finished]
    if len(results) < 2:
        return None
    path = Path(out_dir) / f"{results[0].spec.name}.{results[0].scale}.protocols.md"
    path.write_text(to_protocols_markdown(results))
    return path


def write_outputs(result: TableResult, out_dir: Path) -> list[Path]:
    """Write ``<table>.<scale>.{md,csv,tex}``, ``<table>.<scale>_missing.csv`` (and Table 2's plot);
    return the paths. Writes nothing (returns ``[]``) for a table without a finished run."""
    if result.n_finished == 0:
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = output_stem(result)
    paths = [out_dir / f"{stem}.{ext}" for ext in ("md", "csv", "tex")]
    paths[0].write_text(to_markdown(result))
    csv = result.frame.copy()
    csv.insert(0, "scale", result.scale)
    csv.to_csv(paths[1], index=False, float_format="%.6g")
    paths[2].write_text(to_latex(result))
    missing = out_dir / f"{stem}_missing.csv"
    pd.DataFrame({"missing": result.missing}).to_csv(missing, index=False)
    paths.append(missing)
    if result.spec.plot:
        paths.append(plot_privacy_utility(result, out_dir / f"{stem}_privacy_utility.png"))
    return paths
