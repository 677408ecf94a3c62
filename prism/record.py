"""The record a run leaves: the fields of ``final.json`` the core writes (docs/ARCHITECTURE.md "Contracts").

:func:`prism.train.train_and_evaluate` builds one :class:`FinalRecord` and returns its :meth:`FinalRecord.to_json`;
the runner adds its own ``run`` block beside these fields (``pipelines/runs/store.py``), and every reader parses
a stored ``final.json`` (or a W&B summary of one) back through :meth:`FinalRecord.from_json`. A field the file
does not hold is ``None``; a field of the wrong type is a :class:`RecordError` naming it, which the readers
report as a refused record instead of averaging it.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class RecordError(ValueError):
    """A run record that cannot be trusted: the aggregator refuses it in one line naming the run."""


def _kind_problem(value: Any, hint: Any) -> str:
    """Why ``value`` (parsed JSON, not ``None``) is not of the annotated type ``hint`` ('' when it is); a bool
    is no number."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else [hint]
    if any(_is(value, a) for a in args):
        return ""
    return f"is {type(value).__name__}, not {' or '.join(_name(a) for a in args)}"


def _is(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint) or hint
    if origin is Any:
        return True
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is dict:
        return isinstance(value, Mapping)
    return isinstance(value, origin)


def _name(hint: Any) -> str:
    origin = typing.get_origin(hint) or hint
    return {dict: "a mapping", list: "a list", float: "a number", int: "an integer", str: "a string"}.get(origin, str(hint))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _parse(cls: type, block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The keyword arguments of dataclass ``cls`` from ``block``: each field's value as stored (``None`` when
    absent), type-checked against its annotation; :class:`RecordError` naming ``where`` and the field."""
    values = {}
    for f in dataclasses.fields(cls):
        value = block.get(f.name)
        if value is not None and (why := _kind_problem(value, _hints(cls)[f.name])):
            raise RecordError(f"{where}'s `{f.name}` {why}")
        values[f.name] = value
    return values


@dataclass(frozen=True)
class Outcome:
    """One task's per-row outcomes of ``final.json`` ``per_example`` (:func:`prism.evaluation.evaluate.evaluate_suite`):
    its column, the 0/1 ``correct`` of each scored row (:func:`prism.evaluation.metrics.row_outcomes`) or, for a
    statistic column, each row's ``pred`` and ``gold`` (a user classification task's ``<task>/Macro-F1``: its
    labels and their count ``labels``), and ``rows``, the sha256 of the rows' prompts (the bootstrap's pairing)."""

    column: str | None = None
    correct: list[int] | None = None
    pred: list[Any] | None = None
    gold: list[Any] | None = None
    labels: int | None = None
    rows: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The outcome as written: its present fields in the evaluation's order."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, block: Any, task: str) -> Outcome:
        """The outcome of ``task`` in a parsed ``per_example``; :class:`RecordError` for a wrong type."""
        if not isinstance(block, Mapping):
            raise RecordError(f"final.json's `per_example` of {task}: not a mapping")
        return cls(**_parse(cls, block, f"final.json's `per_example` of {task}"))


@dataclass(frozen=True)
class SelectionBlock:
    """``final.json``'s ``selection`` block: what a private selection's candidate (``privacy.selection``;
    docs/PRIVACY.md "ε includes tuning") publishes besides its test rows. Written by the core
    (:func:`prism.train.train_and_evaluate`) and read back only through :meth:`from_json`. Nothing un-noised about
    the validation rows is in it: their per-row outcomes and their count are not recorded."""

    score: float  # the count of correct validation rows plus N(0, score_noise²)
    rows: int  # validation rows scored (public: the config fixes them)
    candidate: int
    mean: float  # E[K]
    shape: float  # η of K's law
    score_noise: float
    sigma: float  # the candidate's training σ (prism.privacy.selection.calibrate_candidate_sigma)
    epsilon: float  # ε at privacy.delta of the whole selection (prism.privacy.selection.selection_epsilon)

    def to_json(self) -> dict[str, Any]:
        """The block as written."""
        return dataclasses.asdict(self)

    def published_json(self) -> dict[str, Any]:
        """The block as the published candidate shows it: without the candidate's index."""
        return {k: v for k, v in self.to_json().items() if k != "candidate"}

    @classmethod
    def from_json(cls, block: Any) -> SelectionBlock:
        """The block of a parsed ``final.json``; :class:`RecordError` naming the first missing field."""
        if not isinstance(block, Mapping):
            raise RecordError("final.json's `selection` block is not a mapping")
        if missing := [f.name for f in dataclasses.fields(cls) if f.name not in block]:
            raise RecordError(f"final.json's `selection` block lacks `{missing[0]}`")
        return cls(**_parse(cls, block, "final.json's `selection` block"))


PRIVATE_FINAL = ("empty_batches", "train_time_s", "wall_time_s", "peak_memory_mb", "prefix_build_s", "step_time_s",
                 "seconds")
"""Fields that grow with the realised batch sizes, count empty batches, or are times: left out under
``privacy.log_private_stats=false`` (docs/PRIVACY.md)."""

ALWAYS_WRITTEN = ("prefix_depth",)
"""Fields written even when ``None`` (``null``: no frozen-prefix cache); every other ``None`` is an absent field."""


@dataclass(frozen=True)
class FinalRecord:
    """The core's fields of ``final.json``, in the order the trainer writes them: the privacy run (σ, the
    Poisson rate, steps, the realised ε, the protocol block of :func:`prism.privacy.protocol.protocol_record`),
    its cost, a released recipe's ``best_step``, a selection candidate's :class:`SelectionBlock`, then the
    evaluation's fields (:func:`prism.evaluation.evaluate.evaluate_suite`, which documents each; absent from a
    Table 5 benchmark run) and the wall time."""

    sigma: float | None = None
    sample_rate: float | None = None
    steps: int | None = None
    empty_batches: int | None = None
    n_train: int | None = None
    epsilon_spent: float | None = None
    peak_memory_mb: float | None = None
    train_time_s: float | None = None
    prefix_depth: int | None = None
    prefix_build_s: float | None = None
    protocol: dict[str, Any] | None = None
    step_time_s: float | None = None
    best_step: int | None = None
    selection: SelectionBlock | None = None
    scores: dict[str, Any] | None = None
    parse_failure: dict[str, Any] | None = None
    n: dict[str, Any] | None = None
    skipped: dict[str, Any] | None = None
    samples: dict[str, Any] | None = None
    seconds: dict[str, Any] | None = None
    eval_rows: dict[str, Any] | None = None
    per_example: dict[str, Outcome] | None = None
    metrics: dict[str, Any] | None = None
    unparseable: dict[str, Any] | None = None
    columns: dict[str, Any] | None = None
    average: float | None = None
    suite: str | None = None
    scale: str | None = None
    data: dict[str, Any] | None = None
    wall_time_s: float | None = None

    @property
    def dp_guarantee(self) -> str | None:
        """The DP status the protocol block states (:func:`prism.privacy.protocol.protocol_record`), None if unstated."""
        return (self.protocol or {}).get("dp_guarantee")

    @property
    def dp_caveats(self) -> list[str]:
        """The protocol block's caveats: why the stated ε is not a DP guarantee as stated (none when it is)."""
        return list((self.protocol or {}).get("dp_caveats") or [])

    def with_evaluation(self, evaluation: Mapping[str, Any]) -> FinalRecord:
        """This record with the fields of :func:`prism.evaluation.evaluate.evaluate_suite`'s result."""
        parsed = self.from_json(evaluation)
        return dataclasses.replace(self, **{k: getattr(parsed, k) for k in evaluation})

    def without_private(self) -> FinalRecord:
        """This record without :data:`PRIVATE_FINAL` (``privacy.log_private_stats=false``)."""
        return dataclasses.replace(self, **dict.fromkeys(PRIVATE_FINAL))

    def to_json(self) -> dict[str, Any]:
        """The fields as ``final.json`` holds them: present ones (and :data:`ALWAYS_WRITTEN`) in field order."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name not in ALWAYS_WRITTEN:
                continue
            if isinstance(value, SelectionBlock):
                value = value.to_json()
            elif f.name == "per_example":
                value = {task: outcome.to_json() for task, outcome in value.items()}
            out[f.name] = value
        return out

    def published_json(self) -> dict[str, Any]:
        """:meth:`to_json` of a selection's published candidate: its selection block without the candidate's
        index (:meth:`SelectionBlock.published_json`)."""
        out = self.to_json()
        if self.selection is not None:
            out["selection"] = self.selection.published_json()
        return out

    @classmethod
    def from_json(cls, final: Mapping[str, Any]) -> FinalRecord:
        """The record of a parsed ``final.json`` or W&B summary (other keys, such as the runner's ``run`` block,
        are not the core's and are left out); :class:`RecordError` naming the first field of a wrong type."""
        values = _parse(cls, {k: v for k, v in final.items() if k not in ("selection", "per_example")}, "final.json")
        if final.get("selection") is not None:
            values["selection"] = SelectionBlock.from_json(final["selection"])
        if (per := final.get("per_example")) is not None:
            if not isinstance(per, Mapping):
                raise RecordError(f"final.json's `per_example` {_kind_problem(per, dict)}")
            values["per_example"] = {str(task): Outcome.from_json(o, str(task)) for task, o in per.items()}
        return cls(**values)
