"""The schema of a job config: Hydra's registration of the job's dataclasses and the wording of their
errors (Hydra Structured Configs, docs/DECISIONS.md D79).

The dataclasses themselves, one per config group, are the typed job that ``prism`` reads: :mod:`prism.job`
(the suite node's in :mod:`prism.data.config`, the method's in :mod:`prism.methods.schema`). :func:`conform`
merges a resolved job config into :class:`~prism.job.JobConfig` in struct mode (an unknown key, a wrong
type or a ``null`` where none is allowed is refused; an int given for a float becomes that float), builds
the dataclasses (running every ``__post_init__``; the ``method`` node is merged the same way into its
method's dataclass, :func:`prism.methods.registry.check`, so its errors are worded here too) and returns the :class:`~prism.job.JobConfig`. :func:`record` is the
job config typed so, with exactly the keys it had: what the run hash
(:func:`pipelines.config.identity.run_hash`) and the run folder's ``config.yaml`` see, no key the yaml lacks.
What needs two groups, the backbone's weights, the data or this machine is in :mod:`pipelines.config.rules`.

Every schema is registered in Hydra's ``ConfigStore`` (group ``schema``, one entry per config group,
and ``job_schema`` for the whole job). No torch here.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterator, Mapping
from dataclasses import fields, is_dataclass
from typing import Any, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, ValidationError

from prism.data.config import SuiteConfig
from prism.job import (
    BackboneConfig,
    DiagnosticsConfig,
    JobConfig,
    LoggingConfig,
    LoraConfig,
    PrivacyConfig,
    ProtocolConfig,
    TrainConfig,
    TuneConfig,
    job_of,
)
from prism.typed import ConfigError, help_field, positive_int, require

__all__ = ["GROUPS", "KINDS", "ConfigError", "JobConfig", "conform", "help_field", "positive_int", "record", "require"]

GROUPS = get_type_hints(JobConfig)
KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}  # what a value must be
_STORE = ConfigStore.instance()
_STORE.store(name="job_schema", node=JobConfig)
for _node in (BackboneConfig, SuiteConfig, PrivacyConfig, LoraConfig, TrainConfig, ProtocolConfig, LoggingConfig,
              TuneConfig, DiagnosticsConfig):  # group schema/<name>: the class name less "Config", lower case
    _STORE.store(group="schema", name=_node.__name__.removesuffix("Config").lower(), node=_node)


# ------------------------------------------------------------------------------------------ conform
def conform(cfg: DictConfig) -> JobConfig:
    """The resolved job config ``cfg`` checked against :class:`~prism.job.JobConfig` and built (see the module
    docstring), or :class:`ConfigError`."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    for key, value in plain.items():  # a section given a value: named before the merge, which cannot say
        kind = GROUPS.get(key)
        if is_dataclass(kind) and not isinstance(value, Mapping):
            raise ConfigError(f"{key} is a section, not a value, set one of its keys instead "
                              f"(e.g. {key}.{fields(kind)[0].name}=...)")
    try:
        return job_of(plain)
    except ConfigKeyError as err:
        raise _unknown(str(err.full_key), plain) from None
    except MissingMandatoryValue as err:
        raise ConfigError(f"{err.full_key} is missing, restore it (it is in the composed defaults)") from None
    except ValidationError as err:
        raise _wrong_type(str(err.full_key), err) from None


def record(cfg: DictConfig) -> DictConfig:
    """The resolved job config ``cfg`` with the types :func:`conform` gives its values and exactly its own
    keys (struct mode): the run hash's and the run folder's ``config.yaml``'s input."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    out = OmegaConf.create(_keep(dataclasses.asdict(conform(cfg)), plain))
    OmegaConf.set_struct(out, True)
    return out


def _keep(typed: Any, plain: Any) -> Any:
    """``typed`` cut down to the keys of ``plain`` (the schema's absent keys are not added; a key the
    dataclass does not hold, a method yaml's ``_target_``, as given)."""
    if isinstance(plain, dict) and isinstance(typed, dict):
        return {k: _keep(typed[k], v) if k in typed else v for k, v in plain.items()}
    return typed


def _leaves(node: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every key of a plain nested mapping, sections included."""
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        yield path, value
        if isinstance(value, Mapping):
            yield from _leaves(value, path)


def _unknown(key: str, plain: Mapping[str, Any]) -> ConfigError:
    parent, _, leaf = key.rpartition(".")
    elsewhere = [path for path, _ in _leaves(plain, "") if path.rpartition(".")[2] == leaf and path != key]
    if elsewhere:
        return ConfigError(f"unknown key {key}, did you mean {' or '.join(sorted(elsewhere)[:3])}?")
    siblings = OmegaConf.select(OmegaConf.create(plain), parent) if parent else plain
    names = sorted(str(k) for k in siblings if k != leaf) if isinstance(siblings, Mapping) else []
    close = difflib.get_close_matches(leaf, names, n=1)
    hint = f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close else "check the spelling"
    return ConfigError(f"unknown key {key}, {hint} (keys of {parent or 'the config'}: {', '.join(names)})")


def _wrong_type(key: str, err: ValidationError) -> ConfigError:
    text = str(err).splitlines()[0]
    value = re.search(r"Value '(.*?)'(?: of type '(\w+)')?", text)
    shown = "?" if value is None else repr(value.group(1)) if value.group(2) == "str" else value.group(1)
    if "Incompatible value 'None'" in text or "field of type" in text and "None" in text:
        return ConfigError(f"{key} may not be null, give it a value")
    for name, kind in (("Integer", KINDS[int]), ("Float", KINDS[float]), ("Boolean", KINDS[bool]),
                       ("valid bool", KINDS[bool])):
        if name in text:
            return ConfigError(f"{key} must be {kind}, got {shown}; write e.g. {key}=<{kind.split()[-1]}>")
    if "is not a ListConfig" in text:
        return ConfigError(f"{key} must be a list, got a single value; write e.g. {key}=[a,b]")
    if "is not a subclass of" in text or "Merge error" in text:
        return ConfigError(f"{key} must be a section with its keys, got a value; set one of its keys instead")
    return ConfigError(f"{key} has the wrong type ({text}), check its value")
