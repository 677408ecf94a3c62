"""Compose run configs and expand an experiment's sweep grid into a job list (a library: no command).

A *job* is a list of Hydra override strings (``python -m pipelines run <job...>`` runs one); :func:`compose_job` turns one into its resolved config (not
yet validated: :mod:`pipelines.config.validate`), or one :class:`ConfigError` line for an override that does not
parse or compose. A grid composes each group choice once with Hydra (cached) and applies each job's
value overrides to it as Hydra does; a value override of a key the composition lacks is added, so the
schema (:mod:`pipelines.config.schema`) names it as unknown with the key it resembles. The grid
of ``experiment=tableN`` is the cartesian product of its ``hydra.sweeper.params`` with the user's
overrides, expanded the way Hydra's basic sweeper does (a user override of a swept key replaces
the sweep; a user sweep ``key=a,b`` adds an axis), so the local dispatcher
(:mod:`pipelines.runs.launch`), Hydra multirun and the SLURM array scripts run the same jobs.
"""
from __future__ import annotations

import functools
import itertools
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipelines.config.schema import ConfigError, conform
from pipelines.config.tuned_rates import lr_source, method_lr

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
RECORDED = "lr_source"  # train.lr_source: written by resolve(), never typed


def by_family(family: str, table: Mapping[str, Any], multiplier: float = 1.0) -> float:
    """Resolver ``${by_family:${suite.family},{glue: 2e-4, math: 3e-4},${train.lr_multiplier}}``: Table 8's
    rate of the suite family times the scale's multiplier (1 at paper scale, more for embedded's short runs)."""
    if family not in table:
        raise ValueError(f"no learning rate for suite family {family!r}; the method yaml lists {sorted(table)}")
    return float(f"{float(table[family]) * float(multiplier):.12g}")  # no 0.0029999999999999996 in configs


COMPOSE_ERRORS = (HydraException, OmegaConfBaseException, ValueError)  # what bad overrides raise


def error_line(err: BaseException) -> str:
    """Hydra's message about overrides that do not compose, on one line (no config search path)."""
    return " ".join(str(err).split("Config search path:")[0].split()) or type(err).__name__


OmegaConf.register_new_resolver("by_family", by_family, replace=True)
OmegaConf.register_new_resolver("method_lr", method_lr, replace=True)  # tuned rates (pipelines/config/tuned_rates.py)


def compose_config(overrides: Sequence[str], with_hydra: bool = False) -> DictConfig:
    """Compose ``conf/config.yaml`` with ``overrides`` (Hydra's compose API; struct mode on)."""
    if not GlobalHydra.instance().is_initialized():  # initialised once per process (cheap repeats)
        initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="prism")
    return compose(config_name="config", overrides=list(overrides), return_hydra_config=with_hydra)


def resolve(cfg: DictConfig) -> DictConfig:
    """The resolved job config the core reads (no ``hydra`` node, no interpolations, struct mode;
    a leading ``~`` in ``results_dir`` and ``logging.dir`` expanded, as a shell would unquoted), with the
    provenance of its learning rate in ``train.lr_source`` where conf/config.yaml declares the key
    (:func:`pipelines.config.tuned_rates.lr_source`)."""
    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    plain.pop("hydra", None)
    for node, key in ((plain, "results_dir"), (plain.get("logging"), "dir")):  # not hashed: no machine's home
        if isinstance(node, dict) and isinstance(node.get(key), str) and node[key].startswith("~"):
            node[key] = os.path.expanduser(node[key])  # a leading ~ is the home folder, also when quoted
    resolved = OmegaConf.create(plain)
    if isinstance(plain.get("train"), dict) and RECORDED in plain["train"]:
        resolved.train.lr_source = lr_source(resolved)
    OmegaConf.set_struct(resolved, True)
    return resolved


def sweep_jobs(overrides: Sequence[str], head: Sequence[str] = ()) -> list[list[str]]:
    """Every job of a grid: ``head`` and the cartesian product of ``[*head, *overrides]``'s
    ``hydra.sweeper.params`` and ``overrides`` (later keys win, as in Hydra)."""
    parser = OverridesParser.create()
    refuse_path_sweeps(parse(overrides))
    fixed = [*head, *(o for o in overrides if not parser.parse_override(o).is_sweep_override())]
    params = compose_config(fixed, with_hydra=True).hydra.sweeper.params or {}
    axes: dict[str, list[str]] = {}
    for override in parser.parse_overrides([f"{k}={v}" for k, v in params.items()] + list(overrides)):
        key = override.get_key_element()
        values = override.sweep_string_iterator() if override.is_sweep_override() else [override.get_value_element_as_str()]
        axes[key] = [f"{key}={value}" for value in values]
    return [[*head, *job] for job in itertools.product(*axes.values())]


REFERENCE_JOBS = {"table2": ("method=adamw", "privacy=nondp", "train.steps=0")}
"""Per experiment, the overrides of its reference jobs: Table 2's 0-step model (LoRA's B = 0, so the backbone
untrained; one run per suite and seed, evaluation only), the row the private rows are gated against
(docs/comparison.md, "The 0-step model and the gates")."""


def experiment_jobs(experiment: str, overrides: Sequence[str] = ()) -> list[list[str]]:
    """Every job of ``experiment``'s grid: ``[experiment=tableN, *overrides, *sweep choices]``, then its
    :data:`REFERENCE_JOBS`: each job with the reference's keys replaced by its overrides, once per distinct result (one
    per suite and seed of the grid)."""
    jobs = sweep_jobs(overrides, [f"experiment={experiment}"])
    fixed = REFERENCE_JOBS.get(experiment, ())
    keys = {o.split("=", 1)[0] for o in fixed}
    reference = {tuple(o for o in job if o.split("=", 1)[0] not in keys) + fixed: None for job in jobs} if fixed else {}
    return jobs + [list(job) for job in reference]


def job_config(job: Sequence[str]) -> DictConfig:
    """The resolved config of one job (Hydra's composition of the whole command line)."""
    return resolve(compose_config(job))


LOCKED = {  # key -> the group whose choice sets it
    "suite.name": "suite", "suite.family": "suite", "suite.scale": "scale",
    "method.name": "method", "backbone.name": "backbone", "backbone.paper_name": "backbone",
}
PATH_KEYS = ("results_dir", "logging.dir", "backbone.path", "suite.custom.train", "suite.custom.eval")
"""Keys whose value is one path: never a sweep (Hydra would split a path with a ',' into several runs' folders)."""
QUOTING = ("quote the value for Hydra inside one shell word, e.g. 'results_dir=\"/tmp/my runs\"' "
           "(with make: ARGS=\"'results_dir=\\\"/tmp/my runs\\\"'\")")


def compose_job(overrides: Sequence[str]) -> DictConfig:
    """The resolved, not yet validated config of ``python -m pipelines run <overrides>``; raises
    :class:`ConfigError` (one line) for a sweep, a removed group or key, a key that contradicts its group,
    or overrides that do not parse, compose or resolve."""
    parsed = parse(overrides)
    refuse_path_sweeps(parsed)
    for override in parsed:
        key = override.key_or_group
        if not key:
            raise ConfigError("an override has no key, write key=value, e.g. train.steps=10")
        if override.is_sweep_override():
            raise _sweep_error(override, overrides)
        if _is_group(override) and override.is_delete():
            raise ConfigError(f"~{key} removes a config group the run needs, choose one of its options instead "
                              f"({key}=...)")
        if override.is_delete():
            raise ConfigError(f"~{key} deletes a key the run reads, set {key}=<value> (or null where allowed) instead")
        if key.split(".")[:2] == ["train", RECORDED]:
            raise ConfigError(f"{override.input_line}: train.{RECORDED} records which tuned entry set method.lr, "
                              "it is not typed; leave it out (method.lr=<rate> sets a rate)")
    groups = tuple(o.input_line for o in parsed if _is_group(o))
    values = [o for o in parsed if not _is_group(o)]
    for override in values:
        key = override.key_or_group
        known = OmegaConf.select(_composed(groups), key, default=None, throw_on_missing=False)
        if key in LOCKED and known is not None and override.value() != known:
            group = LOCKED[key]
            raise ConfigError(f"{key}={override.value()} contradicts the {group} group, which sets {key}={known}; "
                              f"choose the group instead ({group}=...) and leave {key} alone")
    return _resolve(_compose_values(groups, values, overrides), overrides)


def _sweep_error(sweep: Override, overrides: Sequence[str]) -> ConfigError:
    """The error of a comma list given without ``-m``: the schema's "unknown key, did you mean" when the
    key itself is wrong (``methd=prism,adamw``: ``-m`` would not help), else the hint to add ``-m``."""
    key = sweep.key_or_group
    first = next(iter(sweep.sweep_string_iterator()), None)
    if first is not None:
        one_job = [f"{sweep.get_key_element()}={first}" if o == sweep.input_line else o for o in overrides]
        try:
            conform(compose_job(one_job))
        except ConfigError as err:
            if str(err).startswith(f"unknown key {key},"):
                return err
    return ConfigError(f"{sweep.input_line} is a sweep, add -m to run one job per value "
                       f"(or write {key}=[a,b] for a list value)")


def hydra_value(text: str) -> str:
    """``text`` as the value of an override that Hydra reads back as exactly ``text`` (a path a command built
    from what the user typed): as it is when Hydra takes it whole, else in double quotes, with backslashes
    before a quote or the end doubled and quotes escaped."""
    try:
        if OverridesParser.create().parse_override(f"k={text}").value() == text:
            return text
    except HydraException:
        pass
    body = re.sub(r'(\\*)("|$)', lambda m: m.group(1) * 2 + ("\\" + m.group(2) if m.group(2) else ""), text)
    return f'"{body}"'


def refuse_path_sweeps(parsed: Sequence[Override]) -> None:
    """One :class:`ConfigError` line for a :data:`PATH_KEYS` value that Hydra reads as a sweep (a ',' in the
    path), with the quoting that keeps it one path."""
    for override in parsed:
        if override.key_or_group in PATH_KEYS and override.is_sweep_override():
            key, _, value = override.input_line.partition("=")
            raise ConfigError(f"{override.input_line}: Hydra splits this path at ',' into "
                              f"{len(list(override.sweep_string_iterator()))} folders; a path is one value: "
                              f"quote it for Hydra inside one shell word, e.g. '{key}=\"{value}\"'")


def parse(overrides: Sequence[str]) -> list[Override]:
    """Hydra's parse of ``overrides``; one :class:`ConfigError` line (with the quoting that works) if not."""
    for arg in overrides:
        if arg.startswith("-"):
            raise ConfigError(f"unknown option {arg}, write overrides as key=value (--help: the usage)")
    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as err:
        lines = str(err).splitlines()
        detail = f" ({lines[1].split(' expecting ')[0].strip()})" if len(lines) > 1 else ""
        bad = next((o for o in overrides if not _parses(o)), None)  # the first that does not parse alone
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


def _parses(override: str) -> bool:
    """Whether Hydra parses ``override`` on its own."""
    try:
        OverridesParser.create().parse_override(override)
    except HydraException:
        return False
    return True


@functools.lru_cache(maxsize=64)
def _composed(groups: tuple[str, ...]) -> DictConfig:
    """The unresolved composition of these group choices alone (read-only; cached)."""
    cfg = _compose(groups)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _compose_values(groups: tuple[str, ...], values: Sequence[Override], overrides: Sequence[str]) -> DictConfig:
    """The job's composition: the groups' (cached) composition with the value overrides applied the way
    Hydra applies them after the defaults list (a ``key=value`` of an absent key is added, for the
    schema to name). Hydra's own keys (``hydra.*``) take Hydra's full composition."""
    if any(o.key_or_group.startswith("hydra") for o in values):
        return _compose(overrides)
    cfg = OmegaConf.create(OmegaConf.to_container(_composed(groups), resolve=False))
    OmegaConf.set_struct(cfg, True)
    try:
        for override in values:
            _apply_value(override, cfg)
    except (OmegaConfBaseException, ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"the overrides {' '.join(overrides)} do not compose ({one_line(err)}), "
                          "check them against `python -m pipelines run --cfg job`") from None
    return cfg


def _apply_value(override: Override, cfg: DictConfig) -> None:
    """One value override applied as Hydra applies it after the defaults list, with OmegaConf's public
    ``update`` (merging a mapping into a mapping): ``key=v`` and ``++key=v`` set ``key`` or add it,
    ``+key=v`` adds it only where it has no value (or merges a mapping or list)."""
    key, value = override.key_or_group, override.value()
    if override.package is not None:
        raise ValueError(f"{override.input_line} looks like a config group override, but config group "
                         f"'{key}' does not exist")
    present = OmegaConf.select(cfg, key, throw_on_missing=False) is not None
    if override.is_add() and present and not isinstance(value, (dict, list)):
        raise ValueError(f"{override.input_line} adds {key}, which already has a value; write "
                         f"{override.input_line[1:]} to set it")
    OmegaConf.update(cfg, key, value, merge=True, force_add=True)


@functools.cache
def config_groups() -> frozenset[str]:
    """Every config group under ``conf/`` (``backbone``, ``method``, ...)."""
    return frozenset(str(p.relative_to(CONF_DIR)) for p in CONF_DIR.rglob("*") if p.is_dir())


def _is_group(override: Override) -> bool:
    key = override.key_or_group
    return key in config_groups() or key.startswith("hydra/")


def _compose(overrides: Sequence[str]) -> DictConfig:
    try:
        return compose_config(overrides)
    except MissingConfigException as err:
        missing = str(getattr(err, "missing_cfg_file", "") or "")
        group, _, option = missing.rpartition("/")
        options = getattr(err, "options", None)
        if group and options:
            raise ConfigError(f"{group}={option} is not an option of {group}, choose one of: "
                              f"{', '.join(options)}") from None
        raise ConfigError(f"{one_line(err)}, check the group names in conf/") from None
    except (HydraException, OmegaConfBaseException, ValueError, AttributeError, TypeError, KeyError) as err:
        raise ConfigError(f"the overrides {' '.join(overrides)} do not compose ({one_line(err)}), "
                          "check them against `python -m pipelines run --cfg job`") from None


def _resolve(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    try:
        return resolve(cfg)
    except OmegaConfBaseException as err:
        cause = err.__cause__ or err.__context__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:  # a tuned-rate file the method_lr resolver refused
            raise ConfigError(str(cause)) from None
        key = getattr(err, "full_key", None) or "a key"
        raise ConfigError(f"{key} cannot be resolved ({one_line(err)}), give it a value "
                          f"(overrides: {' '.join(overrides) or 'none'})") from None
    except ValueError as err:  # a resolver's own error (by_family)
        raise ConfigError(f"{one_line(err)}, check the overrides {' '.join(overrides)}") from None


def one_line(err: BaseException) -> str:
    """The first two lines of an error's message, joined (its type's name if it has none)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return "; ".join(lines[:2]) or type(err).__name__
