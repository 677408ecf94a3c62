"""The Hydra config tree: grid sizes, resolved schema, Table 7/8 values, bad input, run hashes."""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import yaml
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import DictConfig, OmegaConf

from pipelines.config import identity
from pipelines.config.compose import experiment_jobs, job_config
from pipelines.config.validate import ConfigError, check
from pipelines.runs import store

# Independent expectations, written from the paper (Tables 2–5, 7, 8) and docs/ARCHITECTURE.md.
GRID_SIZES = {"table2": 36 + 2, "table3": 9, "table4": 18, "table5": 3}  # Table 2: 36 cells and the 0-step model per suite
TABLE8_LR = {("lamb", "glue"): 5e-3, ("lamb", "math"): 5e-3}
TABLE8_LR.update({(m, f): lr for m in ("adamw", "ffa", "lora_rite", "loraplus", "prism", "prism_paper")
                  for f, lr in (("glue", 2e-4), ("math", 3e-4))})
SCHEMA = {
    "backbone": {"name", "dtype", "lora_layers"},
    "suite": {"name", "scale", "family", "train_on_inputs", "cutoff_len", "eval_limit", "decoding"},
    "method": {"name", "lr", "init"},
    "privacy": {"name", "epsilon", "delta", "clip_norm", "calibration"},
    "lora": {"r", "alpha", "dropout", "targets"},
    "train": {"steps", "batch_size", "micro_batch_size", "checkpoint_every", "eval_batch_size", "device"},
}


TUNED = Path(__file__).resolve().parents[1] / "conf" / "tuned"


def expected_lr(cfg: DictConfig) -> float:
    """The committed tuned rate of the run's cell (conf/tuned/<scale>.yaml, read here with plain yaml:
    every listed field of the entry equal to the run's), else Table 8 × train.lr_multiplier."""
    path = TUNED / f"{cfg.suite.scale}.yaml"
    run = {"method": cfg.method.name, "suite": cfg.suite.name, "scale": cfg.suite.scale,
           "epsilon": float(cfg.privacy.epsilon), "backbone": cfg.backbone.name,
           "lora_layers": cfg.backbone.lora_layers, "steps": cfg.train.steps, "batch_size": cfg.train.batch_size}
    for entry in (yaml.safe_load(path.read_text())["rates"] if path.exists() else []):
        if all(entry[k] == v or (k == "epsilon" and float(entry[k]) == v) for k, v in run.items()):
            return float(entry["lr"])
    return TABLE8_LR[(cfg.method.name, cfg.suite.family)] * cfg.train.lr_multiplier


def check_schema(cfg: DictConfig) -> None:
    assert isinstance(cfg.seed, int) and isinstance(cfg.experiment, str)
    for section, keys in SCHEMA.items():
        assert keys <= set(cfg[section]), (section, keys - set(cfg[section]))
    assert type(cfg.method.lr) is float
    assert cfg.method.lr == pytest.approx(expected_lr(cfg))
    assert cfg.method.init == ("spectral" if cfg.method.name.startswith("prism") else "peft")
    assert cfg.suite.family == {"glue8": "glue", "math10k": "math"}[cfg.suite.name]
    assert cfg.privacy.delta == 1e-5 and cfg.privacy.clip_norm == 1.0
    assert cfg.privacy.epsilon == {"nondp": math.inf, "eps6": 6.0, "eps3": 3.0}[cfg.privacy.name]
    assert list(cfg.lora.targets) == ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]
    assert cfg.lora.alpha == 16


@pytest.fixture(scope="module")
def embedded_grids() -> dict[str, list[DictConfig]]:
    """Every job of every table at the default (embedded) scale, composed once per module."""
    return {e: [job_config(job) for job in experiment_jobs(e)] for e in GRID_SIZES}


@pytest.mark.parametrize("scale", ["embedded", "paper"])
@pytest.mark.parametrize("experiment", sorted(GRID_SIZES))
def test_grid_sizes(experiment: str, scale: str) -> None:
    jobs = experiment_jobs(experiment, [f"scale={scale}"])
    assert len(jobs) == GRID_SIZES[experiment]
    assert all(f"scale={scale}" in job for job in jobs)


def test_every_embedded_job_has_the_schema(embedded_grids: dict[str, list[DictConfig]]) -> None:
    for experiment, configs in embedded_grids.items():
        assert len(configs) == GRID_SIZES[experiment]
        for cfg in configs:
            check_schema(cfg)
            assert cfg.experiment == experiment and cfg.suite.scale == "embedded"
        # every cell of the grid is a distinct run folder
        assert len({store.run_hash(c) for c in configs}) == len(configs)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", sorted(GRID_SIZES))
def test_every_paper_job_has_the_schema(experiment: str) -> None:
    configs = [job_config(job) for job in experiment_jobs(experiment, ["scale=paper"])]
    for cfg in configs:
        check_schema(cfg)
        assert cfg.suite.scale == "paper" and cfg.train.batch_size == 64
    assert len({store.run_hash(c) for c in configs}) == GRID_SIZES[experiment]


def test_table_axes_match_the_paper(embedded_grids: dict[str, list[DictConfig]]) -> None:
    t2 = embedded_grids["table2"]
    assert {(c.method.name, c.privacy.name, c.suite.name) for c in t2} == set(itertools.product(
        ["prism", "adamw", "loraplus", "lamb", "ffa", "lora_rite"], ["nondp", "eps6", "eps3"], ["glue8", "math10k"]))
    assert {c.backbone.paper_name for c in t2} == {"gemma-3-4b-pt"} and {c.lora.r for c in t2} == {16}
    t3 = embedded_grids["table3"]
    assert {(c.backbone.paper_name, c.backbone.name) for c in t3} == {
        ("gemma-3-4b-pt", "smollm2-135m"), ("gemma-2-9b", "gemma3-270m"), ("gemma-3-12b-pt", "gemma3-270m")}
    assert {(c.privacy.name, c.suite.name) for c in t3} == {("eps6", "math10k")}
    t4 = embedded_grids["table4"]
    assert {(c.lora.r, c.lora.alpha) for c in t4} == {(8, 16), (16, 16), (32, 16)}
    t5 = embedded_grids["table5"]
    assert {c.method.name for c in t5} == {"loraplus", "adamw", "prism"}
    assert all(c.train.benchmark.warmup == 10 and c.train.benchmark.measure == 30 for c in t5)
    assert {(c.suite.name, c.train.steps, c.train.batch_size, c.backbone.lora_layers, c.lora.dropout)
            for cs in embedded_grids.values() for c in cs} == {
        ("glue8", 30, 256, 1, 0.0),     # conf/scale/embedded.yaml, B from conf/suite_scale/glue8_embedded.yaml
        ("math10k", 15, 64, 1, 0.0),    # conf/suite_scale/math10k_embedded.yaml sets its own steps
        ("glue8", 0, 256, 1, 0.0), ("math10k", 0, 64, 1, 0.0)}  # Table 2's 0-step model (compose.REFERENCE_JOBS)


def test_paper_scale_budgets_are_table7() -> None:
    for suite, steps in (("glue8", 500), ("math10k", 300)):
        cfg = job_config(["experiment=table2", "scale=paper", f"suite={suite}", "method=adamw", "privacy=eps6"])
        assert cfg.train.steps == steps
        assert (cfg.train.batch_size, cfg.train.micro_batch_size, cfg.train.checkpoint_every) == (64, 4, 25)
        assert cfg.backbone.name == "gemma-3-4b-pt" and cfg.backbone.dtype == "bfloat16"
        assert cfg.backbone.lora_layers is None and cfg.lora.dropout == 0.05 and cfg.suite.eval_limit is None
        assert cfg.suite.cutoff_len == {"glue8": 384, "math10k": 256}[suite]
        assert cfg.suite.train_on_inputs == (suite == "math10k")


def test_prism_variants() -> None:
    released, paper = job_config(["method=prism"]).method, job_config(["method=prism_paper"]).method
    assert (released.floor_mode, released.floor_factor, released.debias) == ("scalar", 0.5, False)
    assert (paper.floor_mode, paper.floor_factor, paper.debias) == ("geometry", 1.0, True)
    assert job_config(["method=loraplus"]).method.loraplus_lr_ratio == 6.0


def test_unknown_option_lists_the_valid_ones() -> None:
    with pytest.raises(MissingConfigException) as err:
        job_config(["method=adam"])
    assert "Available options" in str(err.value) and "loraplus" in str(err.value)


def test_unknown_key_is_rejected() -> None:
    with pytest.raises(ConfigCompositionException, match="train.stepz"):
        job_config(["train.stepz=3"])


@pytest.mark.parametrize("override, field", [
    ("privacy.epsilon=0", "privacy.epsilon"), ("privacy.epsilon=-3", "privacy.epsilon"),
    ("privacy.delta=0", "privacy.delta"), ("privacy.delta=1.0", "privacy.delta"),
    ("privacy.delta=2", "privacy.delta"), ("train.batch_size=0", "train.batch_size"),
    ("train.micro_batch_size=512", "train.micro_batch_size"), ("method.lr=0.0", "method.lr"),
])
def test_bad_values_fail_with_one_line(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        check(job_config([override]))
    assert field in str(err.value) and "\n" not in str(err.value)


def test_non_dp_and_defaults_validate() -> None:
    check(job_config(["privacy=nondp"]))
    check(job_config([]))


PREFIX_SWITCHES_OFF = ("suite.decoding.shared_prefix=false", "suite.decoding.frozen_prefix=false")
"""The evaluation's prefix reuse switched off: the same greedy tokens (docs/DECISIONS.md D59), the same run."""


@pytest.mark.parametrize("override", PREFIX_SWITCHES_OFF)
def test_the_evaluation_prefix_switches_are_config_keys(override: str) -> None:
    """Each switch is composed on (true) and a user's ``false`` reaches the resolved config the evaluation reads;
    a value that is no boolean is refused naming the key."""
    key = override.split("=")[0]
    assert OmegaConf.select(check(job_config([])), key) is True
    assert OmegaConf.select(check(job_config([override])), key) is False
    with pytest.raises(ConfigError, match=key):
        check(job_config([f"{key}=sometimes"]))


def test_hash_ignores_bookkeeping_and_tracks_results() -> None:
    base = store.run_hash(job_config([]))
    assert store.run_hash(job_config([])) == base
    for same in ("logging=online", "launcher=slurm", "force=true", "results_dir=/elsewhere", *PREFIX_SWITCHES_OFF):
        assert store.run_hash(job_config([same])) == base, same
    renamed = job_config([])
    renamed.experiment = "another_experiment"
    assert store.run_hash(renamed) == base
    for different in ("method.lr=1e-3", "seed=1", "lora=r8", "scale=paper", "privacy=eps3", "train.steps=31"):
        assert store.run_hash(job_config([different])) != base, different


def test_hash_is_canonical() -> None:
    payload = identity.hash_payload(job_config([]))
    reordered = {k: payload[k] for k in reversed(list(payload))}
    assert store.run_hash(reordered) == store.run_hash(payload)
    assert len(store.run_hash(payload)) == identity.HASH_LEN


@pytest.mark.parametrize("launcher, target", [
    ("local", "BasicLauncher"), ("slurm", "SlurmLauncher"), ("submitit_local", "LocalLauncher")])
def test_launchers_select_the_hydra_plugin(launcher: str, target: str) -> None:
    from pipelines.config.compose import compose_config

    cfg = compose_config(["experiment=table5", f"launcher={launcher}"], with_hydra=True)
    assert cfg.hydra.launcher._target_.endswith(target)
    assert dict(cfg.hydra.sweeper.params) == {"method": "loraplus,adamw,prism"}
    if launcher == "slurm":
        assert cfg.hydra.launcher.max_num_timeout == 3 and cfg.hydra.launcher.gpus_per_node == 1


def test_paper_scale_uses_table8_learning_rates_unscaled() -> None:
    for method, suite, lr in (("adamw", "glue8", 2e-4), ("prism", "math10k", 3e-4), ("lamb", "glue8", 5e-3)):
        cfg = job_config([f"method={method}", f"suite={suite}", "scale=paper"])
        assert cfg.train.lr_multiplier == 1.0 and cfg.method.lr == lr
