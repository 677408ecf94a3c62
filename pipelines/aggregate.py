"""Rebuild the paper's Tables 2–5 from run folders (or W&B) beside the paper's numbers (SPEC §6).

    python -m pipelines.aggregate experiment=table2 [source=runs|wandb] [runs_dir=results/runs]
                                  [out_dir=results/tables] [scale=embedded|paper]
                                  [wandb_project=prism-dp-lora] [wandb_entity=...]

Input: `<runs_dir>/<experiment>/<hash>/{config.yaml,status.json,final.json}` (see pipelines/store.py).
Output: `<out_dir>/<experiment>.{md,csv,tex}` (+ `<experiment>_missing.csv`; for Table 2 also
`table2_privacy_utility.png`). Each cell is the mean over the finished runs of that cell (seeds);
Table 2's Avg is the unweighted mean of every task score of both suite runs of the cell, as the
paper's "unweighted mean over the 12 tasks" [P Tab 2]; at embedded scale only the stand-in columns
exist and the others render as "—". The best value per column is marked within each block (Setting,
Backbone, Rank), the paper's number and the difference stand beside every cell, and runs that are
missing, running, failed or corrupt are listed at the bottom instead of failing.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

PAPER_DIR = Path(__file__).resolve().parent / "paper_tables"
GLUE8 = ("CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI", "QNLI", "RTE")
MATH4 = ("GSM8K", "AQuA", "MAWPS", "SVAMP")
METHOD_LABELS = {"ffa": "FFA", "lora_rite": "RITE", "adamw": "AdamW", "loraplus": "LoRA+", "lamb": "LAMB",
                 "prism": "PRISM", "prism_paper": "PRISM (eq. 25–26)"}
PRIVACY_LABELS = {"nondp": "Non-DP", "eps6": "ε=6", "eps3": "ε=3"}
DASH = "—"


@dataclass(frozen=True)
class TableSpec:
    """Layout of one paper table: row keys, the block that best-marking is done within, value columns."""

    name: str
    title: str
    keys: tuple[str, ...]
    block: str | None
    suites: tuple[str, ...]
    columns: tuple[str, ...]
    lower_is_better: bool = False
    digits: tuple[int, ...] = ()


SPECS = {
    "table2": TableSpec("table2", "Utility on GLUE8 and Math-10K, r=16 [P Tab 2]", ("Setting", "Method"),
                        "Setting", ("glue8", "math10k"), (*GLUE8, *MATH4, "Avg")),
    "table3": TableSpec("table3", "Math-10K on larger backbones, DP ε=6, r=16 [P Tab 3]",
                        ("Backbone", "Method"), "Backbone", ("math10k",), (*MATH4, "Avg")),
    "table4": TableSpec("table4", "Rank sensitivity, DP ε=6 [P Tab 4]", ("Rank", "Method"), "Rank",
                        ("glue8", "math10k"), ("GLUE8_Avg", "Math_Avg", "Avg_12")),
    "table5": TableSpec("table5", "Step time and peak memory, Math-10K, r=16, ε=6 [P Tab 5]", ("Method",), None,
                        ("math10k",), ("Step_time_s", "Peak_memory_MB"), lower_is_better=True, digits=(2, 1)),
}


@dataclass
class RunRecord:
    """What the aggregator needs from one run (a folder or a W&B run)."""

    run_id: str
    state: str  # finished | running | failed | corrupt | incomplete
    problem: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    final: dict[str, Any] = field(default_factory=dict)

    def get(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        return node


# ----------------------------------------------------------------------------------------- reading

def _read_json(path: Path) -> tuple[dict | None, str]:
    if not path.exists():
        return None, f"no {path.name}"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return None, f"corrupt {path.name} ({type(err).__name__})"
    if not isinstance(data, dict):
        return None, f"corrupt {path.name} (not a JSON object)"
    return data, ""


def read_run_folder(folder: Path) -> RunRecord:
    """One run folder → RunRecord; never raises (a corrupt file becomes state `corrupt`)."""
    run_id = str(folder)
    try:
        config = yaml.safe_load((folder / "config.yaml").read_text())
    except FileNotFoundError:
        return RunRecord(run_id, "incomplete", "no config.yaml")
    except (OSError, yaml.YAMLError) as err:
        return RunRecord(run_id, "corrupt", f"corrupt config.yaml ({type(err).__name__})")
    if not isinstance(config, dict):
        return RunRecord(run_id, "corrupt", "corrupt config.yaml (not a mapping)")
    status, why = _read_json(folder / "status.json")
    if status is None:
        return RunRecord(run_id, "corrupt" if why.startswith("corrupt") else "incomplete", why, config)
    state = str(status.get("state", "?"))
    if state != "finished":
        detail = status.get("error") or status.get("message") or ""
        return RunRecord(run_id, state, f"status {state}" + (f": {detail}" if detail else ""), config)
    final, why = _read_json(folder / "final.json")
    if final is None:
        return RunRecord(run_id, "corrupt", f"finished but {why}", config)
    return RunRecord(run_id, "finished", "", config, final)


def read_run_folders(runs_dir: Path, experiment: str) -> list[RunRecord]:
    """Every run folder under `<runs_dir>/<experiment>/` (folders without config.yaml included; folders
    moved aside by `force=true` (`<hash>.old-<time>`) and lock files left out)."""
    root = Path(runs_dir) / experiment
    if not root.is_dir():
        return []
    return [read_run_folder(p) for p in sorted(root.iterdir())
            if p.is_dir() and not p.name.startswith(".") and ".old-" not in p.name]


def _unflatten(flat: Mapping[str, Any], sep: str) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        node = nested
        *parents, leaf = str(key).split(sep)
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def record_from_wandb(run: Any) -> RunRecord:
    """A W&B public-API run (`.id`, `.state`, `.config`, `.summary`) → RunRecord.

    The runner logs the resolved config as the run config and the final record (final.json) into the
    summary; keys flattened as `columns/CoLA` or `columns.CoLA` are folded back. W&B's `crashed` and
    `killed` states count as failed.
    """
    config = dict(run.config)
    if any("." in k for k in config) and not any(isinstance(v, Mapping) for v in config.values()):
        config = _unflatten(config, ".")
    summary = {k: v for k, v in dict(run.summary).items() if not str(k).startswith("_")}
    if any("/" in str(k) for k in summary):
        summary = {**summary, **_unflatten({k: v for k, v in summary.items() if "/" in str(k)}, "/")}
    final = summary.get("final") if isinstance(summary.get("final"), Mapping) else summary
    state = {"crashed": "failed", "killed": "failed"}.get(run.state, run.state)
    run_id = f"wandb:{run.id}"
    if state != "finished":
        return RunRecord(run_id, state, f"W&B state {run.state}", config)
    if not isinstance(final.get("columns"), Mapping) and "step_time_s" not in final:
        return RunRecord(run_id, "corrupt", "finished but the W&B summary has no `columns`", config)
    return RunRecord(run_id, "finished", "", config, dict(final))


def read_wandb(experiment: str, project: str, entity: str | None = None) -> list[RunRecord]:
    """Runs of W&B group `experiment` in `entity/project` via `wandb.Api()`.

    Needs runs that were logged online (or uploaded with `make wandb-sync`): offline runs are not
    visible to the public API.
    """
    import wandb

    path = f"{entity}/{project}" if entity else project
    return [record_from_wandb(run) for run in latest_generation(wandb.Api().runs(path, filters={"group": experiment}))]


def latest_generation(runs: Iterable[Any]) -> list[Any]:
    """Keep, per run folder, only the W&B run of its latest `force=true` rerun (ids `<exp>-<hash>[-f<k>]`)."""
    best: dict[str, tuple[int, Any]] = {}
    for run in runs:
        match = re.fullmatch(r"(.+-[0-9a-f]{12})-f(\d+)", str(run.id))
        base, k = (match[1], int(match[2])) if match else (str(run.id), 0)
        if base not in best or k > best[base][0]:
            best[base] = (k, run)
    return [run for _, run in best.values()]


# ----------------------------------------------------------------------------------------- cells

def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", str(name).lower())


def setting_label(record: RunRecord) -> str:
    """Table 2's Setting: Non-DP for ε=∞, else ε=<epsilon>."""
    name = record.get("privacy.name")
    if name in PRIVACY_LABELS:
        return PRIVACY_LABELS[name]
    eps = _as_float(record.get("privacy.epsilon"))
    return "Non-DP" if eps is None or math.isinf(eps) else f"ε={eps:g}"


def backbone_label(record: RunRecord, paper_backbones: Iterable[str]) -> str:
    """Table 3's row: the paper backbone the run stands for (`backbone.paper_name`, else its name)."""
    name = str(record.get("backbone.paper_name") or record.get("backbone.name", "?"))
    return next((b for b in paper_backbones if _norm(b) == _norm(name)), name)


def cell_key(spec: TableSpec, record: RunRecord, paper: pd.DataFrame) -> tuple:
    method = METHOD_LABELS.get(record.get("method.name"), str(record.get("method.name")))
    if spec.name == "table2":
        return (setting_label(record), method)
    if spec.name == "table3":
        return (backbone_label(record, paper["Backbone"].unique()), method)
    if spec.name == "table4":
        return (int(record.get("lora.r", -1)), method)
    return (method,)


def _as_float(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _mean(values: Iterable[float | None]) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def suite_columns(records: Sequence[RunRecord]) -> dict[str, float]:
    """Per paper column, the mean over the finished runs (seeds) of one cell and suite."""
    names = sorted({c for r in records for c in r.final.get("columns", {})})
    return {c: _mean(_as_float(r.final["columns"].get(c)) for r in records) for c in names}


def cell_values(spec: TableSpec, by_suite: Mapping[str, Sequence[RunRecord]]) -> dict[str, float]:
    """The value columns of one row from the finished runs of each suite (NaN where not available)."""
    cols = {s: suite_columns(rs) for s, rs in by_suite.items() if rs}
    complete = all(by_suite.get(s) for s in spec.suites)
    if spec.name == "table5":
        rs = by_suite.get("math10k", [])
        return {"Step_time_s": _mean(_as_float(r.final.get("step_time_s")) for r in rs),
                "Peak_memory_MB": _mean(_as_float(r.final.get("peak_memory_mb")) for r in rs)}
    if spec.name == "table4":
        glue = list(cols.get("glue8", {}).values())
        math_ = list(cols.get("math10k", {}).values())
        return {"GLUE8_Avg": _mean(glue), "Math_Avg": _mean(math_),
                "Avg_12": _mean(glue + math_) if complete else math.nan}
    merged = {c: v for suite in spec.suites for c, v in cols.get(suite, {}).items()}
    row = {c: merged.get(c, math.nan) for c in spec.columns if c != "Avg"}
    row["Avg"] = _mean(merged.values()) if complete else math.nan
    return row


def cell_epsilon(by_suite: Mapping[str, Sequence[RunRecord]]) -> dict[str, float]:
    """Realised ε per suite (the largest over the cell's runs) as read back from the accountant."""
    out = {}
    for suite, rs in by_suite.items():
        eps = [_as_float(r.final.get("epsilon_spent")) for r in rs]
        eps = [e for e in eps if e is not None]
        out[f"eps_spent_{suite}"] = max(eps) if eps else math.nan
    return out


# ----------------------------------------------------------------------------------------- table

@dataclass
class TableResult:
    spec: TableSpec
    scale: str
    frame: pd.DataFrame  # keys, value columns, <col>_paper, <col>_delta, <col>_best, eps_spent_*, n_runs
    missing: list[str]
    ignored: list[str]
    stand_ins: list[str] = field(default_factory=list)


def load_paper(name: str) -> pd.DataFrame:
    return pd.read_csv(PAPER_DIR / f"{name}.csv")


def choose_scale(records: Sequence[RunRecord], scale: str | None) -> str:
    """The requested scale, else the scale of most records (embedded when there are none)."""
    if scale:
        if scale not in ("embedded", "paper"):
            raise SystemExit(f"scale={scale} is not known: use scale=embedded or scale=paper")
        return scale
    seen = pd.Series([r.get("suite.scale") for r in records]).dropna()
    return str(seen.mode().iloc[0]) if not seen.empty else "embedded"


def expected_rows(paper: pd.DataFrame, keys: Sequence[str], seen: Iterable[tuple]) -> list[tuple]:
    """Rows the table must have: the paper's rows in its order, then any extra rows the runs have."""
    rows = [tuple(r) for r in paper[list(keys)].itertuples(index=False)]
    return rows + [k for k in dict.fromkeys(seen) if k not in rows]


def stand_ins(records: Sequence[RunRecord]) -> list[str]:
    """`paper backbone → backbone actually run` for runs on an embedded stand-in (Table 3)."""
    pairs = {(r.get("backbone.paper_name"), r.get("backbone.name")) for r in records if r.config}
    return sorted(f"{p} → {n}" for p, n in pairs if p and n and _norm(p) != _norm(n))


def _fmt_key(spec: TableSpec, key: tuple) -> str:
    return " / ".join(f"r={k}" if name == "Rank" else str(k) for name, k in zip(spec.keys, key))


def build_table(spec: TableSpec, records: Sequence[RunRecord], scale: str | None = None,
                paper: pd.DataFrame | None = None) -> TableResult:
    """Cells from records, paper numbers and deltas beside them, best marks, and the missing list."""
    paper = load_paper(spec.name) if paper is None else paper
    scale = choose_scale(records, scale)
    ignored = [f"{r.run_id}: scale {r.get('suite.scale')}" for r in records
               if r.config and r.get("suite.scale") not in (None, scale)]
    records = [r for r in records if not r.config or r.get("suite.scale") in (None, scale)]
    problems = [r for r in records if r.state != "finished"]
    finished = [r for r in records if r.state == "finished"]
    groups: dict[tuple, dict[str, list[RunRecord]]] = {}
    for r in finished:
        groups.setdefault(cell_key(spec, r, paper), {}).setdefault(str(r.get("suite.name")), []).append(r)
    rows = expected_rows(paper, spec.keys, [*groups, *(cell_key(spec, r, paper) for r in problems if r.config)])
    paper_idx = paper.set_index(list(spec.keys)).to_dict("index")
    table, missing = [], []
    for key in rows:
        by_suite = groups.get(key, {})
        values = cell_values(spec, by_suite)
        row: dict[str, Any] = dict(zip(spec.keys, key))
        for col in spec.columns:
            ref = _as_float(paper_idx.get(key[0] if len(key) == 1 else key, {}).get(col))
            row[col] = values[col]
            row[f"{col}_paper"] = math.nan if ref is None else ref
            row[f"{col}_delta"] = values[col] - ref if ref is not None else math.nan
        row.update(cell_epsilon(by_suite))
        row["n_runs"] = sum(len(v) for v in by_suite.values())
        table.append(row)
        for suite in spec.suites:
            if not by_suite.get(suite):
                why = [f"{r.problem} ({r.run_id})" for r in problems
                       if r.config and cell_key(spec, r, paper) == key and r.get("suite.name") == suite]
                missing.append(f"{_fmt_key(spec, key)} / {suite}: " + ("; ".join(why) or "no run folder"))
    missing += [f"{_fmt_key(spec, k)} / {r.get('suite.name')}: {r.problem} ({r.run_id}); the cell has a finished run"
                for r in problems if r.config and groups.get(k := cell_key(spec, r, paper), {}).get(r.get("suite.name"))]
    missing += [f"{r.problem} ({r.run_id})" for r in problems if not r.config]
    columns = [*spec.keys, *(c for col in spec.columns for c in (col, f"{col}_paper", f"{col}_delta")),
               *(f"eps_spent_{s}" for s in spec.suites), "n_runs"]
    frame = pd.DataFrame(table, columns=columns)
    return TableResult(spec, scale, mark_best(frame, spec), missing, ignored, stand_ins(records))


def mark_best(frame: pd.DataFrame, spec: TableSpec) -> pd.DataFrame:
    """Add `<col>_best` flags: the best value per column within each block (ties all marked)."""
    frame = frame.copy()
    blocks = frame.groupby(spec.block, sort=False) if spec.block else [(None, frame)]
    for col in spec.columns:
        flags = pd.Series(False, index=frame.index)
        for _, part in blocks:
            vals = pd.to_numeric(part[col], errors="coerce")
            if vals.notna().any():
                best = vals.min() if spec.lower_is_better else vals.max()
                flags.loc[part.index] = (vals - best).abs() < 1e-12
        frame[f"{col}_best"] = flags
    return frame


# ----------------------------------------------------------------------------------------- rendering

def _digits(spec: TableSpec, col: str) -> int:
    return spec.digits[spec.columns.index(col)] if spec.digits else 3


def _cell_text(spec: TableSpec, row: pd.Series, col: str, bold: tuple[str, str]) -> str:
    d = _digits(spec, col)
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
    if result.scale == "paper":
        return "Scale: paper (the paper's backbones and full suites; comparable with the paper's numbers)."
    return ("Scale: embedded (small CPU backbone, stand-in tasks for the columns shown; these numbers are "
            "NOT comparable with the paper's — the paper's numbers are shown for layout only).")


def _label(col: str) -> str:
    return {"GLUE8_Avg": "GLUE8 Avg", "Math_Avg": "Math Avg", "Avg_12": "Avg (12 tasks)",
            "Step_time_s": "Step time (s)", "Peak_memory_MB": "Peak memory (MB)"}.get(col, col)


def to_markdown(result: TableResult) -> str:
    spec, frame = result.spec, result.frame
    head = [f"# Table {spec.name[-1]}: {spec.title}", "", scale_line(result),
            "Best per column " + (f"within each {spec.block} block " if spec.block else "")
            + "in **bold**; beside each cell: the paper's number and our difference.", ""]
    if result.stand_ins:
        head[-1:] = ["Backbones run in place of the paper's: " + ", ".join(result.stand_ins) + ".", ""]
    header = [*spec.keys, *(_label(c) for c in spec.columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, row in frame.iterrows():
        cells = [str(row[k]) for k in spec.keys] + [_cell_text(spec, row, c, ("**", "**")) for c in spec.columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(head + lines + ["", *_missing_md(result)]) + "\n"


def _missing_md(result: TableResult) -> list[str]:
    out = ["## Missing, running, failed or corrupt runs", ""]
    out += [f"- {m}" for m in result.missing] or ["- none"]
    if result.ignored:
        out += ["", f"Ignored (other scale than {result.scale}):", *(f"- {m}" for m in result.ignored)]
    return out


def _tex_escape(text: str) -> str:
    return (text.replace("\\", r"\textbackslash{}").replace("&", r"\&").replace("%", r"\%")
            .replace("_", r"\_").replace("#", r"\#").replace("ε", r"$\varepsilon$").replace("—", "--"))


def to_latex(result: TableResult) -> str:
    spec, frame = result.spec, result.frame
    cols = "l" * len(spec.keys) + "r" * len(spec.columns)
    lines = [f"% {scale_line(result)}", r"\begin{tabular}{" + cols + "}", r"\toprule",
             " & ".join(_tex_escape(h) for h in (*spec.keys, *(_label(c) for c in spec.columns))) + r" \\",
             r"\midrule"]
    previous = None
    for _, row in frame.iterrows():
        if spec.block and previous is not None and row[spec.block] != previous:
            lines.append(r"\midrule")
        previous = row[spec.block] if spec.block else None
        cells = [_tex_escape(str(row[k])) for k in spec.keys]
        cells += [_tex_escape(_cell_text(spec, row, c, ("\x00", "\x01"))).replace("\x00", r"\textbf{")
                  .replace("\x01", "}") for c in spec.columns]
        lines.append(" & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    lines += [f"% missing: {_tex_escape(m)}" for m in result.missing]
    return "\n".join(lines) + "\n"


def plot_privacy_utility(result: TableResult, path: Path) -> Path:
    """Avg vs ε per method for Table 2 (ours solid, paper dashed); ε=∞ (Non-DP) drawn at the right end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = result.frame.copy()
    frame["eps"] = [math.inf if s == "Non-DP" else float(str(s).split("=")[-1]) for s in frame["Setting"]]
    finite = sorted(e for e in frame["eps"].unique() if not math.isinf(e)) or [1.0]
    inf_x = finite[-1] * 2
    frame["x"] = frame["eps"].replace(math.inf, inf_x)
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (method, part) in enumerate(frame.sort_values("x").groupby("Method", sort=False)):
        color = f"C{i % 10}"
        ours = part.dropna(subset=["Avg"])
        if not ours.empty:
            ax.plot(ours["x"], ours["Avg"], "o-", color=color, label=f"{method}")
        ref = part.dropna(subset=["Avg_paper"])
        if not ref.empty:
            ax.plot(ref["x"], ref["Avg_paper"], "x--", color=color, alpha=0.5,
                    label=None if not ours.empty else f"{method} (paper only)")
    ticks = [*finite, inf_x]
    ax.set_xticks(ticks, [f"{e:g}" for e in finite] + ["∞\n(non-DP)"])
    ax.set_xlabel("ε (δ = 1e-5)")
    ax.set_ylabel("Avg over available tasks")
    ax.set_title(f"Privacy–utility ({result.scale} scale; dashed = paper)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(result: TableResult, out_dir: Path) -> list[Path]:
    """Write `<name>.{md,csv,tex}`, `<name>_missing.csv` (and Table 2's plot); return the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = result.spec.name
    paths = [out_dir / f"{name}.{ext}" for ext in ("md", "csv", "tex")]
    paths[0].write_text(to_markdown(result))
    csv = result.frame.copy()
    csv.insert(0, "scale", result.scale)
    csv.to_csv(paths[1], index=False, float_format="%.6g")
    paths[2].write_text(to_latex(result))
    missing = out_dir / f"{name}_missing.csv"
    pd.DataFrame({"missing": result.missing}).to_csv(missing, index=False)
    paths.append(missing)
    if name == "table2":
        paths.append(plot_privacy_utility(result, out_dir / "table2_privacy_utility.png"))
    return paths


# ----------------------------------------------------------------------------------------- CLI

def parse_args(argv: Sequence[str]) -> dict[str, str]:
    args = {"source": "runs", "runs_dir": "results/runs", "out_dir": "results/tables",
            "wandb_project": "prism-dp-lora", "wandb_entity": "", "scale": ""}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in {*args, "experiment"}:
            raise SystemExit(f"unknown argument {item!r}: use key=value with key in "
                             f"experiment, {', '.join(args)}")
        args[key] = value
    if args.get("experiment") not in (*SPECS, "all"):
        raise SystemExit(f"experiment= must be one of {', '.join(SPECS)} or all")
    if args["source"] not in ("runs", "wandb"):
        raise SystemExit("source= must be runs or wandb")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    names = list(SPECS) if args["experiment"] == "all" else [args["experiment"]]
    for name in names:
        if args["source"] == "wandb":
            records = read_wandb(name, args["wandb_project"], args["wandb_entity"] or None)
        else:
            records = read_run_folders(Path(args["runs_dir"]), name)
        result = build_table(SPECS[name], records, args["scale"] or None)
        paths = write_outputs(result, Path(args["out_dir"]))
        print(to_markdown(result))
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
