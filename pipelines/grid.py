"""Compose run configs and expand an experiment's sweep grid into a job list.

A *job* is a list of Hydra override strings; ``python -m pipelines.run <job...>`` runs it. The grid
of ``experiment=tableN`` is the cartesian product of its ``hydra.sweeper.params`` with the user's
overrides, expanded the way Hydra's basic sweeper does (a user override of a swept key replaces
the sweep; a user sweep ``key=a,b`` adds an axis), so the local dispatcher
(:mod:`pipelines.reproduce`), Hydra multirun and the SLURM array scripts run the same jobs.

Command line (for ``slurm/`` scripts): ``python -m pipelines.grid tableN [overrides...] [--pending]``
prints one job per line (shell-quoted overrides) after validating every job as ``pipelines.run``
does (:func:`pipelines.validate.load_experiment`); ``--pending`` leaves out finished runs (trained
for any experiment: the run store is shared) and tags them into this experiment's view;
``--remote``: the jobs run on other machines (SLURM), so the local device is not checked. The
first bad job is one ``error:`` line on stderr naming the job and the field, exit code 2.
"""
from __future__ import annotations

import itertools
import os
import shlex
import sys
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


USAGE = "usage: python -m pipelines.grid tableN|compare|tune [overrides...] [--pending] [--remote]"
HELP = """prints every job of the table's grid, one line of shell-quoted overrides each, after validating
all of them as `python -m pipelines.run` does (the first bad one: one error line, exit code 2)
  --pending  leave out the runs already finished (they are tagged into the table's view)
  --remote   the jobs run on other machines (SLURM): do not check this machine's device
Values with spaces or non-ASCII characters: quote them for Hydra inside one shell word,
  e.g. 'results_dir="/tmp/my runs"'"""


def main(argv: Sequence[str]) -> int:
    from pipelines import store
    from pipelines.validate import ConfigError, load_experiment

    if {"-h", "--help"} & set(argv):
        print(f"{USAGE}\n{HELP}")
        return 0
    flags = [a for a in argv if a.startswith("--")]
    if not argv or argv[0].startswith("-") or set(flags) - {"--pending", "--remote"}:
        bad = next((f for f in flags if f not in ("--pending", "--remote")), None)
        print(f"error: unknown option {bad}, " if bad else "", USAGE, sep="", file=sys.stderr)
        return 2
    args = [a for a in argv if a not in flags]
    experiment = f"table{args[0]}" if args[0].isdigit() else args[0]  # 2 or table2; compare, tune
    if experiment == "compare":  # the task files pinned as make compare pins them: the same runs
        from pipelines.compare import pin_task_files

        args = [args[0], *pin_task_files(args[1:])]
    lines = []
    try:
        for job, cfg in load_experiment(experiment, args[1:], here=False if "--remote" in flags else None):
            if "--pending" in flags:
                root, run_hash = store.runs_root(cfg), store.run_hash(cfg)
                if store.inspect_run(store.find_run(root, run_hash)).state == "finished" and not cfg.force:
                    store.tag(root, experiment, run_hash)
                    continue
            lines.append(shlex.join(job))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except COMPOSE_ERRORS as err:
        print(f"error: {error_line(err)}", file=sys.stderr)
        return 2
    if lines:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
