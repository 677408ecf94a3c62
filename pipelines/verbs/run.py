"""``python -m pipelines run``: one job, or Hydra's multirun over a grid (:mod:`pipelines.runs.runner` runs each).

    python -m pipelines run method=adamw privacy=eps3 suite=math10k        # one run
    python -m pipelines run -m experiment=table2                           # Hydra multirun (basic launcher: sequential)
    python -m pipelines run -m experiment=table2 scale=paper launcher=slurm   # SLURM array; blocks: use tmux/nohup

Every job's config is validated first (:mod:`pipelines.config.validate`; a multirun validates all its
jobs before the first starts): a bad input prints ``error: <what>, <how to fix>`` on one line and
exits with code 2, before any model load, W&B init or folder. ``--debug`` (or
``HYDRA_FULL_ERROR=1``) shows tracebacks instead. A single run does not go through Hydra's run
mode, so it leaves no ``hydra/`` output folder; Hydra's flags (``-m``, ``--cfg``, ...) hand the
command line to Hydra, whose task function is :func:`_hydra_main`.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import hydra
from omegaconf import DictConfig

from pipelines.config.compose import CONF_DIR, resolve
from pipelines.config.validate import ConfigError, check, load_job, load_sweep
from pipelines.runs import store
from pipelines.runs.runner import Trainer, _one_line, _run, _stoppable, execute

HYDRA_SWITCHES = ("-m", "--multirun", "--hydra-help", "--resolve", "--version", "--run", "-r")
HYDRA_OPTIONS = ("--cfg", "-c", "--package", "-p", "--shell-completion", "-sc", "--experimental-rerun",
                 "--info", "-i")  # take a value (--info: optionally)
OTHER_CONFIG = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")  # not conf/config.yaml
INFO_TOPICS = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def command(overrides: Sequence[str], trainer: Trainer | None = None, debug: bool = False) -> int:
    """Train one job: ``python -m pipelines run [-m] [--cfg job] key=value...``, the keys of ``conf/``
    (e.g. ``method=adamw privacy=eps3 suite=math10k``; ``-m``: a Hydra multirun over comma-separated
    values, ``experiment=tableN`` for a table's grid). Returns the exit code: 0, 1 (the run failed; its
    traceback is kept in the run folder), 2 (bad input, one line), 130 (interrupted; the same command
    resumes it). ``trainer``: as in :func:`execute`."""
    debug = debug or os.environ.get("HYDRA_FULL_ERROR") == "1"
    return _stoppable(lambda: _command(list(overrides), trainer, debug), debug)


def _command(args: list[str], trainer: Trainer | None, debug: bool) -> int:
    try:
        flags, overrides = split_flags(args)
        if flags:
            if not any(f.split("=", 1)[0] in OTHER_CONFIG for f in flags):
                if {"-m", "--multirun"} & set(flags):  # its jobs read the store: an older layout refused here
                    for root in {store.runs_root(job) for job in load_sweep(overrides)}:
                        store.refuse_older_layout(root)
                else:
                    load_job(overrides)
            return _hydra(args)
        cfg = load_job(overrides)
    except Exception as err:  # bad input, or a check that itself failed on an odd config: one line either way
        if debug:
            raise
        print(f"error: {err}" if isinstance(err, ConfigError) else f"error: the config could not be validated "
              f"({_one_line(err)}), check the overrides (rerun with --debug for the traceback)", file=sys.stderr)
        return 2
    return _run(cfg, trainer, debug)


def split_flags(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(Hydra's flags with their values, the overrides); an unknown flag is a :class:`ConfigError`."""
    flags: list[str] = []
    overrides: list[str] = []
    pending = False  # the last flag waits for its value
    for arg in args:
        name = arg.split("=", 1)[0]
        is_value = pending and not arg.startswith("-") and (flags[-1] not in ("--info", "-i") or arg in INFO_TOPICS)
        pending = False
        if is_value or name in HYDRA_SWITCHES + HYDRA_OPTIONS + OTHER_CONFIG:
            flags.append(arg)
            pending = not is_value and "=" not in arg and name in HYDRA_OPTIONS + OTHER_CONFIG
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg}, write overrides as key=value "
                              "(options: --debug, -m, --cfg job; --help: the usage)")
        else:
            overrides.append(arg)
    return flags, overrides


def _hydra(args: list[str]) -> int:
    """Hand the command line to Hydra (multirun, ``--cfg``, ``--help``); each job runs the config
    Hydra composed for it, validated in the process that runs it (a SLURM task checks its own device)."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()  # validation initialised it; Hydra's main initialises its own
    sys.argv = [sys.argv[0], *args]
    _hydra_main()
    return 0


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> str:
    """One job of a Hydra multirun: the config Hydra composed for it, validated here once."""
    return execute(check(resolve(cfg)))
