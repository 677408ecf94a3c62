"""Learning rates chosen by the sweep of :mod:`pipelines.verbs.tune`, read when a config is composed.

Every method yaml sets ``lr: ${method_lr:<Table 8's rate of the suite family × train.lr_multiplier>}``;
:func:`method_lr` returns, in this order:

1. in a tuning run (``tune.lr_factor`` set, ``conf/experiment/tune.yaml``): the default rate × that
   factor — a sweep never reads earlier tuned rates, so rerunning it gives the same grid;
2. the tuned rate of the run's cell, when a file written by ``make tune`` has an entry whose
   :data:`MATCH` fields all equal the run's — a rate tuned for one budget, task or model is never
   applied to another. The files are ``conf/tuned/<scale>.yaml`` (the paper suites) and
   ``<results_dir>/tuned/*.yaml`` (``make tune TASK=...``: a user's task, kept beside its runs). The
   LoRA rank is not matched: Table 8 gives one rate per method, so Table 4's ranks use Table 2's (r = 16);
3. else the default rate (Table 8 × ``train.lr_multiplier``; docs/embedded-scale.md).

Each file is written whole by ``make tune`` and records the commit and command that produced it;
``PRISM_TUNED_DIR`` points the lookup at another folder (tests). A file is read through its schema
(:class:`TunedFile`, :class:`TunedRate`) with YAML's line marks: a value of the wrong type, an unknown
or missing key, two entries for one cell, or a cell of the grid the file covers without an entry is one
:class:`~pipelines.config.schema.ConfigError` line ``<file>:<line>: <what>, <fix>``, never a run at
the default rate. The grid is what the file says it covers (``generated``'s :data:`COVERS` lists, written
by :mod:`pipelines.verbs.tune`), not what its entries happen to hold: a file with every entry of one ε or one
method removed, or ``rates: []``, is refused.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, ValidationError

from pipelines.config.identity import canonical
from pipelines.config.schema import KINDS, ConfigError, help_field, require
from prism.job import LrSource

REPO = Path(__file__).resolve().parents[2]
TUNED_DIR = REPO / "conf" / "tuned"
MATCH = {  # entry field -> config field it must equal
    "method": "method.name", "suite": "suite.name", "scale": "suite.scale", "epsilon": "privacy.epsilon",
    "backbone": "backbone.name", "lora_layers": "backbone.lora_layers",
    "steps": "train.steps", "batch_size": "train.batch_size",
    "task_sha256": "suite.custom.train_sha256", "model_path": "backbone.path",
}
OPTIONAL = ("task_sha256", "model_path")
"""Fields that only a user's task or model has: left out of an entry (and so never matched) when null."""
COVERS = {"suites": "suite", "methods": "method", "epsilons": "epsilon"}
"""``generated`` key -> entry field: the lists whose product is every cell the file covers."""


def tuned_dir() -> Path:
    """Where tuned-rate files are read from (``PRISM_TUNED_DIR`` or ``conf/tuned``)."""
    return Path(os.environ.get("PRISM_TUNED_DIR") or TUNED_DIR)


@dataclass
class TunedRate:
    """One entry of a tuned-rate file's ``rates:`` (:func:`pipelines.verbs.tune.tuned_yaml` writes it)."""

    method: str = help_field("method.name of the cell")
    suite: str = help_field("suite.name")
    scale: str = help_field("suite.scale")
    epsilon: float = help_field("privacy.epsilon (.inf: non-private)")
    backbone: str = help_field("backbone.name")
    lora_layers: int | None = help_field("backbone.lora_layers")
    steps: int = help_field("train.steps")
    batch_size: int = help_field("train.batch_size")
    lr: float = help_field("the chosen learning rate")
    factor: float | None = help_field("lr / default_lr", None)
    default_lr: float | None = help_field("Table 8 × train.lr_multiplier", None)
    validation_score: float | None = help_field("the chosen rate's validation score (mean over the tuning seeds)", None)
    validation_se: float | None = help_field("its standard error (pipelines.verbs.tune.score_of)", None)
    at_edge: bool | None = help_field("the best rate is an end of the swept grid", None)
    task_sha256: str | None = help_field("a user's task: the training file's identifier (suite.custom.train_sha256, "
                                         "a keyed hash)", None)
    model_path: str | None = help_field("a user's model folder", None)

    def __post_init__(self) -> None:
        require(0 < self.lr < math.inf, f"lr={self.lr} must be a finite number > 0")


@dataclass
class TunedFile:
    """A tuned-rate file: the sweep's record and one :class:`TunedRate` per cell."""

    generated: dict[str, Any] | None = help_field("command, commit, date, tuning seeds, rule and grid of the sweep", None)
    rates: list[Any] = help_field("one entry per cell")


FIX = "fix it or regenerate the file with `make tune`"


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int) -> tuple[dict, ...]:
    """The entries of one file, read through :class:`TunedFile` (one line naming file, line and fix if bad)."""
    del mtime_ns  # part of the cache key only: a rewritten file is read again
    text = Path(path).read_text()
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise ConfigError(f"{path}:{mark.line + 1 if mark else 1}: not valid YAML "
                          f"({getattr(err, 'problem', err)}), {FIX}") from None
    data = yaml.safe_load(text)
    if not isinstance(root, yaml.MappingNode) or not isinstance(data, dict):
        raise ConfigError(f"{path}:1: no `rates:` list, {FIX}")
    lines = {k.value: (k.start_mark.line + 1, v) for k, v in root.value}
    try:
        OmegaConf.merge(OmegaConf.structured(TunedFile), data)
    except ConfigKeyError as err:
        raise ConfigError(f"{path}:{lines[err.key][0]}: unknown key {err.key}, a tuned-rate file has generated and "
                          f"rates; {FIX}") from None
    except ValidationError as err:
        raise ConfigError(f"{path}:{lines[err.key][0]}: {err.key} has the wrong type, {FIX}") from None
    if "rates" not in data or not isinstance(lines["rates"][1], yaml.SequenceNode):
        raise ConfigError(f"{path}:{lines.get('rates', (1,))[0]}: no `rates:` list, {FIX}")
    rates_line, rates_node = lines["rates"]
    entries = [_entry(path, i, node, value) for i, (node, value) in enumerate(zip(rates_node.value, data["rates"]))]
    seen: dict[tuple, int] = {}
    for line, entry in entries:
        cell = tuple(entry.get(k) for k in MATCH)
        if cell in seen:
            raise ConfigError(f"{path}:{line}: a second entry for the cell of line {seen[cell]} "
                              f"({_describe(entry, ('method', 'suite', 'epsilon'))}), keep one; {FIX}")
        seen[cell] = line
    _complete(path, rates_line, [entry for _, entry in entries], _grid(path, lines, data),
              _fix(data.get("generated") or {}))
    return tuple(entry for _, entry in entries)


def _grid(path: str, lines: Mapping[str, tuple[int, yaml.Node]], data: Mapping[str, Any]) -> dict[str, list]:
    """The :data:`COVERS` lists of the file's ``generated`` (one line naming the first one missing or empty)."""
    generated = data.get("generated") or {}
    line = lines.get("generated", (1,))[0]
    grid = {key: generated.get(key) for key in COVERS}
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}:{line}: generated.{key} is {'missing' if values is None else 'not a list'}: the "
                              f"file does not say which {COVERS[key]}s it covers, so a cell left out would run at the "
                              f"default rate; {_fix(generated)}")
    return grid


def _fix(generated: Mapping[str, Any]) -> str:
    """How to rewrite a refused file: its own command, else :data:`FIX`."""
    command = generated.get("command")
    return f"regenerate the file: `{command}` (`make tune`)" if isinstance(command, str) else FIX


def _entry(path: str, index: int, node: yaml.Node, value: Any) -> tuple[int, dict]:
    """(line, fields) of ``rates[index]`` read through :class:`TunedRate`."""
    line = node.start_mark.line + 1
    if not isinstance(node, yaml.MappingNode) or not isinstance(value, dict):
        raise ConfigError(f"{path}:{line}: rates[{index}] must be a mapping of {', '.join(list(MATCH)[:8])} and lr, {FIX}")
    key_lines = {k.value: v.start_mark.line + 1 for k, v in node.value}
    try:
        rate = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TunedRate), value))
    except ConfigKeyError as err:
        raise ConfigError(f"{path}:{key_lines.get(err.key, line)}: unknown key {err.key} in rates[{index}], its keys "
                          f"are {', '.join(f.name for f in dataclasses.fields(TunedRate))}; {FIX}") from None
    except MissingMandatoryValue as err:
        raise ConfigError(f"{path}:{line}: rates[{index}] lacks {err.key}, {FIX}") from None
    except ValidationError as err:
        wanted = TunedRate.__dataclass_fields__[str(err.key)].type
        shown = next((v for k, v in KINDS.items() if k.__name__ in str(wanted)), "of its type")
        raise ConfigError(f"{path}:{key_lines.get(err.key, line)}: rates[{index}].{err.key}={value.get(err.key)!r} "
                          f"must be {shown}, {FIX}") from None
    except ConfigError as err:
        raise ConfigError(f"{path}:{key_lines.get('lr', line)}: rates[{index}].{err}, {FIX}") from None
    return line, {k: v for k, v in dataclasses.asdict(rate).items() if v is not None or k not in OPTIONAL}


def _describe(entry: Mapping[str, Any], keys: tuple[str, ...]) -> str:
    return " ".join(f"{k}={entry[k]:g}" if isinstance(entry[k], float) else f"{k}={entry[k]}" for k in keys)


def _complete(path: str, line: int, entries: list[dict], grid: Mapping[str, list], fix: str) -> None:
    """Every suite of ``grid`` (:func:`_grid`) has entries, and every budget of the file (its fields other than
    method and ε) one for each of the grid's methods × ε: a cell left out would run at the default rate."""
    methods, epsilons = grid["methods"], sorted(grid["epsilons"])
    budgets: dict[tuple, set] = {}
    for e in entries:
        budget = tuple((k, e.get(k)) for k in MATCH if k not in ("method", "epsilon"))
        budgets.setdefault(budget, set()).add((e["method"], e["epsilon"]))
    suites = {dict(budget)["suite"] for budget in budgets}
    missing = [{"method": methods[0], "epsilon": epsilons[0], "suite": s} for s in grid["suites"] if s not in suites]
    missing += [{"method": m, "epsilon": x, **dict(budget)} for budget, cells in budgets.items()
                for x in epsilons for m in methods if (m, x) not in cells]
    if missing:
        where = _describe(missing[0], tuple(k for k in ("method", "epsilon", "suite", "steps", "batch_size")
                                            if k in missing[0]))
        raise ConfigError(f"{path}:{line}: rates has no entry for {where} (the file covers {', '.join(grid['suites'])} "
                          f"× {', '.join(methods)} × ε {', '.join(f'{x:g}' for x in epsilons)}), so that cell would "
                          f"run at the default rate; {fix}")


def user_tuned_dir(results_dir: str | os.PathLike[str]) -> Path:
    """Where ``make tune TASK=...`` writes a user's task's rates: ``<results_dir>/tuned``."""
    return Path(results_dir) / "tuned"


def cell_fields(cfg: DictConfig) -> dict[str, Any]:
    """The :data:`MATCH` fields of a config (what a tuned entry is keyed by), the :data:`OPTIONAL` ones
    only when set."""
    fields = {name: OmegaConf.select(cfg, dotted, default=None) for name, dotted in MATCH.items()}
    return {k: v for k, v in fields.items() if k not in OPTIONAL or v is not None}


def lookup(cfg: DictConfig) -> tuple[dict[str, Any], Path] | None:
    """The tuned entry of ``cfg``'s cell and its file (:func:`tuned_dir` or the run's :func:`user_tuned_dir`),
    or None; two files with the cell are an error. A paper-suite run (no OPTIONAL fields) matches no user entry."""
    fields = cell_fields(cfg)  # an OPTIONAL field left out is null: it matches only an entry without it
    results = OmegaConf.select(cfg, "results_dir", default=None)
    folders = (tuned_dir(), *([user_tuned_dir(str(results))] if results else []))
    files = [path for f in folders for path in sorted(f.glob("*.yaml"))]
    found = [(e, path) for path in files for e in _load(str(path), path.stat().st_mtime_ns)
             if all(e.get(k) == fields.get(k) for k in MATCH)]
    if len(found) > 1:
        raise ConfigError(f"tuned rates for the same cell in {', '.join(str(p) for _, p in found)}: keep one "
                         f"(rerun `make tune` for that scale, or delete the stale file)")
    return found[0] if found else None


def lr_source(cfg: DictConfig) -> dict[str, Any] | None:
    """What ``train.lr_source`` records when ``cfg`` is composed (:class:`~pipelines.config.schema.LrSource`):
    the tuned-rate file whose entry set ``method.lr`` (relative to the repository when inside it), the sha256 of
    that entry's canonical JSON and the seeds the file's rates were chosen on (:func:`tuning_seeds`); None when
    no tuned entry set the rate (the default rate, a sweep's ``tune.lr_factor`` multiple of it, a typed
    ``method.lr=``). Readers take it from the run's stored config (:func:`recorded_lr_source`), so a later
    ``make tune`` never changes what an earlier run claims."""
    if OmegaConf.select(cfg, "tune.lr_factor", default=None) is not None:
        return None
    hit = lookup(cfg)
    lr = OmegaConf.select(cfg, "method.lr", default=None)
    if hit is None or not isinstance(lr, (int, float)) or not math.isclose(float(hit[0]["lr"]), lr, rel_tol=1e-9):
        return None
    entry, path = hit
    file = path.resolve()
    return {"file": str(file.relative_to(REPO) if file.is_relative_to(REPO) else file),
            "entry_sha256": hashlib.sha256(canonical(entry).encode()).hexdigest(), "seeds": tuning_seeds(path)}


def lr_source_recorded(config: Mapping[str, Any] | DictConfig) -> bool:
    """Whether a run's stored config has ``train.lr_source`` (a run stored before it was recorded has not: its
    rate's provenance is not recorded, and is never looked up again in today's tuned files)."""
    train = config.get("train")
    return isinstance(train, (Mapping, DictConfig)) and "lr_source" in train


def recorded_lr_source(config: Mapping[str, Any] | DictConfig) -> LrSource | None:
    """The tuned-rate file and entry a run's stored config records as its rate's source, None when it records
    none (or nothing: :func:`lr_source_recorded`)."""
    node = config.get("train", {}).get("lr_source") if lr_source_recorded(config) else None
    if node is None:
        return None
    plain = OmegaConf.to_container(node) if isinstance(node, DictConfig) else dict(node)
    return LrSource(str(plain["file"]), str(plain["entry_sha256"]), [int(s) for s in plain.get("seeds") or []])


def tuning_seeds(path: Path) -> list[int]:
    """The seeds a tuned-rate file's rates were chosen on: its ``generated.seeds``, or for a file written
    before the list was recorded its one ``generated.seed`` (``conf/tuned/embedded.yaml``: [42])."""
    generated = (yaml.safe_load(path.read_text()) or {}).get("generated") or {}
    seeds = generated.get("seeds", [generated["seed"]] if "seed" in generated else [])
    return sorted(int(s) for s in seeds)


def seed_overlap_line(cfgs: Sequence[DictConfig]) -> str:
    """The one line a table grid (its jobs' configs) prints when its seeds include a seed its tuned rates
    were chosen on ('' if none)."""
    tuned_on = sorted({s for cfg in cfgs if (source := recorded_lr_source(cfg)) is not None for s in source.seeds})
    table = sorted({int(cfg.seed) for cfg in cfgs})
    shared = sorted(set(tuned_on) & set(table))
    if not shared:
        return ""
    return (f"WARNING: the rates were tuned on seeds {tuned_on}, which overlap the table's seeds {table} at "
            f"{shared}: those runs score the seed their rate was chosen on; "
            "retune with `make tune SEEDS=<seeds outside the table's>`")


TUNING_COST = ("ε covers one training run per cell, not the rate tuning: {n} private run(s) here use rates "
               "`make tune` chose after one DP run per candidate rate (5 or more) on the same training rows, "
               "by un-noised validation scores (docs/PRIVACY.md, \"What ε does not cover\").")
"""The one line every table, CSV and figure built from tuned private runs carries (``{n}``: their count)."""


def method_lr(default: float, *, _root_: DictConfig) -> float:
    """Resolver ``${method_lr:<default rate>}`` (see the module docstring)."""
    factor = OmegaConf.select(_root_, "tune.lr_factor", default=None)
    if factor is not None:
        return float(f"{float(default) * float(factor):.6g}")
    hit = lookup(_root_)
    return float(hit[0]["lr"]) if hit else float(default)
