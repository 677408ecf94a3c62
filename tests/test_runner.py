"""pipelines.runs.runner.execute with an injected trainer: skip, resume, force, lock, corrupt folders, W&B."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock
from omegaconf import DictConfig, OmegaConf

from pipelines.config.compose import job_config
from pipelines.runs import store
from pipelines.runs.runner import ConfigError, check, execute
from tests.oracles import read_metrics


class FakeTrainer:
    """Stands in for prism.train: checkpoints its step in run_dir/checkpoint, resumes from it,
    optionally dies at a given step (the contract of train_and_evaluate)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at, self.calls, self.resumed_from = fail_at, 0, []

    def __call__(self, cfg: DictConfig, run_dir: Path, log_fn: Any) -> dict[str, Any]:
        self.calls += 1
        ckpt = run_dir / "checkpoint" / "step.json"
        start = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
        self.resumed_from.append(start)
        for step in range(start + 1, cfg.train.steps + 1):
            if step == self.fail_at:
                raise RuntimeError(f"killed at step {step}")
            log_fn({"step": step, "loss": 1.0 / step, "sigma": 0.8, "epsilon_spent": 0.1 * step})
            ckpt.parent.mkdir(exist_ok=True)
            ckpt.write_text(json.dumps({"step": step}))
        return {"scores": {"SST-2": 0.75}, "sigma": 0.8, "epsilon_spent": 5.9, "steps": cfg.train.steps}


@pytest.fixture
def cfg(tmp_path: Path) -> DictConfig:
    return job_config([f"results_dir={tmp_path}", "logging=disabled", "train.steps=4"])


def read(folder: Path, name: str) -> Any:
    return json.loads((folder / name).read_text())


def test_fresh_run_writes_the_folder_format(cfg: DictConfig) -> None:
    trainer = FakeTrainer()
    assert execute(cfg, trainer) == "finished"
    folder = store.run_dir(cfg)
    assert folder.parent.name == "runs" and folder.name == store.run_hash(cfg)
    assert store.view(folder.parent, "adhoc") == [folder.name]
    assert OmegaConf.load(folder / "config.yaml") == cfg
    assert [r["step"] for r in read_metrics(folder)] == [1, 2, 3, 4]
    final = read(folder, "final.json")
    assert final["scores"] == {"SST-2": 0.75} and final["epsilon_spent"] == 5.9
    assert final["run"]["hash"] == folder.name and final["run"]["attempts"] == 1
    assert {"torch", "transformers", "peft", "opacus"} <= set(final["run"]["versions"])
    status = read(folder, "status.json")
    assert status["state"] == "finished" and status["error"] is None and status["ended"]


def test_finished_run_is_skipped_and_force_keeps_the_old_one(cfg: DictConfig) -> None:
    trainer = FakeTrainer()
    execute(cfg, trainer)
    assert execute(cfg, trainer) == "skipped" and trainer.calls == 1
    cfg.force = True
    assert execute(cfg, trainer) == "finished" and trainer.calls == 2
    old = list(store.run_dir(cfg).parent.glob("*.old-*"))
    assert len(old) == 1 and read(old[0], "final.json")["scores"] == {"SST-2": 0.75}
    assert trainer.resumed_from == [0, 0]  # the forced run starts from scratch


def test_failed_run_is_marked_and_resumes(cfg: DictConfig) -> None:
    with pytest.raises(RuntimeError, match="killed at step 3"):
        execute(cfg, FakeTrainer(fail_at=3))
    folder = store.run_dir(cfg)
    status = read(folder, "status.json")
    assert status["state"] == "failed" and "killed at step 3" in status["error"]
    assert "Traceback" in (folder / "traceback.txt").read_text()  # kept for the one-line CLI error
    assert store.inspect_run(folder).state == "incomplete"
    trainer = FakeTrainer()
    assert execute(cfg, trainer) == "finished"
    assert trainer.resumed_from == [2] and read(folder, "status.json")["attempts"] == 2
    assert [r["step"] for r in read_metrics(folder)] == [1, 2, 3, 4]


def test_locked_run_is_not_started_twice(cfg: DictConfig) -> None:
    folder = store.run_dir(cfg)
    folder.parent.mkdir(parents=True)
    trainer = FakeTrainer()
    with FileLock(store.lock_path(folder)):
        assert execute(cfg, trainer) == "busy"
    assert trainer.calls == 0 and not folder.exists()
    assert execute(cfg, trainer) == "finished"


def test_corrupt_folder_is_rerun_and_other_runs_untouched(cfg: DictConfig) -> None:
    execute(cfg, FakeTrainer())
    other_cfg = job_config([f"results_dir={cfg.results_dir}", "logging=disabled", "train.steps=4", "seed=7"])
    execute(other_cfg, FakeTrainer())
    other = store.run_dir(other_cfg)
    before = {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()}
    folder = store.run_dir(cfg)
    (folder / "final.json").write_text('{"scores": {"SST')  # half-written
    trainer = FakeTrainer()
    assert execute(cfg, trainer) == "finished" and trainer.calls == 1
    assert read(folder, "final.json")["scores"] == {"SST-2": 0.75}
    assert len(list(folder.glob("final.json.corrupt-*"))) == 1
    assert {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()} == before


def test_folder_with_a_different_config_is_moved_aside(cfg: DictConfig) -> None:
    folder = store.run_dir(cfg)
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(job_config(["seed=99"])))
    assert execute(cfg, FakeTrainer()) == "finished"
    assert len(list(folder.parent.glob("*.old-*"))) == 1


def test_invalid_config_fails_before_any_folder(cfg: DictConfig) -> None:
    cfg.privacy.epsilon = 0.0
    with pytest.raises(ConfigError, match="privacy.epsilon"):
        execute(check(cfg), FakeTrainer())
    assert not (Path(cfg.results_dir) / "runs").exists()


def wandb_records(path: Path) -> list[Any]:
    """Protobuf records of a W&B ``.wandb`` file (LevelDB log format: 7-byte file header, 32 KiB
    blocks, 7-byte chunk headers: crc32c u32, length u16, type u8 (1 full, 2 first, 3 mid, 4 last))."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, out, parts = path.read_bytes(), 32768, 7, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
            parts = b""
    return out


def test_offline_wandb_run_is_written_and_readable(tmp_path: Path) -> None:
    import wandb

    cfg = job_config([f"results_dir={tmp_path}", "logging=offline", "train.steps=3", "experiment=table2",
                      "method=adamw", "privacy=eps3"])
    try:
        assert execute(cfg, FakeTrainer()) == "finished"
    finally:
        wandb.teardown()
    run_id = f"table2-{store.run_hash(cfg)}"
    files = list((tmp_path / "wandb" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1
    records = wandb_records(files[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.run_id == run_id and run.run_group == "table2"
    assert {"method:adamw", "privacy:eps3", "suite:glue8", "rank:16", "scale:embedded"} <= set(run.tags)
    steps = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            steps[items["_step"]] = items
    assert sorted(steps) == [1, 2, 3] and steps[2]["loss"] == pytest.approx(0.5)


def test_the_trainer_flushes_subnormals_only_while_it_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    """D64's flush-to-zero covers the training call and no later arithmetic of the same process."""
    import torch

    import prism.train
    from pipelines.runs import runner

    subnormal = lambda: float(torch.tensor(1e-40, dtype=torch.float32) * 1.0)  # noqa: E731
    seen = {}

    def train(cfg, folder, log_fn, load=None):
        seen["during"] = subnormal()
        return {}

    monkeypatch.setattr(prism.train, "train_and_evaluate", train)
    assert runner.default_trainer(None, Path("."), lambda record: None) == {}
    assert seen["during"] == 0.0
    assert subnormal() > 0.0
