"""A method is one class and one yaml, registered by name: the shipped ones by the registry's list
(their run hashes unchanged), one defined outside ``prism/`` and ``pipelines/`` by its yaml's
``_target_`` (``tests/toy_method/``). The outside one trains through ``pipelines.runs.runner`` and is its
own labelled row of the aggregated table; behaviour reads the traits, never a name."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from pipelines import tables as agg
from pipelines.config.grids import default_methods
from pipelines.config.validate import ConfigError, load_job
from pipelines.verbs import run
from prism.methods import registry, schema

TOY = Path(__file__).resolve().parent / "toy_method"
TINY = ["backbone=tiny-llama", "backbone.lora_layers=null", "train.steps=2", "train.batch_size=4",
        "train.micro_batch_size=2", "train.checkpoint_every=1", "suite=glue8", "suite.eval_limit=2",
        "suite.cutoff_len=1024", "suite.embedded.train_per_task=16", "logging=disabled"]


@pytest.fixture
def toy_method(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``tests/toy_method/toy_sgd.yaml`` in Hydra's in-process config store as ``method=toy_sgd``; the
    registry forgets the class afterwards."""
    monkeypatch.setattr(registry, "_loaded", {})
    ConfigStore.instance().store(group="method", name="toy_sgd", node=OmegaConf.load(TOY / "toy_sgd.yaml"))
    yield
    ConfigStore.instance().repo["method"].pop("toy_sgd.yaml")


@pytest.mark.parametrize("name", registry.names())
def test_each_shipped_method_is_its_class_and_its_config_dataclass(name: str) -> None:
    cls = registry.lookup(name)
    assert cls.name == name and cls.config_class is registry.config_class(name)
    node = load_job([f"method={name}"]).method  # every key and no other: no _target_, the run hashes stay
    assert set(node) == {f.name for f in fields(cls.config_class)}


def test_traits_decide_what_names_used_to() -> None:
    tangent = [n for n in registry.names() if registry.lookup(n).tangent]
    assert tangent == ["prism", "prism_paper"]
    assert [n for n in registry.names() if registry.lookup(n).factors != ("lora_A", "lora_B")] == ["ffa"]
    assert default_methods() == ["prism", "adamw", "loraplus", "lamb", "ffa", "lora_rite"]


def test_an_unknown_method_or_target_is_one_line_naming_the_fix() -> None:
    with pytest.raises(schema.SchemaError, match=r"^method.name='nope' is not a method, choose method="):
        registry.check({"name": "nope", "lr": 1.0})
    with pytest.raises(schema.SchemaError, match=r"^method._target_=no.such.Class cannot be imported"):
        registry.check({"name": "nope", "lr": 1.0, "_target_": "no.such.Class"})
    with pytest.raises(schema.SchemaError, match=r"is the method 'prism', not 'nope'"):
        registry.check({"name": "nope", "lr": 1.0, "_target_": "prism.methods.prism.PrismMethod"})


def test_a_method_outside_prism_trains_through_the_runner_and_is_its_own_row(
        tmp_path: Path, toy_method: None) -> None:
    with pytest.raises(ConfigError, match=r"^method.momentum=1.5 must be in \[0, 1\) \(SGD momentum\)"):
        load_job(["method=toy_sgd", "method.momentum=1.5"])
    results = tmp_path / "results"
    for method in ("toy_sgd", "adamw"):
        assert run.command([f"method={method}", "privacy=eps6", *TINY, f"results_dir={results}"]) == 0
    records = agg.read_run_folders(results / "runs", "adhoc")
    assert sorted(r.state for r in records) == ["finished", "finished"]
    toy = next(r for r in records if r.get("method.name") == "toy_sgd")
    assert toy.final.epsilon_spent <= 6.0 and toy.get("method._target_") == "tests.toy_method.toy.ToySGDMethod"
    table = agg.build_table(agg.SPECS["table2"], records, str(toy.get("suite.scale"))).frame
    rows = table[table["Setting"] == "ε=6"].set_index("Method")
    assert {"Toy SGD", "AdamW"} <= set(rows.index)
    assert rows.loc["Toy SGD", "SST-2"] == pytest.approx(toy.final.columns["SST-2"])
