"""Bad input through the real command line: one line naming the field, exit code 2, no traceback,
no folder, no model built (in this process, Hugging Face's model constructor is watched).

Most cases call ``pipelines.__main__.main(["run", ...])`` in this process (the code path of ``python -m
pipelines run`` after interpreter start-up); a handful run as true subprocesses.
"""
from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import transformers

from pipelines.__main__ import main as cli
from pipelines.config.compose import experiment_jobs, job_config
from pipelines.config.validate import ConfigError, load_job
from pipelines.runs import runner
from prism.data.prompts import TruncatedLabelError

REPO = Path(__file__).resolve().parents[1]

# (overrides, the field the one-line message must name)
CASES: list[tuple[str, str]] = [
    # unknown keys, also added with + / ++ (silently stored and ignored before)
    ("+train.stpes=5", "train.stpes"),
    ("train.stpes=5", "train.stpes"),
    ("++lora.rank=8", "lora.rank"),
    ("+seeds=3", "seeds"),
    ("train.benchmark={warmup:1,measur:2}", "train.benchmark.measur"),
    ("train=3", "train"),
    ("~train.steps", "train.steps"),
    ("--frobnicate", "--frobnicate"),
    ("lr=1e-3", "method.lr"),
    ("=5", "key=value"),
    ("~privacy", "privacy"),
    ("seed=1,2", "-m"),
    ("--cfg job train.stpes=5", "train.stpes"),
    ("-m seed=1,2 train.steps=0", "train.steps"),
    # Hydra's own errors: unknown group option, bad syntax, interpolation to a missing value
    ("method=adam", "method"),
    ("backbone=llama-7b", "backbone"),
    ("suite=glue9", "suite"),
    ("experiment=table9", "experiment"),
    ("train.steps==3", "train.steps"),
    ("suite.scale=???", "suite.scale"),
    # types: ints are ints
    ("train.steps=2.5", "train.steps"),
    ("train.batch_size=abc", "train.batch_size"),
    ("seed=1.5", "seed"),
    ("method.lr=abc", "method.lr"),
    ("force=maybe", "force"),
    ("train.steps=null", "train.steps"),
    # ranges
    ("train.steps=0", "train.steps"),
    ("train.steps=-5", "train.steps"),
    ("train.batch_size=0", "train.batch_size"),
    ("train.checkpoint_every=0", "train.checkpoint_every"),
    ("train.eval_batch_size=0", "train.eval_batch_size"),
    ("privacy.epsilon=0", "privacy.epsilon"),
    ("privacy.epsilon=-1", "privacy.epsilon"),
    ("privacy.delta=0", "privacy.delta"),
    ("privacy.delta=1.5", "privacy.delta"),
    ("privacy.clip_norm=0", "privacy.clip_norm"),
    ("privacy.calibration=rounded", "privacy.calibration"),
    ("method.lr=-1", "method.lr"),
    ("method.betas=[0.9,1.5]", "method.betas"),
    ("lora.r=0", "lora.r"),
    ("lora.dropout=1.0", "lora.dropout"),
    ("lora.targets=[q_proj,qq_proj]", "lora.targets"),
    ("suite.cutoff_len=0", "suite.cutoff_len"),
    ("suite.decoding.num_beams=0", "suite.decoding.num_beams"),
    ("suite.embedded.tasks=[tweets]", "suite.embedded.tasks"),
    ("suite=math10k suite.decoding.math_eval_template=indented", "suite.decoding.math_eval_template"),
    ("suite.embedded.train_per_task=0", "suite.embedded.train_per_task"),
    ("suite=math10k suite.embedded.target=cot", "suite.embedded.target"),
    ("suite=math10k suite.decoding.max_new_tokens_per_task.basic_arithmetic=0",
     "suite.decoding.max_new_tokens_per_task"),
    ("train.device=tpu", "train.device"),
    ("train.prefix_cache=maybe", "train.prefix_cache"),
    ("logging.mode=verbose", "logging.mode"),
    ("experiment=table5 train.benchmark.measure=0", "train.benchmark.measure"),
    # cross-field rules
    ("privacy=eps6 privacy.epsilon=inf", "privacy.epsilon"),
    ("privacy=nondp privacy.epsilon=6", "privacy.epsilon"),
    ("privacy.name=custom", "privacy.name"),
    ("scale=paper suite.scale=embedded", "suite.scale"),
    ("method.name=adamw", "method.name"),
    ("lora.r=4096", "lora.r"),
    ("backbone=tiny-llama lora.r=64", "lora.r"),
    ("backbone.lora_layers=99", "backbone.lora_layers"),
    ("train.micro_batch_size=512", "train.micro_batch_size"),
    ("train.batch_size=100000", "train.batch_size"),
    ("backbone=tiny-llama suite=glue8", "suite.cutoff_len"),
    ("logging=online", "logging"),
    # a private selection's candidate (docs/PRIVACY.md "ε includes tuning")
    ("experiment=table2-accounted privacy=nondp", "privacy.selection"),
    ("experiment=table2-accounted protocol=released", "privacy.calibration"),
    ("experiment=table2-accounted scale=paper", "privacy.selection"),
    ("experiment=table2-accounted suite.validation_per_task=null", "suite.validation_per_task"),
    ("experiment=table2-accounted suite.eval_split=validation", "suite.eval_split"),
    ("experiment=table2-accounted train.benchmark={warmup:1,measure:2}", "train.benchmark"),
    ("experiment=table2-accounted privacy.selection.mean=0.5", "privacy.selection.mean"),
    ("experiment=table2-accounted privacy.selection.shape=-1", "privacy.selection.shape"),
    ("experiment=table2-accounted privacy.selection.score_noise=0", "privacy.selection.score_noise"),
    ("experiment=table2-accounted privacy.selection.score_noise=0.1", "privacy.selection"),
    ("experiment=table2-accounted privacy.selection.candidate=-1", "privacy.selection.candidate"),
    ("privacy.selection.candidate=1", "privacy.selection.mean"),
    # paper-scale data that is not there
    ("scale=paper", "suite.paper"),
    ("suite=math10k scale=paper", "suite.paper.train_file"),
]

SUBPROCESS_CASES: list[tuple[str, str]] = [
    ("+train.stpes=5", "train.stpes"),
    ("train.steps=2.5", "train.steps"),
    ("experiment=table2 privacy=eps6 privacy.epsilon=inf", "privacy.epsilon"),
    ("backbone=tiny-llama suite=glue8", "suite.cutoff_len"),
    ("-m experiment=table2 privacy.epsilon=0", "privacy.epsilon"),
]
CASES += [case for case in SUBPROCESS_CASES if case not in CASES]  # each also checked in process


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Empty caches and no W&B key, so 'data missing' and 'no key' are what this machine sees."""
    for name, sub in (("PRISM_CACHE", "cache"), ("HF_HOME", "hf"), ("NETRC", "no-netrc")):
        monkeypatch.setenv(name, str(tmp_path / sub))
    for name in ("HF_DATASETS_CACHE", "WANDB_API_KEY", "HYDRA_FULL_ERROR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    return tmp_path


def check_one_line(stderr: str, field: str, results: Path) -> None:
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and field in lines[0], lines[0]
    assert "Traceback" not in stderr
    assert not results.exists(), "a bad input created the results folder"


@pytest.mark.parametrize("overrides, field", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(overrides: str, field: str, isolated: Path,
                               capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def no_training(*_: object) -> None:  # a case that slipped past validation fails fast, not after a run
        raise AssertionError(f"{overrides!r} passed validation and reached the trainer")

    built: list[str] = []

    def no_model(model: Any, *_: Any, **__: Any) -> None:  # every Hugging Face model's constructor
        built.append(type(model).__name__)
        raise AssertionError(f"{overrides!r} built a {type(model).__name__} before refusing the input")

    monkeypatch.setattr(runner, "default_trainer", no_training)
    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", no_model)
    results = isolated / "results"
    code = cli(["run", *overrides.split(), f"results_dir={results}"])
    captured = capsys.readouterr()
    assert built == []
    assert code == 2
    check_one_line(captured.err, field, results)
    assert captured.out == ""


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU is visible")
def test_missing_gpu_is_one_line(isolated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = isolated / "results"
    assert cli(["run", "train.device=cuda", f"results_dir={results}"]) == 2
    check_one_line(capsys.readouterr().err, "train.device", results)


@pytest.mark.parametrize("overrides, field", SUBPROCESS_CASES, ids=[c[0] for c in SUBPROCESS_CASES])
def test_bad_input_through_a_subprocess(overrides: str, field: str, isolated: Path) -> None:
    """The same as a shell sees it (exit code, stderr); that nothing is built first is checked in process,
    for these cases too (:data:`CASES`)."""
    results = isolated / "results"
    proc = subprocess.run([sys.executable, "-m", "pipelines", "run", *overrides.split(), f"results_dir={results}"],
                          cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    check_one_line(proc.stderr, field, results)
    assert not (REPO / "multirun").exists() and not (REPO / "outputs").exists()


@pytest.mark.parametrize("switch", ["--debug", "HYDRA_FULL_ERROR=1"])
def test_debug_raises_instead(switch: str, isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--debug`` or ``HYDRA_FULL_ERROR=1``: the error propagates (Python prints its traceback)."""
    args = ["train.steps=2.5", f"results_dir={isolated / 'results'}"]
    if switch == "--debug":
        args.insert(0, switch)
    else:
        monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigError, match="train.steps"):
        cli(["run", *args])
    assert not (isolated / "results").exists()


def test_good_input_is_converted_not_refused(isolated: Path) -> None:
    """An int given for a float is that float; ε = inf under nondp, a null where a yaml has null,
    and keys set by another group option are accepted."""
    cfg = load_job(["method.lr=1", f"results_dir={isolated}"])
    assert type(cfg.method.lr) is float and cfg.method.lr == 1.0
    assert load_job(["privacy=nondp"]).privacy.epsilon == float("inf")
    assert load_job(["method.cond_max=null"]).method.cond_max is None
    assert load_job(["experiment=table5"]).train.benchmark == {"warmup": 10, "measure": 30}
    assert load_job(["backbone=tiny-llama", "suite.cutoff_len=1024"]).backbone.name == "tiny-llama"


@pytest.mark.parametrize("experiment", ["table2", "table3", "table4", "table5", "table2-accounted"])
def test_shipped_jobs_pass(experiment: str) -> None:
    """Known keys and types are derived from conf/, so the shipped grids validate unchanged (the
    last job of every table: a non-default backbone, suite, method or privacy level)."""
    job = experiment_jobs(experiment)[-1]
    assert load_job(job) == job_config(job)


@pytest.mark.parametrize("raised, code", [(RuntimeError("boom"), 1), (TruncatedLabelError("suite.cutoff_len=9 cuts"), 2)])
def test_a_failing_run_is_one_line_with_its_traceback_kept(raised: Exception, code: int, isolated: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Past validation, a failure in the core (a bug: exit 1; input only the core can see, such
    as a label cut off by the tokenizer: exit 2) is still one line; the traceback is kept."""
    def trainer(cfg: Any, folder: Path, log_fn: Any) -> dict[str, Any]:
        raise raised

    monkeypatch.setattr(runner, "default_trainer", trainer)
    handlers, level = logging.root.handlers[:], logging.root.level
    try:
        assert cli(["run", "logging=disabled", f"results_dir={isolated / 'results'}"]) == code
    finally:
        logging.root.handlers[:], logging.root.level = handlers, level
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and str(raised) in err and "Traceback" not in err
    assert "Traceback" in next((isolated / "results" / "runs").glob("*/traceback.txt")).read_text()


@pytest.mark.parametrize("sweep, single", [("methd=prism,adamw", "methd=prism"), ("train.stpes=1,2", "train.stpes=1"),
                                           ("+lora.alhpa=4,8", "+lora.alhpa=4")])
def test_a_comma_list_under_a_misspelt_key_names_the_key_not_the_sweep(sweep: str, single: str, isolated: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``-m`` would not help a key the schema does not know: the answer is the one its single value gets."""
    results = isolated / "results"
    assert cli(["run", single, f"results_dir={results}"]) == 2
    expected = capsys.readouterr().err
    assert "unknown key" in expected and "did you mean" in expected
    assert cli(["run", sweep, f"results_dir={results}"]) == 2
    assert capsys.readouterr().err == expected
    assert not results.exists()


def test_online_logging_with_the_server_unreachable_is_one_line_naming_offline_before_any_folder(
        isolated: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from pipelines.config import rules as config_rules

    with socket.socket() as closed:  # a port nothing listens on: the connection is refused at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    config_rules._wandb_problem.cache_clear()
    results = isolated / "results"
    assert cli(["run", "logging=online", f"results_dir={results}"]) == 2
    err = capsys.readouterr().err
    check_one_line(err, "logging=offline", results)
    assert f"127.0.0.1:{port}" in err
    config_rules._wandb_problem.cache_clear()


def test_a_wandb_init_that_fails_after_validation_is_one_line_naming_offline(
        isolated: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    from pipelines.config import rules as config_rules
    from pipelines.runs import wandb_log

    seen = {}

    def no_answer(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise wandb.errors.CommError("Run initialization has timed out after 30.0 sec.")

    monkeypatch.setattr(config_rules, "_wandb_problem", lambda reach: None)  # the server answered the check
    monkeypatch.setattr(wandb, "init", no_answer)
    monkeypatch.setattr(runner, "default_trainer", lambda *_: pytest.fail("trained without W&B"))
    assert cli(["run", "logging=online", f"results_dir={isolated / 'results'}"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: logging=online: ") and "logging=offline" in err, err
    assert seen["settings"].init_timeout == wandb_log.INIT_TIMEOUT_S


@pytest.mark.parametrize("key", ["results_dir", "logging.dir"])
@pytest.mark.parametrize("what", ["a file", "a symlink loop"])
def test_a_folder_key_that_names_no_folder_is_one_line_before_any_run_folder(
        key: str, what: str, isolated: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "default_trainer", lambda *_: pytest.fail(f"{key} as {what} reached the trainer"))
    bad = isolated / "bad"
    if what == "a file":
        bad.write_text("an earlier result")
    else:
        bad.symlink_to(isolated / "loop")
        (isolated / "loop").symlink_to(bad)
    results = isolated / "results" if key == "logging.dir" else bad
    assert cli(["run", "logging=offline", f"{key}={bad}", *([f"results_dir={results}"] * (key != "results_dir"))]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {key}={bad} is not a folder"), err
    assert not (isolated / "results").exists()


GRID_CELL = ["experiment=table2", "scale=smoke", "method=adamw", "privacy=eps6", "suite=glue8", "logging=disabled"]


@pytest.mark.parametrize("char", [",", "=", "[", "]", "{", "}", "'", '"', "\\", "$", "*", " "])
def test_a_path_with_a_character_hydra_reads_is_the_folder_named_or_one_line(char: str, isolated: Path,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``results_dir`` with one of Hydra's special characters, in a grid's plan (``pipelines grid``, which
    validates every job and trains none) and in one run's config: either every job's results_dir is the
    path typed, or exit 2 with one line naming the override as typed; never another folder."""
    named = str(isolated / f"res{char}ults")
    code = cli(["grid", *GRID_CELL, f"results_dir={named}"])
    out, err = capsys.readouterr()
    if code == 0:
        jobs = [shlex.split(line) for line in out.splitlines()]
        assert jobs and {str(job_config(job).results_dir) for job in jobs} == {named}
    else:
        assert code == 2
        check_one_line(err, f"results_dir={named}", Path(named))  # the override as typed, not a piece of it
    try:
        assert str(load_job([*GRID_CELL[1:], f"results_dir={named}"]).results_dir) == named
    except ConfigError as refusal:
        assert f"results_dir={named}" in str(refusal) and "\n" not in str(refusal)


def test_a_path_with_a_comma_quoted_as_the_refusal_says_is_one_folder(isolated: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    named = str(isolated / "a,b")
    assert cli(["grid", *GRID_CELL, f"results_dir={named}"]) == 2
    quoted = capsys.readouterr().err.split("e.g. '")[1].rstrip("'\n")
    assert quoted == f'results_dir="{named}"'
    assert cli(["grid", *GRID_CELL, quoted]) == 0
    job, _reference = [shlex.split(line) for line in capsys.readouterr().out.splitlines()]
    assert str(job_config(job).results_dir) == named
