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
4. :func:`validate`: ranges and cross-field rules (privacy name vs ε, LoRA rank vs the narrowest
   targeted layer, batch vs training-set size, micro-batch ≤ batch, device present, room for the
   label after ``suite.cutoff_len``, paper-scale data present).

Nothing here imports torch or transformers, so a bad input is reported in about a second.
"""
from __future__ import annotations

import difflib
import functools
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipelines.grid import CONF_DIR, compose_config, resolve

MISSING = object()
LOCKED = {  # key -> the group whose choice sets it
    "suite.name": "suite", "suite.family": "suite", "suite.scale": "scale",
    "method.name": "method", "backbone.name": "backbone", "backbone.paper_name": "backbone",
}
DEVICES = re.compile(r"auto|cpu|cuda(:\d+)?")
PRIVACY_NAME = re.compile(r"eps(\d+(?:\.\d+)?)")
EXPERIMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class ConfigError(ValueError):
    """A config that cannot run; the message is one line naming the field and the fix."""


# --------------------------------------------------------------------------------------- composing
def load_job(overrides: Sequence[str]) -> DictConfig:
    """The validated, resolved job config of ``python -m pipelines.run <overrides>``."""
    parsed = _parse(overrides)
    for override in parsed:
        if override.is_sweep_override():
            raise ConfigError(f"{override.input_line} is a sweep, add -m to run one job per value "
                              f"(or write {override.key_or_group}=[a,b] for a list value)")
        if _is_group(override) and override.is_delete():
            raise ConfigError(f"~{override.key_or_group} removes a config group the run needs, "
                              f"choose one of its options instead ({override.key_or_group}=...)")
    reference = _reference(tuple(o.input_line for o in parsed if _is_group(o)))
    for override in parsed:
        if not _is_group(override) and not override.key_or_group.startswith("hydra"):
            _check_override(override, reference)
    cfg = conform(_resolve(_compose(overrides), overrides), reference)
    validate(cfg)
    return cfg


def load_sweep(overrides: Sequence[str]) -> list[DictConfig]:
    """Every job of ``python -m pipelines.run -m <overrides>`` validated (the experiment's
    ``hydra.sweeper.params`` expanded with the overrides, as Hydra's basic sweeper does)."""
    from pipelines.grid import expand

    parsed = _parse(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    try:
        params = compose_config(fixed, with_hydra=True).hydra.sweeper.params or {}
    except Exception:  # the same composition again, for its one-line error
        _resolve(_compose(fixed), fixed)
        raise
    jobs = expand({str(k): str(v) for k, v in params.items()}, list(overrides))
    configs = []
    for job in jobs:
        try:
            configs.append(load_job(job))
        except ConfigError as err:
            raise ConfigError(f"in the job {' '.join(job)}: {err}") from None
    return configs


def _parse(overrides: Sequence[str]) -> list[Override]:
    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as err:
        lines = str(err).splitlines()
        detail = f" ({lines[1].split(' expecting ')[0].strip()})" if len(lines) > 1 else ""
        bad = re.search(r"'(.*)'", lines[0])
        raise ConfigError(f"cannot parse the override {bad.group(1) if bad else lines[0]!r}{detail}, "
                          "write key=value, e.g. train.steps=10 or method=adamw") from None


@functools.lru_cache(maxsize=64)
def _reference(groups: tuple[str, ...]) -> DictConfig:
    """The config of these group choices with no value override (read-only; cached)."""
    reference = _resolve(_compose(groups), groups)
    OmegaConf.set_readonly(reference, True)
    return reference


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
                          "check them against `python -m pipelines.run --cfg job`") from None


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
    if key in LOCKED and known is not MISSING and value != known:
        raise _locked(key, value, known)
    if isinstance(known, Mapping) and not isinstance(value, Mapping):
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
            raise ConfigError(f"{path} must be a section with keys {', '.join(map(str, ref))}, got {value!r}")
        _conform_node(value, ref, f"{path}.", root)
        return value
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


# -------------------------------------------------------------------------------------- the rules
def validate(cfg: DictConfig) -> None:
    """Ranges and cross-field rules of a resolved job config; raises :class:`ConfigError`."""
    _general(cfg)
    _privacy(cfg.privacy)
    _train(cfg.train)
    _method(cfg.method)
    _lora_and_backbone(cfg)
    _suite(cfg)
    _logging(cfg.logging)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _positive_int(value: Any, key: str, minimum: int = 1) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
             f"{key}={value!r} must be an integer >= {minimum}")


def _general(cfg: DictConfig) -> None:
    _require(isinstance(cfg.seed, int) and 0 <= cfg.seed < 2**32, f"seed={cfg.seed!r} must be an integer in [0, 2^32)")
    _require(isinstance(cfg.experiment, str) and EXPERIMENT_NAME.fullmatch(cfg.experiment) is not None,
             f"experiment={cfg.experiment!r} names a folder, use letters, digits, '.', '_' or '-'")
    results = Path(str(cfg.results_dir)).expanduser()
    _require(bool(str(cfg.results_dir)) and not (results.exists() and not results.is_dir()),
             f"results_dir={cfg.results_dir} is not a folder, point results_dir at a folder")


def _privacy(p: DictConfig) -> None:
    eps, delta, clip = float(p.epsilon), float(p.delta), float(p.clip_norm)
    _require(eps > 0, f"privacy.epsilon={eps} must be > 0 (or inf), use privacy=nondp for a non-private run")
    _require(0 < delta < 1, f"privacy.delta={delta} must lie in (0, 1), e.g. 1e-5")
    _require(0 < clip < math.inf, f"privacy.clip_norm={clip} must be a finite number > 0, e.g. 1.0")
    _require(p.calibration in ("exact", "epochs"), f"privacy.calibration={p.calibration!r} must be exact or epochs")
    named = PRIVACY_NAME.fullmatch(str(p.name))
    if p.name == "nondp":
        _require(eps == math.inf, f"privacy.epsilon={eps} contradicts privacy=nondp (ε = inf), "
                                  f"choose privacy=eps6 or privacy=eps3 for a private run")
    elif named:
        _require(eps == float(named.group(1)), f"privacy.epsilon={eps} contradicts privacy={p.name} "
                 f"(ε = {named.group(1)}), use privacy=nondp for ε = inf or also set privacy.name=eps<ε>")
    else:
        raise ConfigError(f"privacy.name={p.name!r} must be nondp or eps<ε> (e.g. eps6), so tables file the run "
                          "in the right row")


def _train(t: DictConfig) -> None:
    for key in ("steps", "batch_size", "micro_batch_size", "checkpoint_every", "eval_batch_size"):
        _positive_int(t[key], f"train.{key}")
    _require(t.micro_batch_size <= t.batch_size,
             f"train.micro_batch_size={t.micro_batch_size} exceeds train.batch_size={t.batch_size}, "
             f"lower it to at most {t.batch_size}")
    _require(0 < float(t.lr_multiplier) < math.inf, f"train.lr_multiplier={t.lr_multiplier} must be a finite number > 0")
    _require(str(t.prefix_cache) in ("auto", "off"), f"train.prefix_cache={t.prefix_cache!r} must be auto or off")
    if t.benchmark is not None:
        bench = t.benchmark
        _require(isinstance(bench, Mapping) and set(bench) == {"warmup", "measure"},
                 f"train.benchmark={bench!r} must be null or {{warmup: W, measure: M}}")
        _positive_int(bench.warmup, "train.benchmark.warmup", 0)
        _positive_int(bench.measure, "train.benchmark.measure")
    device = str(t.device)
    _require(DEVICES.fullmatch(device) is not None, f"train.device={device!r} must be auto, cpu or cuda")
    if device.startswith("cuda"):
        import torch  # only here: a GPU check needs it

        _require(torch.cuda.is_available(), f"train.device={device} but no GPU is visible, use train.device=auto or cpu")


def _method(m: DictConfig) -> None:
    lr = m.lr
    _require(isinstance(lr, float) and 0 < lr < math.inf, f"method.lr={lr!r} must be a finite number > 0")
    _require(m.init in ("peft", "spectral"), f"method.init={m.init!r} must be spectral or peft")
    for key in ("beta1", "beta2"):
        if key in m:
            _require(0 <= float(m[key]) < 1, f"method.{key}={m[key]} must lie in [0, 1)")
    if "betas" in m:
        _require(len(m.betas) == 2 and all(0 <= float(b) < 1 for b in m.betas),
                 f"method.betas={list(m.betas)} must be two numbers in [0, 1)")
    if "eps" in m:
        _require(float(m.eps) > 0, f"method.eps={m.eps} must be > 0")
    if "weight_decay" in m:
        _require(float(m.weight_decay) >= 0, f"method.weight_decay={m.weight_decay} must be >= 0")


def _lora_and_backbone(cfg: DictConfig) -> None:
    from prism.backbones import BACKBONES, TextShape, text_shape

    lora, backbone = cfg.lora, cfg.backbone
    _positive_int(lora.r, "lora.r")
    _require(float(lora.alpha) > 0, f"lora.alpha={lora.alpha} must be > 0")
    _require(0 <= float(lora.dropout) < 1, f"lora.dropout={lora.dropout} must lie in [0, 1)")
    _require(backbone.name in BACKBONES, f"backbone.name={backbone.name!r} is not a known backbone, "
                                         f"choose backbone=<one of {', '.join(BACKBONES)}>")
    _require(backbone.dtype in ("float32", "bfloat16", "float64"),
             f"backbone.dtype={backbone.dtype!r} must be float32, bfloat16 or float64")
    linears = sorted(TextShape(1, 1, 1, 1, 1, 1).linear_shapes())
    targets = list(lora.targets)
    _require(bool(targets) and len(set(targets)) == len(targets) and set(targets) <= set(linears),
             f"lora.targets={targets} must list distinct layer names out of {', '.join(linears)}")
    if backbone.lora_layers is not None:
        _positive_int(backbone.lora_layers, "backbone.lora_layers")
    shape = text_shape(BACKBONES[backbone.name])
    if shape is None:  # a paper backbone not in the local cache: its loader checks the rank
        return
    if backbone.lora_layers is not None:
        _require(backbone.lora_layers <= shape.num_hidden_layers,
                 f"backbone.lora_layers={backbone.lora_layers} exceeds the {shape.num_hidden_layers} decoder "
                 f"layers of {backbone.name}, use 1..{shape.num_hidden_layers} or null for all")
    widths = {name: min(shape.linear_shapes()[name]) for name in targets}
    narrowest = min(widths, key=widths.__getitem__)
    _require(lora.r <= widths[narrowest],
             f"lora.r={lora.r} exceeds the width {widths[narrowest]} of {narrowest} in {backbone.name}, "
             f"use lora.r <= {widths[narrowest]} (e.g. lora=r16) or drop {narrowest} from lora.targets")


def _suite(cfg: DictConfig) -> None:
    suite = cfg.suite
    _positive_int(suite.cutoff_len, "suite.cutoff_len")
    if suite.eval_limit is not None:
        _positive_int(suite.eval_limit, "suite.eval_limit")
    decoding = suite.decoding
    for key in ("num_beams", "max_new_tokens", "max_input_length"):
        if key in decoding:
            _positive_int(decoding[key], f"suite.decoding.{key}")
    if "prompt_encoding" in decoding:
        _require(decoding.prompt_encoding in ("as_trained", "text"),
                 f"suite.decoding.prompt_encoding={decoding.prompt_encoding!r} must be as_trained or text")
    from prism.data import SCALES

    _require(suite.scale in SCALES, f"suite.scale={suite.scale!r} is not a data scale, choose scale=<one of "
                                    f"{', '.join(SCALES)}>")
    node = suite.get(suite.scale)
    _require(isinstance(node, Mapping), f"suite.{suite.scale} is missing, restore the suite_scale group's settings")
    sizes = {"embedded": _embedded_size, "paper": _paper_size}
    n_train = sizes[suite.scale](suite.name, node) if suite.scale in sizes else None
    if n_train is not None:
        _require(cfg.train.batch_size <= n_train,
                 f"train.batch_size={cfg.train.batch_size} exceeds the {n_train} training examples of "
                 f"{suite.name} at {suite.scale} scale, lower train.batch_size to at most {n_train}")
    _label_room(cfg)


def _tasks(node: Mapping, key: str, valid: Mapping, where: str) -> list[str]:
    tasks = list(node.get(key) or valid)
    unknown = [t for t in tasks if t not in valid]
    _require(not unknown and len(set(tasks)) == len(tasks),
             f"{where}.{key}={tasks} must list distinct names out of {', '.join(valid)}")
    return tasks


def _embedded_size(name: str, node: Mapping) -> int:
    from prism.data.embedded import EMBEDDED_TASKS

    tasks = _tasks(node, "tasks", EMBEDDED_TASKS[name], "suite.embedded")
    for key in ("train_per_task", "eval_per_task"):
        if node.get(key) is not None:
            _positive_int(node[key], f"suite.embedded.{key}")
    if node.get("min_confidence") is not None:
        _require(0 <= float(node.min_confidence) <= 1,
                 f"suite.embedded.min_confidence={node.min_confidence} must lie in [0, 1]")
    from prism.data.embedded import DEFAULT_TRAIN_PER_TASK

    return len(tasks) * int(node.get("train_per_task") or DEFAULT_TRAIN_PER_TASK[name])


def _paper_size(name: str, node: Mapping) -> int | None:
    """Training-set size at paper scale (GLUE: an upper bound), after checking the data is present."""
    if name == "glue8":
        from prism.data.glue import GLUE_TASKS

        tasks = _tasks(node, "tasks", GLUE_TASKS, "suite.paper")
        if node.get("train_per_task") is not None:
            _positive_int(node.train_per_task, "suite.paper.train_per_task")
        for task in tasks:
            for split in ("train", *(s for _, s in GLUE_TASKS[task].eval_splits)):
                _require(_glue_cached(task, split),
                         f"suite.paper.tasks: GLUE {task}/{split} is not in the local data cache, "
                         "run `make data` (needs network) or use scale=embedded")
        return len(tasks) * int(node.get("train_per_task") or 1250)
    from prism.data.math10k import (
        LLM_ADAPTERS_URL,
        MATH10K_URL,
        MATH_TESTS,
        cached_path,
        is_url,
        testset_location,
    )

    tests = _tasks(node, "tests", MATH_TESTS, "suite.paper")
    train_file = str(node.get("train_file") or MATH10K_URL)
    _require(_present(train_file, cached_path, is_url),
             f"suite.paper.train_file: math_10k.json is not at {train_file} nor in the local data cache, "
             "run `make data` (needs network), give a local path, or use scale=embedded")
    root = str(node.get("llm_adapters") or LLM_ADAPTERS_URL)
    for test in tests:
        location = testset_location(root, MATH_TESTS[test][0])
        _require(_present(location, cached_path, is_url),
                 f"suite.paper.llm_adapters: the {test} test set is not at {location} nor in the local data "
                 "cache, run `make data` (needs network), give a local checkout, or use scale=embedded")
    rows = node.get("train_rows")
    if rows is not None:
        _positive_int(rows, "suite.paper.train_rows")
    return rows


def _present(spec: str, cached_path: Any, is_url: Any) -> bool:
    return (cached_path(spec) if is_url(spec) else Path(spec).expanduser()).is_file()


def _glue_cached(task: str, split: str) -> bool:
    """The `make data` cache has the split, or the Hugging Face datasets cache has the task."""
    from prism.data import cache_dir

    if (cache_dir() / "glue" / task / f"{split}.jsonl").is_file():
        return True
    hf_home = Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser()
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE", hf_home / "datasets")).expanduser()
    return (datasets_cache / "nyu-mll___glue" / task).is_dir()


def _label_room(cfg: DictConfig) -> None:
    """With a byte-level tokenizer a prompt is as many tokens as UTF-8 bytes, so when even the
    shortest possible GLUE prompt fills ``suite.cutoff_len`` every label is cut off (loss 0)."""
    from prism.backbones import BACKBONES

    suite = cfg.suite
    if suite.family != "glue" or not BACKBONES[cfg.backbone.name].byte_tokens:
        return
    from prism.data import Example
    from prism.data.embedded import EMBEDDED_TASKS
    from prism.data.glue import GLUE_TASKS
    from prism.data.prompts import train_prompt

    node = suite[suite.scale]
    if suite.scale == "embedded":
        column_of = {spec.column: spec for spec in GLUE_TASKS.values()}
        specs = [column_of[EMBEDDED_TASKS[suite.name][t][0]] for t in (node.get("tasks") or EMBEDDED_TASKS[suite.name])]
    else:
        specs = [GLUE_TASKS[t] for t in (node.get("tasks") or GLUE_TASKS)]
    shortest = min(len(train_prompt(Example("", spec.instruction, "x", "", 0), with_output=False).encode())
                   for spec in specs)
    _require(shortest < suite.cutoff_len,
             f"suite.cutoff_len={suite.cutoff_len} leaves no room for the label: every {suite.name} prompt is at "
             f"least {shortest} tokens with backbone {cfg.backbone.name}'s byte tokenizer, "
             f"raise suite.cutoff_len (e.g. suite.cutoff_len=1024)")


def _logging(lg: DictConfig) -> None:
    _require(lg.mode in ("online", "offline", "disabled"),
             f"logging.mode={lg.mode!r} must be online, offline or disabled (or choose logging=<one of those>)")
    if lg.mode == "online" and not _wandb_key():
        raise ConfigError("logging=online needs a W&B API key and none is set, run `wandb login` or set "
                          "WANDB_API_KEY, or use logging=offline and `make wandb-sync` later")


def _wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", "~/.netrc")).expanduser()
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False
