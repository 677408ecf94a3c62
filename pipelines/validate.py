"""One validation pass over a job's whole config, before any model load, W&B init or run folder.

:func:`load_job` composes a job's overrides once (:func:`pipelines.compose.compose_job`) and validates the
resolved config once (:func:`check`): the schema (:func:`pipelines.config_schema.conform`: keys, types,
``null``, choices and ranges, the method node's own schema) and then the cross-field rules
(:func:`pipelines.config_rules.validate`: rank vs width, batch vs N, data present, σ feasible, label
room, this machine's device). A bad input is one :class:`ConfigError` line, ``<what>, <how to fix>``,
naming the field.

:func:`load_grid` / :func:`load_experiment` / :func:`load_sweep` do the same for every job of a grid
before any is launched (``python -m pipelines grid``, ``... reproduce``, ``slurm/submit.sh``,
``... run -m``); the first bad job is one line naming the job and the field. The configs they
return are what the launcher hands to the runs: a job is not composed or validated again.

Nothing here imports torch or transformers, so a bad input is reported in about a second.
"""
from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig

from pipelines import compose, store
from pipelines.config_rules import validate
from pipelines.config_schema import ConfigError, conform

__all__ = ["ConfigError", "check", "load_experiment", "load_grid", "load_job", "load_sweep"]


def check(cfg: DictConfig, *, here: bool = True) -> DictConfig:
    """The resolved job config ``cfg`` validated: the schema, then the cross-field rules. Returns the
    typed config (an int given for a float is that float). ``here=False`` for a job that runs on another
    machine (a SLURM array task): the local device and memory are not checked."""
    cfg = conform(cfg)
    validate(cfg, here=here)
    return cfg


def load_job(overrides: Sequence[str], *, here: bool = True) -> DictConfig:
    """The validated, resolved job config of ``python -m pipelines run <overrides>``: composed once and
    validated once."""
    return check(compose.compose_job(overrides), here=here)


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
                              f"({type(err).__name__}: {compose.one_line(err)}), check its overrides") from None
    return configs


def load_experiment(experiment: str, overrides: Sequence[str], *,
                    here: bool | None = None) -> list[tuple[list[str], DictConfig]]:
    """The distinct jobs of ``experiment``'s grid (:func:`pipelines.compose.experiment_jobs`) with their
    validated configs; a bad override or job is one :class:`ConfigError` line. Jobs that resolve to one
    run (``seed=42,42``, ``privacy=nondp`` beside ``eps=inf``) are that run once, at its first place."""
    parsed = compose.parse(overrides)
    try:
        jobs = compose.experiment_jobs(experiment, overrides)
    except Exception:  # the grid does not compose: the one-line reason of its fixed part
        load_job([f"experiment={experiment}", *(o.input_line for o in parsed if not o.is_sweep_override())],
                 here=False)
        raise
    distinct: dict[str, tuple[list[str], DictConfig]] = {}
    for job, cfg in zip(jobs, load_grid(jobs, here=here), strict=True):
        distinct.setdefault(store.run_hash(cfg), (job, cfg))
    return list(distinct.values())


def _runs_here(job: Sequence[str]) -> bool:
    return not any(o.split("=", 1)[0].lstrip("+") == "launcher" and o.split("=", 1)[1] == "slurm"
                   for o in job if "=" in o)


def load_sweep(overrides: Sequence[str]) -> list[DictConfig]:
    """Every job of ``python -m pipelines run -m <overrides>`` validated (the experiment's
    ``hydra.sweeper.params`` expanded with the overrides, as Hydra's basic sweeper does)."""
    parsed = compose.parse(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    try:
        params = compose.sweep_params(fixed)
    except Exception:  # the same composition again, for its one-line error
        load_job(fixed, here=False)
        raise
    return load_grid(compose.expand(params, list(overrides)))
