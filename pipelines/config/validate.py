"""One validation pass over a job's whole config, before any model load, W&B init or run folder.

A job is composed once (:func:`pipelines.config.compose.compose_job`) and validated once (:func:`check`): the
schema (:func:`pipelines.config.schema.record`: :func:`~pipelines.config.schema.conform`'s types), then the
cross-field rules (:func:`pipelines.config.rules.validate`). A bad input is one :class:`ConfigError` line, ``<what>, <how
to fix>``, naming the field; a grid (:func:`load_grid`, :func:`load_experiment`, :func:`load_sweep`:
``python -m pipelines grid``, ``... reproduce``, ``slurm/submit.sh``, ``... run -m``) is validated
whole before any job is launched, and the configs returned are what the runs receive. Nothing here
imports torch or transformers, so a bad input is reported in about a second.
"""
from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig

from pipelines.config import compose, identity
from pipelines.config.rules import validate
from pipelines.config.schema import ConfigError, record

__all__ = ["ConfigError", "check", "load_experiment", "load_grid", "load_job", "load_sweep"]


def check(cfg: DictConfig, *, here: bool = True) -> DictConfig:
    """The resolved job config ``cfg`` validated: the schema, then the cross-field rules. Returns the
    typed config with exactly its keys (an int given for a float is that float; the run's record, hashed and
    written to its folder). ``here=False`` for a job that runs on another machine (a SLURM array task): the
    local device and memory are not checked."""
    cfg = record(cfg)
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
        runs_here = "launcher=slurm" not in (o.lstrip("+") for o in job) if here is None else here
        try:
            configs.append(load_job(job, here=runs_here))
        except ConfigError as err:
            raise ConfigError(f"job {k} of {len(jobs)} ({' '.join(job)}): {err}") from None
        except Exception as err:  # a rule that itself failed on an odd value: still one line
            raise ConfigError(f"job {k} of {len(jobs)} ({' '.join(job)}) could not be validated "
                              f"({type(err).__name__}: {compose.one_line(err)}), check its overrides") from None
    return configs


def load_experiment(experiment: str, overrides: Sequence[str], *,
                    here: bool | None = None) -> list[tuple[list[str], DictConfig]]:
    """The distinct jobs of ``experiment``'s grid (:func:`pipelines.config.compose.experiment_jobs`) with their
    validated configs; a bad override or job is one :class:`ConfigError` line. Jobs that resolve to one
    run (``seed=42,42``, ``privacy=nondp`` beside ``eps=inf``) are that run once, at its first place."""
    jobs = _jobs(overrides, [f"experiment={experiment}"], experiment)
    distinct: dict[str, tuple[list[str], DictConfig]] = {}
    for job, cfg in zip(jobs, load_grid(jobs, here=here), strict=True):
        distinct.setdefault(identity.run_hash(cfg), (job, cfg))
    return list(distinct.values())


def load_sweep(overrides: Sequence[str]) -> list[DictConfig]:
    """Every job of ``python -m pipelines run -m <overrides>`` validated (the experiment's
    ``hydra.sweeper.params`` expanded with the overrides, as Hydra's basic sweeper does)."""
    return load_grid(_jobs(overrides))


def _jobs(overrides: Sequence[str], head: Sequence[str] = (), experiment: str | None = None) -> list[list[str]]:
    """:func:`pipelines.config.compose.sweep_jobs` (:func:`pipelines.config.compose.experiment_jobs` for an ``experiment``, its
    reference jobs included); a bad override, or a grid that does not compose, is one :class:`ConfigError` line
    (the reason of its fixed part)."""
    fixed = [*head, *(o.input_line for o in compose.parse(overrides) if not o.is_sweep_override())]
    try:
        return compose.experiment_jobs(experiment, overrides) if experiment else compose.sweep_jobs(overrides, head)
    except Exception:  # the fixed part again, for its one-line error
        load_job(fixed, here=False)
        raise
