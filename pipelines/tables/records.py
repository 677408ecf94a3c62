"""Reading runs for the aggregator: one :class:`RunRecord` per run of an experiment's view.

The state of a run folder comes from :mod:`pipelines.runs.store` (the runner's own logic: finished,
running while a live process holds its lock, stale when killed, failed, corrupt); this module only
turns it into the fields a table needs.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipelines.runs import store
from prism.record import FinalRecord, RecordError


class AggregateError(ValueError):
    """Bad input to the aggregator; the message names the argument and the fix (exit code 2)."""


@dataclass
class RunRecord:
    """What the aggregator needs from one run (a folder or a W&B run)."""

    run_id: str
    state: str  # finished | running | stale | failed | corrupt | incomplete | refused (a record that cannot be trusted)
    problem: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    final: FinalRecord = field(default_factory=FinalRecord)  # the core's fields (all None until finished)
    run: store.RunBlock | None = None  # final.json's run block (a W&B summary has none)

    def get(self, dotted: str, default: Any = None) -> Any:
        """A config field by dotted name (``privacy.epsilon``), ``default`` when absent."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        return node


UNFINISHED = {"running": "running (its job holds the lock)",
              "stale": "stale: started but no live job holds its lock (killed?); re-running the grid resumes it",
              "stopped": "stopped by a signal; re-running the grid resumes it"}


def _load_config(folder: Path) -> dict[str, Any] | None:
    try:
        config = yaml.safe_load((folder / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return config if isinstance(config, dict) else None


def columns_problem(final: FinalRecord, config: Mapping[str, Any], source: str = "final.json") -> str:
    """Why a finished run's ``source`` (its final.json or W&B summary) holds no scores a table reads ('' when it
    does): its ``columns`` must map each column to its score (a mapping of another type is refused when it is
    parsed, :class:`~prism.record.RecordError`); only a Table 5 benchmark run (``train.benchmark`` set) may have
    none."""
    if final.columns is None and (config.get("train") or {}).get("benchmark") is None:
        return f"{source} has no `columns` (column -> score)"
    return ""


def read_run_folder(folder: Path) -> RunRecord:
    """One run folder → RunRecord; never raises (a corrupt file becomes state ``corrupt``)."""
    run_id = str(folder)
    info = store.inspect_run(folder)
    state = store.run_state(folder, info)
    if state == "absent":
        return RunRecord(run_id, "incomplete", "no run folder")
    config = _load_config(folder)
    if state == "corrupt":
        return RunRecord(run_id, "corrupt", f"corrupt: {info.reason}", config or {})
    if config is None:
        return RunRecord(run_id, state if state == "running" else "incomplete", "no config.yaml")
    if state in UNFINISHED:
        return RunRecord(run_id, state, UNFINISHED[state], config)
    if state == "failed":
        error = (info.status or {}).get("error") or ""
        return RunRecord(run_id, "failed", "failed" + (f": {error}" if error else ""), config)
    try:
        final, run = store.read_final(json.loads((folder / "final.json").read_text()))
    except RecordError as err:
        return RunRecord(run_id, "refused", f"refused: {err}", config)
    if why := columns_problem(final, config) or store.scores_problem(final):
        return RunRecord(run_id, "refused", f"refused: {why}", config)
    return RunRecord(run_id, "finished", "", config, final, run)


def read_run_folders(runs_dir: Path, experiment: str) -> list[RunRecord]:
    """Every run in the view of ``experiment`` (folders moved aside by ``force=true`` left out; a store in
    the older ``runs/<experiment>/`` layout is refused by :func:`pipelines.runs.store.view`)."""
    root = Path(runs_dir)
    if not root.is_dir():
        raise AggregateError(f"runs_dir={runs_dir} does not exist, pass the folder that holds the run store "
                             f"(results_dir/runs, e.g. runs_dir=results/runs)")
    return [read_run_folder(store.find_run(root, h)) for h in store.view(root, experiment)]
