"""Every grid entry point validates every job with the runner's validator before launching any.

Entry points: ``python -m pipelines grid`` (the job list of ``slurm/submit.sh``), ``... reproduce``
(local pool and the submitit path), ``slurm/submit.sh`` (also ``--dry-run``) and ``... run -m``
(Hydra multirun, e.g. ``launcher=slurm``). The expectation each test checks: the first bad job is
one ``error:`` line naming that job (its overrides) and the field, exit code 2, nothing on stdout
that looks like a job, and no folder under ``results_dir``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import HydraException
from omegaconf import OmegaConf

from pipelines.__main__ import main as cli
from pipelines.config.compose import compose_config, compose_job, experiment_jobs, job_config
from pipelines.config.validate import ConfigError, load_grid, load_job
from pipelines.runs import launch

REPO = Path(__file__).resolve().parents[1]


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_grid_stops_at_the_first_bad_job_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Table 2's grid: PRISM jobs come first (method is the outer axis); an override only PRISM
    takes is unknown to the first AdamW job, which must be the one named (job 7 of 38)."""
    assert cli(["grid", "experiment=table2", "method.horizontalize=none", f"results_dir={tmp_path}"]) == 2
    out = capsys.readouterr()
    line = _one_error_line(out.err)
    assert out.out == ""
    assert "job 7 of 38" in line and "method=adamw" in line and "method.horizontalize" in line
    assert not any(tmp_path.iterdir())


def test_grid_bad_value_for_every_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["grid", "experiment=table2", "train.steps=abc", f"results_dir={tmp_path}"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "job 1 of 38" in line and "train.steps" in line
    assert not any(tmp_path.iterdir())


def test_grid_typo_says_did_you_mean_not_plus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["grid", "experiment=table2", "train.stpes=5", f"results_dir={tmp_path}"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "did you mean train.steps" in line and "+train" not in line


def test_grid_help_and_unknown_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["grid", "experiment=table2", "--help"]) == 0
    assert "usage:" in capsys.readouterr().out
    assert cli(["grid", "experiment=table2", "--frobnicate"]) == 2
    assert "--frobnicate" in _one_error_line(capsys.readouterr().err)


def test_reproduce_launches_nothing_for_a_bad_job(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[object] = []
    monkeypatch.setattr(launch, "launch", lambda *a, **k: launched.append(a) or (True, ""))
    monkeypatch.setattr(launch, "slurm_problem", lambda: None)  # a reachable cluster: the grid is validated
    for launcher in ("local", "slurm"):
        assert cli(["reproduce", "experiment=table2", "train.steps=abc", f"launcher={launcher}", f"results_dir={tmp_path}"]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert "job 1 of 38" in line and "train.steps" in line
    assert launched == [] and not any(tmp_path.iterdir())


def test_reproduce_paper_scale_without_data_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path / "no-cache"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "no-hf"))
    assert cli(["reproduce", "experiment=table2", "scale=paper", f"results_dir={tmp_path / 'r'}"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "job 1 of 38" in line and "make data" in line and "runs_dir" not in line
    assert not (tmp_path / "r").exists()


def test_reproduce_help_is_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["reproduce", "experiment=table2", "scale=embedded", "--help"]) == 0
    assert "usage: python -m pipelines reproduce" in capsys.readouterr().out


def test_multirun_validates_every_job_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m pipelines run -m`` (the path reproduce takes for launcher=slurm/submitit_local)."""
    assert cli(["run", "-m", "experiment=table2", "method.horizontalize=none", "launcher=submitit_local",
                     f"results_dir={tmp_path}"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "job 7 of 36" in line and "method.horizontalize" in line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("dry_run", [True, False])
def test_submit_sh_submits_nothing_for_a_bad_job(dry_run: bool, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!/usr/bin/env bash\ntouch {tmp_path / 'sbatch-called'}\necho 1\n")
    sbatch.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PRISM_PYTHON": sys.executable,
           "PRISM_SLURM_DIR": str(tmp_path / "slurm")}
    args = [*(["--dry-run"] if dry_run else []), "table2", "train.steps=abc", f"results_dir={tmp_path / 'r'}"]
    done = subprocess.run([str(REPO / "slurm" / "submit.sh"), *args], env=env, capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert done.returncode == 2
    line = _one_error_line(done.stderr)
    assert "job 1 of 38" in line and "train.steps" in line and "would be submitted" not in done.stdout
    assert not (tmp_path / "sbatch-called").exists() and not (tmp_path / "slurm").exists()
    assert not (tmp_path / "r").exists()


def test_fast_composition_equals_hydras() -> None:
    """A job composed from its groups' cached composition plus its value overrides (as Hydra applies
    them) is Hydra's own composition of the whole command line."""
    extra = ["train.steps=3", "method.lr=0.001", "++seed=7", "suite.decoding.num_beams=2"]
    for experiment in ("table2", "table5"):
        for job in experiment_jobs(experiment, extra)[::7]:
            cfg = load_job(job)
            assert OmegaConf.to_container(cfg) == OmegaConf.to_container(job_config(job)), job


VALUE_OVERRIDES = (["+train.new_key=3"], ["++train.steps=3"], ["++train.new_key=3"], ["train.steps=null"],
                   ["+train.benchmark={warmup: 1, measure: 2}"], ["+train={steps: 5}"],
                   ["suite.decoding={num_beams: 3}"], ["method=adamw", "suite.decoding.num_beams=[1,2]"])


@pytest.mark.parametrize("job", VALUE_OVERRIDES, ids=" ".join)
def test_each_kind_of_value_override_composes_as_hydra_does(job: list[str]) -> None:
    """Adding (``+``), forcing (``++``), setting, nulling and merging a mapping into a mapping: the cached
    composition with the value applied is Hydra's composition of the whole command line."""
    assert OmegaConf.to_container(compose_job(job)) == OmegaConf.to_container(job_config(job))


@pytest.mark.parametrize("override", ["+train.steps=3", "train.steps@train=3"])
def test_value_overrides_hydra_refuses_are_refused_naming_them(override: str) -> None:
    """``+key`` of a key that has a value, and a package on a key that is no group: Hydra's composition refuses
    them, and so does the cached one, with one line naming the override."""
    with pytest.raises(HydraException):
        compose_config([override])
    with pytest.raises(ConfigError, match=re.escape(override)):
        compose_job([override])


def test_a_remote_job_is_not_checked_against_this_machines_device() -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: train.device=cuda is valid here too")
    with pytest.raises(ConfigError, match="train.device"):
        load_job(["train.device=cuda"])
    assert load_job(["train.device=cuda"], here=False).train.device == "cuda"
    with pytest.raises(ConfigError, match="job 1 of 1"):
        load_grid([["train.device=cuda"]])
    assert len(load_grid([["train.device=cuda", "launcher=slurm"]])) == 1


@pytest.mark.parametrize("argv", [["results_dir=/tmp/my", "runs"], ["results_dir=/tmp/ü"], ["experiment=täble"]])
def test_unquoted_values_say_how_to_quote(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A value split at a space by the shell, or with non-ASCII characters, is refused with the
    quoting that works (Hydra's quotes inside one shell word), not "write key=value"."""
    assert cli(["run", *argv]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "quote" in line and 'results_dir="/tmp/my runs"' in line and "Lexer" not in line


def test_the_quoting_hint_works() -> None:
    """The quoted form the hint gives parses to the intended values."""
    assert load_job(['results_dir="/tmp/my runs"']).results_dir == "/tmp/my runs"
    assert load_job(["results_dir='/tmp/ü'"]).results_dir == "/tmp/ü"


def test_a_grid_that_names_one_run_twice_lists_it_once() -> None:
    """``seed=42,42 method=adamw,adamw`` is one trained run, planned once, beside its one 0-step reference; two
    distinct seeds stay two runs and two references."""
    from pipelines.config.validate import load_experiment

    fixed = ["scale=smoke", "privacy=nondp", "suite=glue8"]
    once = load_experiment("table2", [*fixed, "seed=42,42", "method=adamw,adamw"])
    assert [cfg.train.steps for _, cfg in once] == [2, 0]
    assert len(load_experiment("table2", [*fixed, "seed=42,43", "method=adamw"])) == 4


@pytest.mark.parametrize(("experiment", "command"), [
    ("tune", "python -m pipelines tune launcher=slurm"),
    ("table2-accounted", "python -m pipelines select launcher=slurm"),
    ("diagnostics", "python -m pipelines diagnostics"),
])
def test_a_slurm_plan_of_an_experiment_that_is_not_a_job_list_names_its_command(
        experiment: str, command: str, tmp_path: Path) -> None:
    """``slurm/submit.sh --dry-run`` (no SLURM needed) of an experiment whose jobs depend on earlier
    results (tune's edge rounds, a private selection's drawn candidates) or that is one measurement
    (diagnostics): no job list, one line with the command that runs it and the user's overrides."""
    env = {**os.environ, "PRISM_PYTHON": sys.executable, "PRISM_SLURM_DIR": str(tmp_path / "slurm")}
    done = subprocess.run([str(REPO / "slurm" / "submit.sh"), "--dry-run", experiment, "scale=smoke",
                           f"results_dir={tmp_path}"], env=env, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2 and done.stdout == ""
    line = _one_error_line(done.stderr)
    assert f"experiment={experiment} is not a list of independent jobs" in line
    assert line.endswith(f"{command} scale=smoke results_dir={tmp_path}")
    assert not any(tmp_path.iterdir())
