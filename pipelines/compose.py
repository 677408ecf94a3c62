"""Compose run configs and expand an experiment's sweep grid into a job list (a library: no command).

A *job* is a list of Hydra override strings; ``python -m pipelines run <job...>`` runs it. The grid
of ``experiment=tableN`` is the cartesian product of its ``hydra.sweeper.params`` with the user's
overrides, expanded the way Hydra's basic sweeper does (a user override of a swept key replaces
the sweep; a user sweep ``key=a,b`` adds an axis), so the local dispatcher
(:mod:`pipelines.launch`), Hydra multirun and the SLURM array scripts run the same jobs.
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipelines.tuned_rates import method_lr

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
CONFIG_NAME = "config"


def by_family(family: str, table: Mapping[str, Any], multiplier: float = 1.0) -> float:
    """Resolver ``${by_family:${suite.family},{glue: 2e-4, math: 3e-4},${train.lr_multiplier}}``.

    Table 8's column for the suite family, as a float, times the scale's learning-rate multiplier
    (1 at paper scale; scale/embedded.yaml raises it for its 10x shorter runs).
    """
    if family not in table:
        raise ValueError(f"no learning rate for suite family {family!r}; the method yaml lists {sorted(table)}")
    return float(f"{float(table[family]) * float(multiplier):.12g}")  # no 0.0029999999999999996 in configs


COMPOSE_ERRORS = (HydraException, OmegaConfBaseException, ValueError)  # what bad overrides raise


def error_line(err: BaseException) -> str:
    """Hydra's message about overrides that do not compose, on one line (no config search path)."""
    return " ".join(str(err).split("Config search path:")[0].split()) or type(err).__name__


def register_resolvers() -> None:
    """Register the custom OmegaConf resolvers the yaml files use (idempotent)."""
    if not OmegaConf.has_resolver("by_family"):
        OmegaConf.register_new_resolver("by_family", by_family)
    if not OmegaConf.has_resolver("method_lr"):  # tuned rates when `make tune` wrote them (pipelines/tuned_rates.py)
        OmegaConf.register_new_resolver("method_lr", method_lr)


register_resolvers()


def compose_config(overrides: Sequence[str], with_hydra: bool = False) -> DictConfig:
    """Compose ``conf/config.yaml`` with ``overrides`` (Hydra's compose API; struct mode on)."""
    if not GlobalHydra.instance().is_initialized():  # initialised once per process (cheap repeats)
        initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="prism")
    return compose(config_name=CONFIG_NAME, overrides=list(overrides), return_hydra_config=with_hydra)


def resolve(cfg: DictConfig) -> DictConfig:
    """The resolved job config the core reads (no ``hydra`` node, no interpolations, struct mode;
    a leading ``~`` in ``results_dir`` and ``logging.dir`` expanded, as a shell would unquoted)."""
    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    plain.pop("hydra", None)
    for node, key in ((plain, "results_dir"), (plain.get("logging"), "dir")):  # not hashed: no machine's home
        if isinstance(node, dict) and isinstance(node.get(key), str) and node[key].startswith("~"):
            node[key] = os.path.expanduser(node[key])  # a leading ~ is the home folder, also when quoted
    resolved = OmegaConf.create(plain)
    OmegaConf.set_struct(resolved, True)
    return resolved


def sweep_params(experiment: str, overrides: Sequence[str] = ()) -> dict[str, str]:
    """``hydra.sweeper.params`` of ``experiment`` (e.g. ``table2``) composed with ``overrides``."""
    cfg = compose_config([f"experiment={experiment}", *overrides], with_hydra=True)
    params = cfg.hydra.sweeper.params or {}
    return {str(k): str(v) for k, v in params.items()}


def expand(params: Mapping[str, str], overrides: Sequence[str]) -> list[list[str]]:
    """Cartesian product of sweep ``params`` and ``overrides`` (later keys win, as in Hydra)."""
    parser = OverridesParser.create()
    parsed = parser.parse_overrides([f"{k}={v}" for k, v in params.items()] + list(overrides))
    axes: dict[str, list[str]] = {}
    for override in parsed:
        key = override.get_key_element()
        if override.is_sweep_override():
            axes[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            axes[key] = [f"{key}={override.get_value_element_as_str()}"]
    return [list(job) for job in itertools.product(*axes.values())]


def experiment_jobs(experiment: str, overrides: Sequence[str] = ()) -> list[list[str]]:
    """Every job of ``experiment``'s grid: ``[experiment=tableN, *overrides, *sweep choices]``."""
    fixed = [o for o in overrides if not _is_sweep(o)]
    params = sweep_params(experiment, fixed)
    return [[f"experiment={experiment}", *job] for job in expand(params, overrides)]


def _is_sweep(override: str) -> bool:
    return OverridesParser.create().parse_override(override).is_sweep_override()


def job_config(job: Sequence[str]) -> DictConfig:
    """The resolved config of one job."""
    return resolve(compose_config(job))
