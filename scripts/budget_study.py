"""The embedded budget study (docs/embedded-scale.md, "Budget study"): train the cells that decide whether a
budget can carry Table 2's comparison, and print budget → cost → gate figures.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/budget_study.py --budget b256 --seeds 42,43 --out /tmp/study

Each cell is an ordinary ``python -m pipelines run`` (the same sampler, accountant, clip and evaluation as the
grid) with the budget's overrides, into ``<out>/<budget>/runs``; a rerun skips finished cells. Per cell the
script records the CPU seconds of its process (user + sys of the child), and per column the score. The gate
figures read per column are: the best non-private score minus the 0-step model's (``--zero`` scores the
0-step model with ``benchmarks/learning_curve.py --at 0``), and each private cell's score minus the 0-step
model's. Every method runs at its default rate (Table 8 × ``train.lr_multiplier``): ``PRISM_TUNED_DIR`` points
at an empty folder, so no budget reads rates tuned for another. One-off costs (frozen-prefix builds) are the first cell's ``prefix_build_s``; disk is
``du`` of ``$PRISM_CACHE``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

BUDGETS: dict[str, dict[str, list[str]]] = {
    # today's embedded budget: N = 2,000 GLUE8 rows, B = 64, T = 30, LoRA on the last layer
    "b64": {"glue8": [], "math10k": []},
    # the batch lever at the same N and T: q = 0.128
    "b256": {"glue8": ["train.batch_size=256", "train.micro_batch_size=64"],
             "math10k": ["train.batch_size=256", "train.micro_batch_size=64"]},
    # N doubled (SST-2 stand-in 3,200 + RTE stand-in 800) and B = 512: q = 0.128
    "n4k_b512": {"glue8": ["train.batch_size=512", "train.micro_batch_size=64",
                           "suite.embedded.train_per_task.tweet_sentiment=3200",
                           "suite.embedded.train_per_task.syllogism=800"],
                 "math10k": ["train.batch_size=256", "train.micro_batch_size=64",
                             "suite.embedded.train_per_task=500"]},
}
CELLS = [("prism", "eps6"), ("adamw", "eps6"), ("prism", "eps3"), ("adamw", "eps3"), ("prism", "nondp"),
         ("lora_rite", "nondp")]
ROOT = Path(__file__).resolve().parents[1]


def run_cell(out: Path, overrides: list[str]) -> tuple[dict, float]:
    """One ``pipelines run`` of ``overrides`` into ``out``: its final.json and the CPU seconds it took."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "pipelines", "run", *overrides, f"results_dir={out}",
                           "logging=disabled"], capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(overrides)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    line = [x for x in proc.stdout.splitlines() if "results in " in x][-1]
    final = Path(line.rsplit("results in ", 1)[1].strip())
    return json.loads(final.read_text()), cpu


def record(log: Path, row: dict) -> None:
    """Append ``row`` to the study's log and print it."""
    with log.open("a") as fh:
        fh.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def zero_step(overrides: list[str]) -> tuple[dict[str, float], float]:
    """The 0-step model's score per column (``benchmarks/learning_curve.py --at 0``) and its CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "learning_curve.py"), "--at", "0", "--",
                           "method=adamw", "privacy=nondp", "train.steps=1", *overrides], capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"error: the 0-step model exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in proc.stdout.splitlines()
             if line.startswith("| 0 |")]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {c[2]: float(c[3]) for c in cells}, cpu


def table(out: Path) -> str:
    """The Markdown rows of every finished cell under ``out`` (budget, cell, seed, σ, one column per score, CPU-s)."""
    rows = [json.loads(line) for log in sorted(out.glob("*.jsonl")) for line in log.read_text().splitlines()]
    columns = list(dict.fromkeys(c for r in rows for c in r["columns"]))
    lines = [f"| budget | cell | seed | σ | {' | '.join(columns)} | CPU-s |", "|---" * (len(columns) + 5) + "|"]
    for r in rows:
        scores = " | ".join(f"{r['columns'][c]:.3f}" if c in r["columns"] else "—" for c in columns)
        sigma = f"{r['sigma']:.3f}" if r.get("sigma") else "—"
        lines.append(f"| {r['budget']} | {r['cell']} | {r.get('seed', '—')} | {sigma} | {scores} | {r['cpu_s']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", choices=sorted(BUDGETS))
    parser.add_argument("--table", action="store_true", help="print the table of every finished cell in --out")
    parser.add_argument("--suites", default="glue8,math10k")
    parser.add_argument("--seeds", default="42,43")
    parser.add_argument("--cells", default=",".join(f"{m}:{p}" for m, p in CELLS))
    parser.add_argument("--zero", action="store_true", help="also run the 0-step model once per suite")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every cell")
    args = parser.parse_args()
    if args.table:
        print(table(args.out))
        return 0
    if args.budget is None:
        parser.error("--budget is required (or --table)")
    out = args.out / args.budget
    log = args.out / f"{args.budget}.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    cells = [tuple(c.split(":")) for c in args.cells.split(",")]
    (args.out / "no-tuned").mkdir(exist_ok=True)
    os.environ["PRISM_TUNED_DIR"] = str(args.out / "no-tuned")
    for suite in args.suites.split(","):
        base = [f"suite={suite}", *BUDGETS[args.budget][suite], *args.extra]
        if args.zero:
            columns, cpu = zero_step(base)
            record(log, {"budget": args.budget, "suite": suite, "cell": "0-step", "cpu_s": cpu, "columns": columns,
                         "extra": args.extra})
        for seed in args.seeds.split(","):
            for method, privacy in cells:
                final, cpu = run_cell(out, [f"method={method}", f"privacy={privacy}", *base, f"seed={seed}"])
                record(log, {"budget": args.budget, "suite": suite, "cell": f"{method} {privacy}", "seed": int(seed),
                             "cpu_s": cpu, "columns": final["columns"], "epsilon": final["epsilon_spent"],
                             "sigma": final["sigma"], "q": final["sample_rate"], "steps": final["steps"],
                             "prefix_build_s": final["prefix_build_s"], "run": final["run"]["hash"],
                             "extra": args.extra})
    cache = Path(os.environ.get("PRISM_CACHE", Path.home() / ".cache" / "prism"))
    du = subprocess.run(["du", "-sh", str(cache)], capture_output=True, text=True).stdout.strip()
    print(f"disk under $PRISM_CACHE: {du}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
