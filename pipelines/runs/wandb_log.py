"""Weights & Biases logging of one run: config, per-step metrics, final scores.

Offline by default (``logging.mode: offline``, files under ``logging.dir``; ``make wandb-sync``
uploads them), ``online`` when asked, ``disabled`` in unit tests. The W&B run id is
``<experiment>-<run hash>`` of the experiment that trains the run (a run shared by several tables
is trained, and logged, once; the other tables reuse its folder) with ``resume="allow"``, so a resumed or requeued job
appends to the same W&B run; ``group`` = experiment; one ``axis:value`` tag per grid axis.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipelines.config.schema import ConfigError
from pipelines.config.wandb_access import OFFLINE_FIX
from pipelines.runs.store import RunBlock
from prism.record import FinalRecord

MODES = ("offline", "online", "disabled")
INIT_TIMEOUT_S = 30.0  # logging=online: how long wandb.init may wait for the server (its default retries for minutes)


def _finite(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a (nested) record, keys joined with ``/`` (W&B cannot chart ±inf)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_finite(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[f"{prefix}{key}"] = value
    return out


def summary_text(final: FinalRecord) -> dict[str, Any]:
    """The strings of ``final.json`` a reader of the W&B summary must see: the DP status (``protocol/dp_guarantee``,
    e.g. "not a valid DP guarantee as stated") and its caveats, which :func:`_finite` would drop."""
    out: dict[str, Any] = {}
    if final.dp_guarantee is not None:
        out["protocol/dp_guarantee"] = str(final.dp_guarantee)
    if final.dp_caveats:
        out["protocol/dp_caveats"] = "; ".join(map(str, final.dp_caveats))
    return out


def run_id(cfg: DictConfig, run_hash: str, generation: int = 0) -> str:
    """The W&B run id: ``<experiment>-<run hash>``, ``-f<k>`` after the k-th ``force=true``."""
    return f"{cfg.experiment}-{run_hash}" + (f"-f{generation}" if generation else "")


def log_record(cfg: DictConfig, run_hash: str, final: dict[str, Any], history: Sequence[dict[str, Any]],
               record: FinalRecord | None = None) -> bool:
    """Log a finished run from its local record (``history``: its step records, then ``final``, the summary, and
    ``record``, as in :meth:`WandbRun.finish`) as one W&B run of ``cfg``, opened and closed at once (no time of
    training reaches W&B); False, logging nothing, when ``logging.mode`` is disabled or ``logging.dir`` already
    holds a W&B run of that id (a rerun logs it once)."""
    if str(cfg.logging.mode) == "disabled" or any(Path(cfg.logging.dir).rglob(f"*run-*-{run_id(cfg, run_hash)}")):
        return False
    WandbRun(cfg, run_hash, deferred=True).finish(final, history=history, record=record)
    return True


class WandbRun:
    """A W&B run bound to one run folder; every method is a no-op when ``mode == disabled``."""

    def __init__(self, cfg: DictConfig, run_hash: str, generation: int = 0, deferred: bool = False) -> None:
        """``deferred`` (``privacy.log_private_stats=false``): nothing reaches W&B while the run trains;
        :meth:`finish` opens the W&B run and logs the whole history at once, so W&B's own row times
        (``_timestamp``, ``_runtime``) and its start time carry no per-step timing."""
        mode = str(cfg.logging.mode)
        if mode not in MODES:
            raise ValueError(f"logging.mode={mode!r}; choose one of {', '.join(MODES)}")
        self.run = None
        self.deferred = deferred
        self._open = None
        if mode == "disabled":
            return
        directory = Path(cfg.logging.dir)
        directory.mkdir(parents=True, exist_ok=True)
        self._open = functools.partial(self._init, cfg, run_hash, generation, directory, mode)
        if not deferred:
            self._open()

    def _init(self, cfg: DictConfig, run_hash: str, generation: int, directory: Path, mode: str) -> None:
        import wandb

        backbone = cfg.backbone.get("paper_name", cfg.backbone.name)  # the table row
        try:
            self.run = wandb.init(
                project=str(cfg.logging.project),
                entity=cfg.logging.entity,
                dir=str(directory),
                id=run_id(cfg, run_hash, generation),
                name=f"{cfg.experiment}/{cfg.method.name}-{cfg.privacy.name}-{cfg.suite.name}-{backbone}-r{cfg.lora.r}",
                group=str(cfg.experiment),
                tags=[f"method:{cfg.method.name}", f"privacy:{cfg.privacy.name}", f"suite:{cfg.suite.name}",
                      f"backbone:{backbone}", f"rank:{cfg.lora.r}", f"scale:{cfg.suite.scale}"],  # one per grid axis
                config=OmegaConf.to_container(cfg, resolve=True),
                resume="allow",
                mode=mode,
                settings=wandb.Settings(console="off", quiet=True, x_disable_stats=True, init_timeout=INIT_TIMEOUT_S),
            )
        except (wandb.Error, TimeoutError) as err:  # no answer within INIT_TIMEOUT_S, or a refusal
            raise ConfigError(f"logging={mode}: W&B could not start the run ({' '.join(str(err).split())}), "
                              f"{OFFLINE_FIX}") from None

    def log_step(self, record: dict[str, Any]) -> None:
        """Per-step metrics at W&B step ``record['step']`` (a replayed step after resume is dropped by
        W&B); nothing while ``deferred``."""
        if self.run is None or self.deferred:
            return
        step = record.get("step")
        self.run.log(_finite(record), step=int(step) if step is not None else None)

    def finish(self, final: dict[str, Any] | None, exit_code: int = 0,
               history: Sequence[dict[str, Any]] = (), record: FinalRecord | None = None) -> None:
        """Write the final scores to the run summary and close the run; a ``deferred`` run is opened
        here and first logs ``history`` (the run folder's step records). ``record``: the core's record whose
        DP status the summary states (:func:`summary_text`; by default ``final`` parsed)."""
        if self.deferred and self._open is not None:
            self._open()
            self.deferred = False
            for step in history:
                self.log_step(step)
        if self.run is None:
            return
        if final:
            self.run.summary.update({**_finite({k: v for k, v in final.items() if k != RunBlock.KEY}),
                                     **summary_text(record or FinalRecord.from_json(final))})
        self.run.finish(exit_code=exit_code)
        self.run = None
