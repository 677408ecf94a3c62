"""`python -m pipelines <verb>`: the help lists every verb, each verb explains its arguments, and an
unknown verb or a bad argument is one ``error:`` line with exit code 2 and no traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.__main__ import VERBS, function, keys_of
from pipelines.__main__ import main as cli

REPO = Path(__file__).resolve().parents[1]


def _one_error_line(err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), lines[0]


def test_help_lists_every_verb_with_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "pipelines", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stderr == ""
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")}
    assert listed == set(VERBS)


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_verb_help_exits_0_and_names_its_arguments(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli([verb, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m pipelines {verb}") and len(out.splitlines()) > 3
    assert all((f"--{key.replace('_', '-')}" if default is False else f"{key}=") in out
               for key, default in keys_of(function(verb)).items())


def test_an_unknown_verb_is_one_line_exit_2() -> None:
    done = subprocess.run([sys.executable, "-m", "pipelines", "reproduce_table2"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    _one_error_line(done.stderr, "unknown verb 'reproduce_table2'", "reproduce", "--help")


def test_no_verb_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli([]) == 2
    _one_error_line(capsys.readouterr().err, "no verb")


@pytest.mark.parametrize("argv, words", [
    (["audit", "draws=abc"], ("draws=abc is not an integer",)),
    (["audit", "--frobnicate"], ("'--frobnicate'", "draws=")),
    (["aggregate", "experiment=table2", "runsdir=x"], ("'runsdir=x'", "runs_dir=")),
    (["reproduce", "scale=smoke"], ("needs experiment=",)),
    (["reproduce", "experiment=table9"], ("experiment=table9", "table2")),
    (["reproduce", "experiment=table2", "jobs=0"], ("jobs=0 must be an integer >= 1",)),
    (["compare", "task=/nonexistent.jsonl"], ("/nonexistent.jsonl: no such task file",)),
    (["compare", "eps=6"], ("needs task=",)),
    (["grid", "experiment=table2", "--frobnicate"], ("'--frobnicate'", "--pending")),
    (["wandb-sync", "--dry-run", "folder=/nonexistent/wandb"], ("folder=/nonexistent/wandb does not exist",)),
    (["gpu-check", "profile=huge"], ("profile=huge",)),
    (["migrate", "results_dir=/nonexistent/results"], ("results_dir=",)),
])
def test_a_bad_argument_is_one_line_exit_2(argv: list[str], words: tuple[str, ...],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    _one_error_line(captured.err, *words)


def test_debug_lets_the_error_through(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="draws=abc"):
        cli(["audit", "draws=abc", "--debug"])


LIGHT_VERBS = ("run", "reproduce", "grid", "tune", "select", "compare", "aggregate", "fetch-data", "wandb-sync", "migrate")
"""Verbs whose module loads without torch, so their arguments are checked before its import (seconds)."""


def test_light_verbs_check_their_arguments_before_importing_torch() -> None:
    code = ("import sys; from pipelines.__main__ import function\n"
            f"for verb in {LIGHT_VERBS!r}:\n"
            "    function(verb)\n"
            "    assert 'torch' not in sys.modules, verb + ' imported torch'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1:]


def _package_modules() -> list[str]:
    """Every module and subpackage under pipelines/, found by walking the source tree."""
    import pkgutil

    import pipelines

    return [m.name for m in pkgutil.walk_packages(pipelines.__path__, "pipelines.")]


@pytest.mark.parametrize("module", [m for m in _package_modules() if m != "pipelines.__main__"])
def test_running_a_module_of_the_package_exits_2_naming_the_verb_to_use(module: str) -> None:
    done = subprocess.run([sys.executable, "-W", "default", "-m", module, "table2"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    verbs = [v for v, (target, _) in VERBS.items() if target.split(":")[0] == module]
    _one_error_line(done.stderr, f"python -m {module} is not a command",
                    f"use: python -m pipelines {verbs[0] if verbs else '<verb>'} ")
