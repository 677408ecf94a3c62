"""``python -m pipelines aggregate``: rebuild a paper table from the run store (or W&B) beside the paper's
numbers (:mod:`pipelines.tables`: the runs, the cells, the files)."""
from __future__ import annotations

from pathlib import Path

from pipelines.tables.build import PROTOCOLS, SCALES, build_table, protocol_of
from pipelines.tables.records import AggregateError, read_run_folders
from pipelines.tables.render import to_markdown, write_outputs, write_protocols
from pipelines.tables.specs import SPECS
from pipelines.tables.wandb_source import read_wandb


def aggregate(*, experiment: str, source: str = "runs", runs_dir: str = "results/runs", out_dir: str = "results/tables",
              wandb_project: str = "prism-dp-lora", wandb_entity: str = "", scale: str = "", protocol: str = "") -> int:
    r"""Build, print and write the table of ``experiment`` (table2..table5 or all) from the run store
    ``runs_dir`` (``source=wandb``: from the W&B project) into ``out_dir``, once per scale and protocol
    (``scale=`` embedded|paper / ``protocol=`` corrected|released pick one; by default every scale and
    protocol the runs have, embedded and corrected when they have none), and the side-by-side protocol
    table where two have runs. Bad arguments and an unwritable ``out_dir`` are one-line
    :class:`AggregateError`\ s (exit code 2)."""
    if experiment not in (*SPECS, "all"):
        raise AggregateError(f"experiment={experiment} is not a table, use experiment= one of {', '.join(SPECS)} or all")
    if protocol and protocol not in PROTOCOLS:
        raise AggregateError(f"protocol={protocol} is not known, use protocol= one of {', '.join(PROTOCOLS)}")
    if source not in ("runs", "wandb"):
        raise AggregateError(f"source={source} is not known, use source=runs or source=wandb")
    try:
        for name in list(SPECS) if experiment == "all" else [experiment]:
            records = (read_wandb(name, wandb_project, wandb_entity or None) if source == "wandb"
                       else read_run_folders(Path(runs_dir), name))
            seen = [s for s in SCALES if any(r.get("suite.scale") == s for r in records)]
            for at in [scale] if scale else seen or ["embedded"]:
                at_scale = [r for r in records if r.get("suite.scale") in (None, at)]
                protocols = ([protocol] if protocol else
                             [p for p in PROTOCOLS if any(protocol_of(r) == p for r in at_scale)] or ["corrected"])
                results = [build_table(SPECS[name], records, at, protocol=p) for p in protocols]
                for result in results:
                    paths = write_outputs(result, Path(out_dir))
                    print(to_markdown(result))
                    if paths:
                        print("wrote " + ", ".join(str(p) for p in paths))
                    else:
                        print(f"{name}: no finished run at scale {result.scale} under protocol {result.protocol}; "
                              f"no table written (existing tables in {out_dir} left as they are)")
                if side_by_side := write_protocols(results, Path(out_dir)):
                    print(f"wrote {side_by_side}")
    except OSError as err:  # out_dir read-only, a file, or full: one line, no traceback
        raise AggregateError(f"cannot write the tables ({err.strerror or type(err).__name__}: {err.filename or ''}), "
                             "point out_dir= at a writable folder") from None
    return 0
