"""The one command line of the pipelines: ``python -m pipelines <verb> [key=value ...] [--flags]``.

``python -m pipelines --help`` lists the verbs, ``python -m pipelines <verb> --help`` describes one.
A verb is a function (:data:`VERBS`) whose keyword-only parameters are its ``key=value`` arguments
(typed by their defaults; one without a default is required) and whose ``False``-default ones are its
``--flags``; a function that takes ``overrides`` gets every other ``key=value`` argument as a Hydra
override of ``conf/`` (``run`` also hands Hydra's own flags, ``-m``, ``--cfg job``, ..., to Hydra).
Bad input is one line ``error: <what>, <how to fix>`` on stderr with exit code 2 and no traceback
(:func:`main`), naming what the user typed (:func:`as_typed`); ``--debug`` (or ``HYDRA_FULL_ERROR=1``) lets
the error and its traceback through.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable, Collection, Sequence
from typing import Any

VERBS = {  # verb -> (its function, one line of help)
    "run": ("pipelines.verbs.run:command", "train one job (one run folder); -m: a Hydra multirun"),
    "reproduce": ("pipelines.verbs.reproduce:main", "a paper table: run its grid's unfinished jobs, then render it"),
    "tune": ("pipelines.verbs.tune:main", "learning-rate sweep on validation rows -> conf/tuned/<scale>.yaml"),
    "select": ("pipelines.verbs.select:main", "Table 2 with ε including the rate tuning: a private selection per cell"),
    "compare": ("pipelines.verbs.compare:main", "PRISM and the baselines on your task file, then the table"),
    "grid": ("pipelines.verbs.grid:main", "print a grid's jobs, one line of overrides each (slurm/submit.sh)"),
    "diagnostics": ("pipelines.verbs.diagnostics:main", "Table 1 and the mechanism figures (Figs. 1-4, 8-15)"),
    "aggregate": ("pipelines.verbs.aggregate:aggregate", "rebuild a table from the run store (or W&B) beside the paper's"),
    "audit": ("pipelines.verbs.audit:main", "step-level empirical privacy audit of every method"),
    "audit-run": ("pipelines.verbs.audit_run:main", "one-run audit of trained runs with canaries"),
    "gpu-check": ("pipelines.verbs.gpu_check:main", "Table 5, generate and resume on a random-init gemma-3-4b-pt"),
    "fetch-data": ("pipelines.verbs.fetch_data:main", "download and hash the paper-scale data and models (network)"),
    "wandb-sync": ("pipelines.verbs.wandb_sync:main", "upload the unsynced offline W&B runs"),
    "migrate": ("pipelines.verbs.migrate:main", "move old-layout run folders into the shared run store"),
}


MAKE_NAMES = "PIPELINES_MAKE_NAMES"  # set by the Makefile: "key=VAR ..." for each key=value it passes


def function(verb: str) -> Callable[..., int]:
    """The function of ``verb`` (its module imported now: ``--help`` of the verb list imports none)."""
    module, name = VERBS[verb][0].split(":")
    return getattr(importlib.import_module(module), name)


def keys_of(fn: Callable[..., int]) -> dict[str, Any]:
    """``fn``'s command-line keys and flags: its keyword-only parameters and their defaults."""
    return {n: p.default for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}


def convert(key: str, value: str, default: Any) -> Any:
    """``key=value`` text as the type of ``default`` (int, float; else the text); ``jobs=`` is the local
    launcher's worker count, an integer >= 1."""
    if key == "jobs":
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"jobs={value} must be an integer >= 1, e.g. jobs=2 (leave it out: as many as "
                             "the cores and the memory allow)")
        return int(value)
    if type(default) not in (int, float):
        return value
    try:
        return type(default)(value)
    except ValueError:
        raise ValueError(f"{key}={value} is not {'an integer' if type(default) is int else 'a number'}, "
                         f"e.g. {key}={default}") from None


def usage(verb: str, fn: Callable[..., int]) -> str:
    """``python -m pipelines <verb> ...`` with every key (its default), flag and the overrides."""
    words = [f"{k}=.." if d is inspect.Parameter.empty else f"[--{k.replace('_', '-')}]" if d is False
             else f"[{k}={'..' if d is None else d}]" for k, d in keys_of(fn).items()]
    overrides = ["[overrides]"] if "overrides" in inspect.signature(fn).parameters else []
    return " ".join(["usage: python -m pipelines", verb, *words, *overrides])


def parse(verb: str, fn: Callable[..., int], argv: Sequence[str]) -> tuple[list[Any], dict[str, Any]]:
    """``argv`` (after the verb, without ``--debug``) → ``fn``'s positional and keyword arguments;
    ``ValueError`` names the bad argument and what the verb takes."""
    keys = keys_of(fn)
    flags = {f"--{k.replace('_', '-')}": k for k, d in keys.items() if d is False}
    takes_overrides = "overrides" in inspect.signature(fn).parameters
    given: dict[str, Any] = {}
    overrides: list[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in keys and keys[key] is not False:
            given[key] = convert(key, value, keys[key])
        elif arg in flags:
            given[flags[arg]] = True
        elif takes_overrides and (verb == "run" or not arg.startswith("-")):  # run hands its --options to Hydra
            overrides.append(arg)
        else:
            known = [f"{k}=" for k in keys if k not in flags.values()] + list(flags)
            raise ValueError(f"unknown argument {arg!r} for {verb}, it takes "
                             f"{', '.join(known + ['overrides'] * takes_overrides) or 'no arguments'} "
                             f"(python -m pipelines {verb} --help)")
    if missing := [k for k, d in keys.items() if d is inspect.Parameter.empty and k not in given]:
        raise ValueError(f"{verb} needs {missing[0]}=, {usage(verb, fn).removeprefix('usage: ')}")
    return [overrides] if takes_overrides else [], given


def as_typed(line: str, fn: Callable[..., int], given: Collection[str]) -> str:
    """``line`` naming what the user typed for the keys ``given``: the override a key became by the key
    (``suite.custom.type=`` → ``type=``: the ``KEY_OVERRIDES`` of ``fn``'s module), then a key the Makefile
    passed by its make variable (``type=`` → ``TYPE=``: :data:`MAKE_NAMES`)."""
    overrides = getattr(inspect.getmodule(fn), "KEY_OVERRIDES", {})
    renames = [(override, key) for key, override in overrides.items() if key in given]
    made = dict(pair.split("=", 1) for pair in os.environ.get(MAKE_NAMES, "").split() if "=" in pair)
    renames += [(key, made[key]) for key in given if key in made]
    for old, new in renames:
        line = re.sub(rf"(?<![\w.]){re.escape(old)}=", f"{new}=", line)
    return line


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to its verb; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("error: no verb, e.g. python -m pipelines reproduce experiment=table2 (--help lists the verbs)",
              file=sys.stderr)
        return 2
    verb, rest = args[0], args[1:]
    if verb in ("-h", "--help"):
        width = max(map(len, VERBS))
        print("usage: python -m pipelines <verb> [key=value ...] [--flags]   (<verb> --help: its arguments)\n\nverbs:",
              *(f"  {name:<{width}}  {summary}" for name, (_, summary) in VERBS.items()),
              "\n--debug (any verb): the traceback of an error instead of one line", sep="\n")
        return 0
    if verb not in VERBS:
        close = difflib.get_close_matches(verb.replace("_", "-"), VERBS, n=1)
        print(f"error: unknown verb {verb!r}, " + (f"did you mean {close[0]}? " if close else "")
              + f"use one of {', '.join(VERBS)} (python -m pipelines --help)", file=sys.stderr)
        return 2
    fn = function(verb)
    if {"-h", "--help"} & set(rest):
        print(f"{usage(verb, fn)}\n\n{VERBS[verb][1]}.\n\n{inspect.getdoc(fn)}")
        return 0
    from pipelines.config.compose import COMPOSE_ERRORS, error_line

    debug = "--debug" in rest or os.environ.get("HYDRA_FULL_ERROR") == "1"
    keywords: dict[str, Any] = {}
    try:
        positional, keywords = parse(verb, fn, [a for a in rest if a != "--debug"])
        if "debug" in inspect.signature(fn).parameters:
            keywords["debug"] = debug
        return fn(*positional, **keywords)
    except COMPOSE_ERRORS as err:  # bad input (ValueError, ConfigError, Hydra/OmegaConf): one line
        if debug:
            raise
        print(f"error: {as_typed(error_line(err), fn, keywords)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
