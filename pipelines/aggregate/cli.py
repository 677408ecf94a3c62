"""``python -m pipelines.aggregate``: arguments, sources, one-line errors (exit code 2)."""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from pipelines.aggregate.build import SCALES, build_table
from pipelines.aggregate.records import AggregateError, read_run_folders
from pipelines.aggregate.render import to_markdown, write_outputs
from pipelines.aggregate.specs import SPECS
from pipelines.aggregate.wandb_source import read_wandb

DEFAULTS = {"source": "runs", "runs_dir": "results/runs", "out_dir": "results/tables",
            "wandb_project": "prism-dp-lora", "wandb_entity": "", "scale": ""}


def parse_args(argv: Sequence[str]) -> dict[str, str]:
    """``key=value`` arguments → dict; raises :class:`AggregateError` naming the bad one."""
    args = dict(DEFAULTS)
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in {*args, "experiment"}:
            raise AggregateError(f"unknown argument {item!r}, use key=value with key in "
                                 f"experiment, {', '.join(args)}")
        args[key] = value
    if args.get("experiment") not in (*SPECS, "all"):
        raise AggregateError(f"experiment={args.get('experiment', '')} is not a table, "
                             f"use experiment= one of {', '.join(SPECS)} or all")
    if args["source"] not in ("runs", "wandb"):
        raise AggregateError(f"source={args['source']} is not known, use source=runs or source=wandb")
    return args


def run(args: dict[str, str]) -> None:
    """Build, print and write each requested table, once per scale (``scale=`` picks one; by
    default every scale the runs have, embedded when they have none)."""
    names = list(SPECS) if args["experiment"] == "all" else [args["experiment"]]
    for name in names:
        if args["source"] == "wandb":
            records = read_wandb(name, args["wandb_project"], args["wandb_entity"] or None)
        else:
            records = read_run_folders(Path(args["runs_dir"]), name)
        seen = [s for s in SCALES if any(r.get("suite.scale") == s for r in records)]
        for scale in [args["scale"]] if args["scale"] else seen or ["embedded"]:
            result = build_table(SPECS[name], records, scale)
            paths = write_outputs(result, Path(args["out_dir"]))
            print(to_markdown(result))
            if paths:
                print("wrote " + ", ".join(str(p) for p in paths))
            else:
                print(f"{name}: no finished run at scale {result.scale}; no table written "
                      f"(existing tables in {args['out_dir']} left as they are)")


def main(argv: Sequence[str] | None = None) -> int:
    """Exit code 0, or 2 with ``error: <what>, <how to fix>`` on one line."""
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except AggregateError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
