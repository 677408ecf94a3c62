"""Reading runs from W&B (``source=wandb``): the public API's runs → :class:`RunRecord`.

Only runs logged online, or uploaded with ``make wandb-sync``, are visible. Without an API key or
without a connection the reader fails at once with one line (W&B itself would retry for minutes).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from pipelines.config.wandb_access import access_problem
from pipelines.runs import store
from pipelines.tables.records import AggregateError, RunRecord, columns_problem
from prism.record import FinalRecord, RecordError

TIMEOUT_S = 30


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
    """A W&B public-API run (``.id``, ``.state``, ``.config``, ``.summary`` holding final.json; keys flattened
    as ``columns/CoLA`` or ``columns.CoLA`` folded back) → RunRecord; ``crashed`` and ``killed`` count as failed."""
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
    try:
        record = FinalRecord.from_json(final)
    except RecordError as err:
        return RunRecord(run_id, "corrupt", f"finished but the W&B summary does not parse: {err}", config)
    if why := columns_problem(record, config, "the W&B summary"):
        return RunRecord(run_id, "corrupt", f"finished but {why}", config)
    if why := store.scores_problem(record):
        return RunRecord(run_id, "refused", f"refused: {why}", config)
    return RunRecord(run_id, "finished", "", config, record)


def latest_generation(runs: Iterable[Any]) -> list[Any]:
    """Keep, per run, only the W&B run of its latest ``force=true`` rerun (ids ``<exp>-<hash>[-f<k>]``)."""
    best: dict[str, tuple[int, Any]] = {}
    for run in runs:
        match = re.fullmatch(r"(.+-[0-9a-f]{12})-f(\d+)", str(run.id))
        base, k = (match[1], int(match[2])) if match else (str(run.id), 0)
        if base not in best or k > best[base][0]:
            best[base] = (k, run)
    return [run for _, run in best.values()]


def read_wandb(experiment: str, project: str, entity: str | None = None) -> list[RunRecord]:
    """Runs of W&B group ``experiment`` in ``entity/project`` via ``wandb.Api()`` (rows a table shares with
    another, e.g. Table 4's r=16 rows, are in the group of the table that trained them)."""
    if problem := access_problem():
        raise AggregateError(f"source=wandb: {problem}")
    import wandb

    path = f"{entity}/{project}" if entity else project
    try:
        runs = list(wandb.Api(timeout=TIMEOUT_S).runs(path, filters={"group": experiment}))
    except Exception as err:  # wandb raises its own error types for auth, network and bad paths
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise AggregateError(f"source=wandb: W&B query of {path} failed ({first}), "
                             f"check wandb_project=/wandb_entity= and the API key") from err
    return [record_from_wandb(run) for run in latest_generation(runs)]
