"""A private selection's candidate in the config (``privacy.selection``, docs/PRIVACY.md "ε includes
tuning"): absent from every ordinary job, so no ordinary run hash changes; a candidate differs from its
ordinary job only in the selection's keys. Its refusals are cases of tests/test_cli_errors.py."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from pipelines.config.compose import experiment_jobs, job_config
from pipelines.config.validate import load_job
from pipelines.runs import store

ORDINARY = [[], ["experiment=tune", "method=lamb"], ["protocol=released"], ["experiment=table5"],
            experiment_jobs("table2")[0], experiment_jobs("table2")[-1]]


def _flat(node: object, prefix: str = "") -> dict[str, object]:
    """Dotted key -> value of every leaf."""
    if not isinstance(node, dict):
        return {prefix: node}
    return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}.{key}".lstrip(".")).items()}


@pytest.mark.parametrize("job", ORDINARY, ids=lambda job: " ".join(job) or "defaults")
def test_an_ordinary_job_has_no_selection_key_and_keeps_the_hash_of_its_yaml(job: list[str]) -> None:
    cfg, composed = load_job(job, here=False), job_config(job)
    assert "selection" not in cfg.privacy and "selection" not in composed.privacy
    assert store.run_hash(cfg) == store.run_hash(composed)
    plain = OmegaConf.to_container(cfg)
    assert store.run_hash({**plain, "privacy": {k: v for k, v in plain["privacy"].items() if k != "selection"}}) \
        == store.run_hash(cfg)


def test_a_candidate_differs_from_its_ordinary_job_only_in_the_selection_keys() -> None:
    cell = ["method=ffa", "privacy=eps3", "suite=math10k", "seed=43"]
    ordinary = _flat(OmegaConf.to_container(load_job(["experiment=table2", *cell], here=False)))
    accounted = ["experiment=table2-accounted", *cell, "privacy.selection.candidate=2"]
    candidate = _flat(OmegaConf.to_container(load_job([*accounted, "tune.lr_factor=3.16"], here=False)))
    differ = {k for k in ordinary.keys() | candidate.keys() if ordinary.get(k, "absent") != candidate.get(k, "absent")}
    provenance = {k for k in differ if k.startswith("train.lr_source")}  # method.lr's source: tuned file vs factor
    assert differ - {"method.lr", *provenance} == {"experiment", "tune.lr_factor", "suite.validation_per_task",
                                      *(f"privacy.selection.{k}" for k in ("mean", "shape", "score_noise", "candidate"))}
    assert candidate["privacy.selection.candidate"] == 2 and candidate["tune.lr_factor"] == 3.16
    default = load_job([*accounted, "tune.lr_factor=1.0"], here=False).method.lr  # the sweep's centre: no tuned file
    assert candidate["method.lr"] == pytest.approx(3.16 * default, rel=1e-5)
