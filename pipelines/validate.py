"""One validation pass over a job's whole config, before any model load, W&B init or run folder.

:func:`load_job` turns command-line overrides into the resolved config the core reads, or raises a
:class:`ConfigError` whose message is one line, ``<what>, <how to fix>``, naming the field:

1. Hydra's own failures (bad override syntax, unknown group option, unknown key) become one line.
2. Keys are checked against the *reference*: the config composed from the same group choices
   without any value override. A key it lacks is unknown, also when added with ``+`` or ``++``
   (a typo such as ``+train.stpes=5`` would otherwise be stored and ignored); a key it has may not
   be deleted. Because the reference is composed from ``conf/``, keys added there are known at once.
3. Types follow the reference: an int stays an int (``train.steps=2.5`` is an error), an int given
   for a float is converted (``method.lr=1`` means 1.0), ``null`` only where a shipped yaml has it.
   Keys that restate a group choice (``suite.scale`` for ``scale=``) may not contradict it.
4. :func:`pipelines.config_rules.validate`: ranges and cross-field rules (privacy name vs ε, LoRA
   rank vs the narrowest targeted layer, batch vs training-set size, micro-batch ≤ batch, device
   present, room for the label after ``suite.cutoff_len``, paper-scale data present), the method
   node against the method's own schema (:mod:`prism.methods.schema`) and whether σ can be
   calibrated for (ε, δ, q, T) within this machine's memory (:mod:`prism.privacy.limits`).

:func:`load_grid` / :func:`load_experiment` run the same validation over every job of a grid
before any is launched (``python -m pipelines grid``, ``... reproduce``, ``slurm/submit.sh``,
``... run -m``); the first bad job is one line naming the job and the field. A grid composes
each group choice once with Hydra and applies each job's value overrides to it as Hydra does.

Nothing here imports torch or transformers, so a bad input is reported in about a second.
"""
from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipelines.compose import CONF_DIR, compose_config, resolve
from pipelines.config_rules import ConfigError, validate

__all__ = ["ConfigError", "conform", "load_experiment", "load_grid", "load_job", "load_sweep", "validate"]

MISSING = object()
LOCKED = {  # key -> the group whose choice sets it
    "suite.name": "suite", "suite.family": "suite", "suite.scale": "scale",
    "method.name": "method", "backbone.name": "backbone", "backbone.paper_name": "backbone",
}


# --------------------------------------------------------------------------------------- composing
def load_job(overrides: Sequence[str], *, here: bool = True) -> DictConfig:
    """The validated, resolved job config of ``python -m pipelines run <overrides>``. ``here=False``
    for a job that runs on another machine (a SLURM array task): the local device is not checked."""
    parsed = _parse(overrides)
    for override in parsed:
        if override.is_sweep_override():
            raise ConfigError(f"{override.input_line} is a sweep, add -m to run one job per value "
                              f"(or write {override.key_or_group}=[a,b] for a list value)")
        if _is_group(override) and override.is_delete():
            raise ConfigError(f"~{override.key_or_group} removes a config group the run needs, "
                              f"choose one of its options instead ({override.key_or_group}=...)")
    groups = tuple(o.input_line for o in parsed if _is_group(o))
    reference = _reference(groups)
    values = [o for o in parsed if not _is_group(o)]
    for override in values:
        if not override.key_or_group.startswith("hydra"):
            _check_override(override, reference)
    cfg = conform(_resolve(_compose_values(groups, values, overrides), overrides), reference)
    validate(cfg, here=here)
    return cfg


def load_grid(jobs: Sequence[Sequence[str]], *, here: bool | None = None) -> list[DictConfig]:
    """Every job of a grid validated as :func:`load_job` does, before any of them is launched.

    Stops at the first bad job with one :class:`ConfigError` line naming the job and the field.
    ``here=None``: a job with ``launcher=slurm`` runs elsewhere (its device is not checked here)."""
    configs = []
    for k, job in enumerate(jobs, 1):
        try:
            configs.append(load_job(job, here=_runs_here(job) if here is None else here))
        except ConfigError as err:
            raise ConfigError(f"job {k} of {len(jobs)} ({' '.join(job)}): {err}") from None
        except Exception as err:  # a rule that itself failed on an odd value: still one line
            raise ConfigError(f"job {k} of {len(jobs)} ({' '.join(job)}) could not be validated "
                              f"({type(err).__name__}: {_one_line(err)}), check its overrides") from None
    return configs


def load_experiment(experiment: str, overrides: Sequence[str], *,
                    here: bool | None = None) -> list[tuple[list[str], DictConfig]]:
    """The jobs of ``experiment``'s grid (:func:`pipelines.compose.experiment_jobs`) with their
    validated configs; a bad override or job is one :class:`ConfigError` line."""
    from pipelines.compose import experiment_jobs

    parsed = _parse(overrides)
    try:
        jobs = experiment_jobs(experiment, overrides)
    except Exception:  # the grid does not compose: the one-line reason of its fixed part
        load_job([f"experiment={experiment}", *(o.input_line for o in parsed if not o.is_sweep_override())],
                 here=False)
        raise
    return list(zip(jobs, load_grid(jobs, here=here), strict=True))


def _runs_here(job: Sequence[str]) -> bool:
    return not any(o.split("=", 1)[0].lstrip("+") == "launcher" and o.split("=", 1)[1] == "slurm"
                   for o in job if "=" in o)


def load_sweep(overrides: Sequence[str]) -> list[DictConfig]:
    """Every job of ``python -m pipelines run -m <overrides>`` validated (the experiment's
    ``hydra.sweeper.params`` expanded with the overrides, as Hydra's basic sweeper does)."""
    from pipelines.compose import expand

    parsed = _parse(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    try:
        params = compose_config(fixed, with_hydra=True).hydra.sweeper.params or {}
    except Exception:  # the same composition again, for its one-line error
        load_job(fixed, here=False)
        raise
    return load_grid(expand({str(k): str(v) for k, v in params.items()}, list(overrides)))


QUOTING = ("quote the value for Hydra inside one shell word, e.g. 'results_dir=\"/tmp/my runs\"' "
           "(with make: ARGS=\"'results_dir=\\\"/tmp/my runs\\\"'\")")


def _parse(overrides: Sequence[str]) -> list[Override]:
    for arg in overrides:
        if arg.startswith("-"):
            raise ConfigError(f"unknown option {arg}, write overrides as key=value (--help: the usage)")
    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as err:
        lines = str(err).splitlines()
        detail = f" ({lines[1].split(' expecting ')[0].strip()})" if len(lines) > 1 else ""
        bad = next((o for o in overrides if o in lines[0]), None)
        if bad is None:
            found = re.search(r"'(.*)'", lines[0])
            bad = found.group(1) if found else lines[0]
        if "=" not in bad:  # a word of its own: often the rest of a value with a space in it
            raise ConfigError(f"the override {bad!r} has no '=', write key=value; if it is the rest of a value "
                              f"with a space in it, {QUOTING}") from None
        if not bad.isascii() or any(ch.isspace() for ch in bad):
            raise ConfigError(f"cannot parse the override {bad!r}: a value with spaces or non-ASCII characters "
                              f"must be quoted, {QUOTING}") from None
        raise ConfigError(f"cannot parse the override {bad!r}{detail}, write key=value, e.g. train.steps=10 or "
                          f"method=adamw; {QUOTING} if the value has special characters") from None


@functools.lru_cache(maxsize=64)
def _composed(groups: tuple[str, ...]) -> DictConfig:
    """The unresolved composition of these group choices alone (read-only; cached)."""
    cfg = _compose(groups)
    OmegaConf.set_readonly(cfg, True)
    return cfg


@functools.lru_cache(maxsize=64)
def _reference(groups: tuple[str, ...]) -> DictConfig:
    """The config of these group choices with no value override (read-only; cached)."""
    reference = _resolve(_composed(groups), groups)
    OmegaConf.set_readonly(reference, True)
    return reference


def _compose_values(groups: tuple[str, ...], values: Sequence[Override], overrides: Sequence[str]) -> DictConfig:
    """The job's composition: the groups' (cached) composition with the value overrides applied
    the way Hydra applies them after the defaults list, so a grid composes each group choice once.
    Hydra's own keys (``hydra.*``) take Hydra's full composition."""
    if any(o.key_or_group.startswith("hydra") for o in values):
        return _compose(overrides)
    cfg = OmegaConf.create(OmegaConf.to_container(_composed(groups), resolve=False))
    OmegaConf.set_struct(cfg, True)
    try:
        ConfigLoaderImpl._apply_overrides_to_config(list(values), cfg)
    except (HydraException, OmegaConfBaseException, ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"the overrides {' '.join(overrides)} do not compose ({_one_line(err)}), "
                          "check them against `python -m pipelines run --cfg job`") from None
    return cfg


@functools.cache
def config_groups() -> frozenset[str]:
    """Every config group under ``conf/`` (``backbone``, ``method``, ...)."""
    return frozenset(str(p.relative_to(CONF_DIR)) for p in CONF_DIR.rglob("*") if p.is_dir())


def _is_group(override: Override) -> bool:
    key = override.key_or_group
    return key in config_groups() or key.startswith("hydra/")


def _compose(overrides: Sequence[str]) -> DictConfig:
    try:
        return compose_config(list(overrides))
    except MissingConfigException as err:
        missing = str(getattr(err, "missing_cfg_file", "") or "")
        group, _, option = missing.rpartition("/")
        options = getattr(err, "options", None)
        if group and options:
            raise ConfigError(f"{group}={option} is not an option of {group}, choose one of: "
                              f"{', '.join(options)}") from None
        raise ConfigError(f"{_one_line(err)}, check the group names in conf/") from None
    except (HydraException, OmegaConfBaseException, ValueError, AttributeError, TypeError, KeyError) as err:
        raise ConfigError(f"the overrides {' '.join(overrides)} do not compose ({_one_line(err)}), "
                          "check them against `python -m pipelines run --cfg job`") from None


def _resolve(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    try:
        return resolve(cfg)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "a key"
        raise ConfigError(f"{key} cannot be resolved ({_one_line(err)}), give it a value "
                          f"(overrides: {' '.join(overrides) or 'none'})") from None
    except ValueError as err:  # a resolver's own error (by_family)
        raise ConfigError(f"{_one_line(err)}, check the overrides {' '.join(overrides)}") from None


def _one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return "; ".join(lines[:2]) or type(err).__name__


# ------------------------------------------------------------------------------------------- keys
def _lookup(node: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return MISSING
        node = node[part]
    return node


def _unknown(key: str, reference: Mapping) -> ConfigError:
    if not key:
        return ConfigError("an override has no key, write key=value, e.g. train.steps=10")
    parent, _, leaf = key.rpartition(".")
    plain = OmegaConf.to_container(reference) if isinstance(reference, DictConfig) else reference
    elsewhere = [path for path, _ in _leaves(plain, "") if path.rpartition(".")[2] == leaf]
    if elsewhere:
        return ConfigError(f"unknown key {key}, did you mean {' or '.join(sorted(elsewhere)[:3])}?")
    siblings = _lookup(reference, parent) if parent else reference
    if not isinstance(siblings, Mapping):
        return ConfigError(f"unknown key {key} ({parent} is a value, not a section), "
                           f"set {parent}=<value> instead")
    names = sorted(str(k) for k in siblings)
    close = difflib.get_close_matches(leaf, names, n=1)
    hint = f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close else "check the spelling"
    return ConfigError(f"unknown key {key}, {hint} (keys of {parent or 'the config'}: {', '.join(names)})")


def _check_override(override: Override, reference: DictConfig) -> None:
    key = override.key_or_group
    known = _lookup(reference, key)
    if override.is_delete():
        if known is MISSING:
            raise _unknown(key, reference)
        raise ConfigError(f"~{key} deletes a key the run reads, set {key}=<value> (or null where allowed) instead")
    if known is MISSING:
        raise _unknown(key, reference)
    value = override.value()
    if key in LOCKED and value != known:
        raise _locked(key, value, known)
    if isinstance(known, Mapping) and not isinstance(value, Mapping) \
            and type(value).__name__ not in shipped_types().get(key, frozenset()):  # e.g. train_per_task: count or map
        raise ConfigError(f"{key} is a section, not a value, set one of its keys instead "
                          f"(e.g. {key}.{next(iter(known), 'key')}=...)")


@functools.cache
def shipped_types() -> dict[str, frozenset[str]]:
    """Dotted key → the value types it takes in any shipped yaml under ``conf/`` (``NoneType`` for
    ``null``; interpolations count as ``str``). Decides where ``null`` is allowed."""
    types: dict[str, set[str]] = {}
    for path in [CONF_DIR / "config.yaml", *sorted(CONF_DIR.glob("*/**/*.yaml"))]:
        group = path.parent.relative_to(CONF_DIR).as_posix().replace("/", ".") if path.parent != CONF_DIR else ""
        header = re.search(r"^# @package (\S+)", path.read_text(), re.M)
        package = (header.group(1) if header else group).replace("_global_", "").strip(".")
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        if isinstance(raw, dict):
            raw.pop("defaults", None)
            raw.pop("hydra", None)
            for key, value in _leaves(raw, package):
                types.setdefault(key, set()).add(type(value).__name__)
    return {k: frozenset(v) for k, v in types.items()}


def _leaves(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        if prefix:
            yield prefix, node
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, node


def _locked(key: str, value: Any, reference: Any) -> ConfigError:
    group = LOCKED[key]
    return ConfigError(f"{key}={value} contradicts the {group} group, which sets {key}={reference}; "
                       f"choose the group instead ({group}=...) and leave {key} alone")


def conform(cfg: DictConfig, reference: DictConfig) -> DictConfig:
    """``cfg`` checked key by key against ``reference`` (same group choices, no value overrides):
    unknown or missing keys and wrong types are errors; an int where the reference has a float
    becomes a float. Returns the converted config."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    ref = OmegaConf.to_container(reference, resolve=True)
    _conform_node(plain, ref, "", ref)
    for key in LOCKED:
        mine, theirs = _lookup(plain, key), _lookup(ref, key)
        if theirs is not MISSING and mine != theirs:
            raise _locked(key, mine, theirs)
    out = OmegaConf.create(plain)
    OmegaConf.set_struct(out, True)
    return out


def _conform_node(node: dict, ref: dict, prefix: str, root: dict) -> None:
    for key in ref:
        if key not in node:
            raise ConfigError(f"{prefix}{key} is missing, restore it (it is in the composed defaults)")
    for key, value in list(node.items()):
        if key not in ref:
            raise _unknown(f"{prefix}{key}", root)
        node[key] = _conform_value(f"{prefix}{key}", value, ref[key], root)


def _conform_value(path: str, value: Any, ref: Any, root: dict) -> Any:
    nullable = "NoneType" in shipped_types().get(path, frozenset())
    if value is None:
        if ref is None or nullable:
            return None
        raise ConfigError(f"{path} may not be null, give it a value like {ref!r}")
    if ref is None:
        return _conform_open(path, value)
    if isinstance(ref, dict):
        if not isinstance(value, dict):
            if type(value).__name__ in shipped_types().get(path, frozenset()):  # a count or a mapping
                return value
            raise ConfigError(f"{path} must be a section with keys {', '.join(map(str, ref))}, got {value!r}")
        _conform_node(value, ref, f"{path}.", root)
        return value
    if isinstance(value, dict) and "dict" in shipped_types().get(path, frozenset()):  # a count or a mapping
        return value  # (suite.embedded.train_per_task); config_rules checks the mapping's entries
    if isinstance(ref, list):
        if not isinstance(value, list):
            raise ConfigError(f"{path} must be a list like {ref}, got {value!r}; write {path}=[a,b]")
        kinds = {type(v) for v in ref}
        if len(kinds) == 1 and not all(isinstance(v, tuple(kinds)) for v in value):
            raise ConfigError(f"{path} must list {next(iter(kinds)).__name__} values like {ref}, got {value!r}")
        return value
    return _conform_scalar(path, value, ref)


def _conform_scalar(path: str, value: Any, ref: Any) -> Any:
    if isinstance(ref, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{path} must be true or false, got {value!r}")
    elif isinstance(ref, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} must be an integer, got {value!r}; write e.g. {path}={ref}")
    elif isinstance(ref, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} must be a number, got {value!r}; write e.g. {path}={ref}")
        return float(value)
    elif isinstance(ref, str) and not isinstance(value, str):
        raise ConfigError(f"{path} must be a string, got {value!r}; write e.g. {path}={ref}")
    return value


def _conform_open(path: str, value: Any) -> Any:
    """A key that is ``null`` in the reference: its type comes from the shipped yamls."""
    kinds = shipped_types().get(path, frozenset()) - {"NoneType", "str"}
    if isinstance(value, dict):
        if kinds and "dict" not in kinds:
            raise ConfigError(f"{path} must be a {'/'.join(sorted(kinds))} or null, got {value!r}")
        for key, item in value.items():
            sub = f"{path}.{key}"
            if kinds and sub not in shipped_types():
                known = sorted(k.rpartition(".")[2] for k in shipped_types() if k.startswith(path + "."))
                raise ConfigError(f"unknown key {sub}, {path} takes {', '.join(known)}")
            value[key] = _conform_open(sub, item)
        return value
    if "int" in kinds and "float" not in kinds and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{path} must be an integer or null, got {value!r}")
    if "float" in kinds and not isinstance(value, bool) and isinstance(value, int):
        return float(value)
    if "float" in kinds and (isinstance(value, bool) or not isinstance(value, float)):
        raise ConfigError(f"{path} must be a number or null, got {value!r}")
    return value
