"""``python -m pipelines.aggregate``: arguments, sources, one-line errors (exit code 2)."""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from pipelines.aggregate.build import PROTOCOLS, SCALES, build_table, protocol_of
from pipelines.aggregate.records import AggregateError, read_run_folders
from pipelines.aggregate.render import to_markdown, write_outputs, write_protocols
from pipelines.aggregate.specs import SPECS
from pipelines.aggregate.wandb_source import read_wandb

DEFAULTS = {"source": "runs", "runs_dir": "results/runs", "out_dir": "results/tables",
            "wandb_project": "prism-dp-lora", "wandb_entity": "", "scale": "", "protocol": ""}


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
    if args["protocol"] and args["protocol"] not in PROTOCOLS:
        raise AggregateError(f"protocol={args['protocol']} is not known, use protocol= one of {', '.join(PROTOCOLS)}")
    if args["source"] not in ("runs", "wandb"):
        raise AggregateError(f"source={args['source']} is not known, use source=runs or source=wandb")
    return args


def run(args: dict[str, str]) -> None:
    """Build, print and write each requested table, once per scale and protocol (``scale=`` /
    ``protocol=`` pick one; by default every scale and protocol the runs have, embedded and
    corrected when they have none), and the side-by-side protocol table where two have runs."""
    names = list(SPECS) if args["experiment"] == "all" else [args["experiment"]]
    for name in names:
        if args["source"] == "wandb":
            records = read_wandb(name, args["wandb_project"], args["wandb_entity"] or None)
        else:
            records = read_run_folders(Path(args["runs_dir"]), name)
        seen = [s for s in SCALES if any(r.get("suite.scale") == s for r in records)]
        for scale in [args["scale"]] if args["scale"] else seen or ["embedded"]:
            at_scale = [r for r in records if r.get("suite.scale") in (None, scale)]
            protocols = ([args["protocol"]] if args["protocol"] else
                         [p for p in PROTOCOLS if any(protocol_of(r) == p for r in at_scale)] or ["corrected"])
            results = [build_table(SPECS[name], records, scale, protocol=p) for p in protocols]
            for result in results:
                paths = write_outputs(result, Path(args["out_dir"]))
                print(to_markdown(result))
                if paths:
                    print("wrote " + ", ".join(str(p) for p in paths))
                else:
                    print(f"{name}: no finished run at scale {result.scale} under protocol {result.protocol}; "
                          f"no table written (existing tables in {args['out_dir']} left as they are)")
            if side_by_side := write_protocols(results, Path(args["out_dir"])):
                print(f"wrote {side_by_side}")


def main(argv: Sequence[str] | None = None) -> int:
    """Exit code 0, or 2 with ``error: <what>, <how to fix>`` on one line."""
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except AggregateError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # out_dir read-only, a file, or full: one line, no traceback
        print(f"error: cannot write the tables ({err.strerror or type(err).__name__}: {err.filename or ''}), "
              "point out_dir= at a writable folder", file=sys.stderr)
        return 2
    return 0
