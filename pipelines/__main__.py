"""The one command line of the pipelines: ``python -m pipelines <verb> [key=value ...] [--flags]``.

``python -m pipelines --help`` lists the verbs, ``python -m pipelines <verb> --help`` describes one.
Every argument is Hydra-style ``key=value``: a verb's own keys (its ``--help`` lists them) and, for
the verbs that compose run configs (run, reproduce, tune, compare, grid, diagnostics), any override
of ``conf/`` (docs/ARCHITECTURE.md). ``--flags`` are switches that no config key holds; ``run`` also
hands Hydra's own flags (``-m``, ``--cfg job``, ...) to Hydra. Bad input is one line
``error: <what>, <how to fix>`` on stderr with exit code 2 and no traceback (:func:`one_line`);
``--debug`` (or ``HYDRA_FULL_ERROR=1``) lets the error and its traceback through. Each verb's logic
lives in its module; this file only parses, checks and dispatches.
"""
from __future__ import annotations

import contextlib
import difflib
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

REQUIRED = object()  # a key without a default that the verb needs


class Outcome:
    """The exit code of the block :func:`one_line` wraps (2 after a bad input)."""

    code: int = 0


@contextlib.contextmanager
def one_line(debug: bool = False) -> Iterator[Outcome]:
    """Within: a bad input (``ValueError``, :class:`pipelines.validate.ConfigError` among them, or a
    Hydra/OmegaConf error) is printed as ``error: <message>`` on one line and the outcome's code is 2;
    with ``debug`` it propagates with its traceback."""
    from pipelines.compose import COMPOSE_ERRORS, error_line

    outcome = Outcome()
    try:
        yield outcome
    except COMPOSE_ERRORS as err:
        if debug:
            raise
        print(f"error: {error_line(err)}", file=sys.stderr)
        outcome.code = 2


def jobs_count(value: str) -> int:
    """``jobs=VALUE`` → the local launcher's worker count (an integer >= 1)."""
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"jobs={value} must be an integer >= 1, e.g. jobs=2 (leave it out: as many as "
                         "the cores and the memory allow)")
    return int(value)


def seed_list(value: str) -> list[int]:
    """``seed=1,2,3`` → the seeds."""
    seeds = [s.strip() for s in value.strip("[]").split(",") if s.strip()]
    if not seeds or not all(s.isdigit() for s in seeds):
        raise ValueError(f"seed={value} must list integers, e.g. seed=1,2,3")
    return [int(s) for s in seeds]


def number(kind: type) -> Callable[[str], Any]:
    """A converter of ``key=value`` text to ``kind`` (int or float); the key is named by :func:`parse`."""
    def convert(value: str) -> Any:
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"is not {'an integer' if kind is int else 'a number'}") from None
    return convert


@dataclass(frozen=True)
class Key:
    """A verb's own ``key=value`` argument: its default (None: not given, :data:`REQUIRED`: needed),
    one line of help and the converter of its text."""

    default: Any
    help: str
    convert: Callable[[str], Any] = str


@dataclass
class Args:
    """A parsed command line: the verb's keys (converted, defaults filled; keys without a default only
    when given), its flags, the Hydra overrides (in order) and the raw arguments after the verb."""

    keys: dict[str, Any]
    flags: set[str]
    overrides: list[str]
    argv: list[str]
    debug: bool

    def override(self, key: str, default: str) -> str:
        """The value of override ``key=`` (the last one given), else ``default``."""
        return next((o.split("=", 1)[1] for o in reversed(self.overrides) if o.startswith(f"{key}=")), default)


@dataclass(frozen=True)
class Verb:
    """One verb: a one-line summary, the usage after the verb, the handler, its keys and flags, and
    whether other ``key=value`` arguments are Hydra overrides (``hydra``: Hydra's flags too)."""

    summary: str
    usage: str
    handler: Callable[[Args], int]
    keys: Mapping[str, Key] = field(default_factory=dict)
    flags: Mapping[str, str] = field(default_factory=dict)
    overrides: bool = False
    hydra: bool = False


def parse(name: str, verb: Verb, argv: Sequence[str], debug: bool) -> Args:
    """``argv`` (after the verb, without ``--debug``) → :class:`Args`; ``ValueError`` names the bad argument."""
    keys = {k: key.default for k, key in verb.keys.items() if key.default is not None}
    flags, overrides = set(), []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in verb.keys:
            try:
                keys[key] = verb.keys[key].convert(value)
            except ValueError as err:
                raise ValueError(str(err) if str(err).startswith(key) else f"{arg} {err}, e.g. "
                                 f"{key}={verb.keys[key].default}") from None
        elif arg in verb.flags:
            flags.add(arg)
        elif verb.hydra or (verb.overrides and not arg.startswith("-")):
            overrides.append(arg)
        else:
            known = [f"{k}=" for k in verb.keys] + list(verb.flags) + (["Hydra overrides"] if verb.overrides else [])
            raise ValueError(f"unknown argument {arg!r} for {name}, it takes {', '.join(known) or 'no arguments'} "
                             f"(python -m pipelines {name} --help)")
    if missing := [k for k, v in keys.items() if v is REQUIRED]:
        raise ValueError(f"{name} needs {missing[0]}=, e.g. python -m pipelines {name} {verb.usage}")
    return Args(keys, flags, overrides, list(argv), debug)


# ------------------------------------------------------------------------------------------ verbs
def _run(a: Args) -> int:
    from pipelines import run

    return run.command(a.overrides, debug=a.debug)


def _launcher_refused(a: Args) -> int | None:
    """The launcher's exit code when it cannot take jobs here (checked before a grid is validated)."""
    from pipelines import launch

    return launch.launcher_error(a.override("launcher", "local"))


def _reproduce(a: Args) -> int:
    from pipelines import reproduce

    return _launcher_refused(a) or reproduce.main(a.keys["experiment"], a.overrides, a.keys.get("jobs"),
                                                  a.override("launcher", "local"))


def _tune(a: Args) -> int:
    from pipelines import tune

    task = {k: v for k, v in a.keys.items() if k in TASK}
    return _launcher_refused(a) or tune.main(tune.sweep_overrides(task, a.overrides), a.keys.get("jobs"),
                                             a.override("launcher", "local"), a.override("scale", "embedded"),
                                             ["python", "-m", "pipelines", "tune", *a.argv])


def _compare(a: Args) -> int:
    from pipelines import compare

    return _launcher_refused(a) or compare.main(compare.plan(a.keys, a.overrides, a.override("launcher", "local")))


def _grid(a: Args) -> int:
    from pipelines import grid

    return grid.main(a.keys["experiment"], a.overrides, pending="--pending" in a.flags, remote="--remote" in a.flags)


def _diagnostics(a: Args) -> int:
    from pipelines import diagnostics
    from pipelines.compose import compose_config
    from pipelines.run import setup_logging

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = compose_config(["experiment=diagnostics", *a.overrides])
    setup_logging()
    return diagnostics.reproduce(cfg)


def _aggregate(a: Args) -> int:
    from pipelines.aggregate import aggregate

    aggregate(**a.keys)
    return 0


def _audit(a: Args) -> int:
    from pipelines import audit

    return audit.main(**a.keys)


def _audit_run(a: Args) -> int:
    from pipelines import audit_run

    return audit_run.main(**a.keys, split="--split" in a.flags, control="--no-control" not in a.flags,
                          expected_only="--expected-only" in a.flags)


def _gpu_check(a: Args) -> int:
    from pipelines import gpu_check

    return gpu_check.main(**a.keys)


def _fetch_data(a: Args) -> int:
    from pipelines import fetch_data

    return fetch_data.main(**a.keys, force="--force" in a.flags)


def _wandb_sync(a: Args) -> int:
    from pipelines import wandb_sync

    return wandb_sync.main(a.keys["dir"], dry_run="--dry-run" in a.flags)


def _migrate(a: Args) -> int:
    from pipelines import store

    return store.main(a.keys["results_dir"])


JOBS = {"jobs": Key(None, "local worker processes (default: what the cores and the memory allow)", jobs_count)}
TASK = {"task": Key(None, "your task file (.jsonl/.csv of prompt/target rows)"),
        "eval": Key(None, "its evaluation file (default: a fixed held-out part of the task file)"),
        "type": Key(None, "classification | number | exact (default: from the rows)"),
        "labels": Key(None, "the class labels, comma-separated"),
        "model": Key(None, "a local model folder (backbone=local)"),
        "methods": Key(None, "comma-separated methods (default: all six)"),
        "eps": Key(None, "privacy budgets, inf for non-DP (default: inf,6,3)")}
EXPERIMENT = "experiment=table2|table3|table4|table5"
VERBS: dict[str, Verb] = {
    "run": Verb("train one job (a run folder); -m: a Hydra multirun", "[overrides] [-m] [--cfg job]", _run,
                overrides=True, hydra=True),
    "reproduce": Verb("a paper table: run its grid's unfinished jobs, then render it",
                      f"{EXPERIMENT} [scale=embedded|paper] [launcher=local|slurm] [jobs=K] [seed=42,43] [overrides]",
                      _reproduce, {"experiment": Key(REQUIRED, "the table's grid"), **JOBS}, overrides=True),
    "tune": Verb("learning-rate sweep on validation rows -> conf/tuned/<scale>.yaml (task=: your task's rates)",
                 "[scale=..] [launcher=..] [jobs=K] [seed=N] [task=FILE.jsonl and compare's keys] [overrides]",
                 _tune, {**JOBS, **TASK}, overrides=True),
    "compare": Verb("PRISM and the baselines on your task: methods x privacy settings x seeds, then the table",
                    "task=FILE.jsonl [model=DIR] [methods=..] [eps=inf,6,3] [seed=1,2] [jobs=K] [overrides]",
                    _compare, {**TASK, "task": Key(REQUIRED, TASK["task"].help),
                               "seed": Key(None, "seeds, comma-separated (default: the config's)", seed_list), **JOBS},
                    overrides=True),
    "grid": Verb("print a grid's jobs, one line of shell-quoted overrides each (for slurm/submit.sh)",
                 "experiment=tableN|compare|tune [overrides] [--pending] [--remote]", _grid,
                 {"experiment": Key(REQUIRED, "the grid")},
                 {"--pending": "leave out the runs already finished (they are tagged into the grid's view)",
                  "--remote": "the jobs run on other machines (SLURM): do not check this machine's device"},
                 overrides=True),
    "diagnostics": Verb("Table 1 and the mechanism figures (Figs. 1-4, 8-15) -> results/figures",
                        "[scale=embedded|paper] [suite=..] [overrides]", _diagnostics, overrides=True),
    "aggregate": Verb("rebuild a table from the run store (or W&B) beside the paper's numbers",
                      f"{EXPERIMENT}|all [source=runs|wandb] [runs_dir=..] [out_dir=..] [scale=..] [protocol=..]",
                      _aggregate,
                      {"experiment": Key(REQUIRED, "the table, or all"),
                       "source": Key("runs", "runs (the run store) or wandb"),
                       "runs_dir": Key("results/runs", "the run store"),
                       "out_dir": Key("results/tables", "where the tables go"),
                       "wandb_project": Key("prism-dp-lora", "W&B project (source=wandb)"),
                       "wandb_entity": Key("", "W&B entity (source=wandb)"),
                       "scale": Key("", "one scale (default: every scale the runs have)"),
                       "protocol": Key("", "corrected | released (default: every protocol the runs have)")}),
    "audit": Verb("step-level empirical privacy audit of every method; exit 1 if a mu lower bound exceeds 1/sigma",
                  "[draws=2000] [sigma=0.6] [methods=..] [cases=..] [workers=2]", _audit,
                  {"draws": Key(2000, "noise draws per side", number(int)),
                   "sigma": Key(0.6, "noise multiplier", number(float)),
                   "methods": Key(None, "comma-separated methods (default: all)"),
                   "cases": Key(None, "comma-separated canary cases (default: all)"),
                   "workers": Key(2, "worker processes", number(int))}),
    "audit-run": Verb("one-run audit of trained runs with canaries; exit 1 if a bound exceeds the claimed eps",
                      "[scale=embedded] [methods=prism,adamw] [epsilons=6,3] [canaries=1000] [k_pos=100] [k_neg=0] "
                      "[seed=0] [out=results/tables] [--split] [--no-control] [--expected-only]", _audit_run,
                      {"scale": Key("embedded", "embedded | smoke"), "methods": Key("prism,adamw", "methods"),
                       "epsilons": Key("6,3", "privacy budgets"),
                       "canaries": Key(1000, "m, the canaries", number(int)),
                       "k_pos": Key(100, "'in' guesses on the highest scores", number(int)),
                       "k_neg": Key(0, "'out' guesses on the lowest scores", number(int)),
                       "seed": Key(0, "seed of the coins, directions and canary sampling", number(int)),
                       "out": Key("results/tables", "where the table goes")},
                      {"--split": "choose (k_pos, k_neg) on one half of the canaries, audit the other half",
                       "--no-control": "skip the non-private control rows",
                       "--expected-only": "print what correct runs' audits give (simulated, no training)"}),
    "gpu-check": Verb("Table 5, generate and resume on a random-init gemma-3-4b-pt (GPU; profile=tiny on a CPU)",
                      "[profile=paper|sim|tiny] [device=cuda|cpu] [methods=prism,adamw]", _gpu_check,
                      {"profile": Key("paper", "paper (GPU) | sim | tiny (CPU)"),
                       "device": Key(None, "cuda | cpu (default: the profile's)"),
                       "methods": Key(None, "a comma-separated subset of adamw,loraplus,prism (default: all)")}),
    "fetch-data": Verb("download and hash the paper-scale data and models into the local cache (network)",
                       "[only=glue|math|models] [--force]", _fetch_data,
                       {"only": Key(None, "fetch one part only: glue | math | models"),
                        "llm_adapters": Key(None, "raw-file base URL of LLM-Adapters (default: GitHub)"),
                        "math_train": Key(None, "URL of math_10k.json (default: LLM-Adapters')")},
                       {"--force": "refetch files that are already cached"}),
    "wandb-sync": Verb("upload the unsynced offline W&B runs of a results folder", "[dir=results/wandb] [--dry-run]",
                       _wandb_sync, {"dir": Key("results/wandb", "the offline W&B folder")},
                       {"--dry-run": "list the runs, upload nothing"}),
    "migrate": Verb("move old-layout run folders into the shared run store", "[results_dir=results]", _migrate,
                    {"results_dir": Key("results", "the folder that holds runs/")}),
}


def usage() -> str:
    """The verbs, one line each."""
    width = max(map(len, VERBS))
    return "\n".join(["usage: python -m pipelines <verb> [key=value ...] [--flags]   (<verb> --help: its arguments)",
                      "", "verbs:", *(f"  {name:<{width}}  {verb.summary}" for name, verb in VERBS.items()), "",
                      "--debug (any verb): show the traceback of an error instead of one line"])


def verb_help(name: str, verb: Verb) -> str:
    """A verb's arguments: its keys with their defaults, its flags, and whether it takes overrides."""
    rows = {f"{k}={'' if key.default in (None, REQUIRED) else key.default}":
            key.help + (" (required)" if key.default is REQUIRED else "") for k, key in verb.keys.items()}
    rows.update({**verb.flags, "--debug": "show the traceback of an error"})
    width = max(map(len, rows))
    lines = [f"usage: python -m pipelines {name} {verb.usage}", "", verb.summary, "",
             *(f"  {left:<{width}}  {text}" for left, text in rows.items())]
    if verb.overrides:
        lines += ["  other key=value: overrides of conf/ (Hydra syntax); a value with spaces or non-ASCII characters",
                  "  is quoted for Hydra inside one shell word, e.g. 'results_dir=\"/tmp/my runs\"'"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to its verb; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("error: no verb, e.g. python -m pipelines reproduce experiment=table2 (--help lists the verbs)",
              file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in VERBS:
        close = difflib.get_close_matches(name.replace("_", "-"), VERBS, n=1)
        print(f"error: unknown verb {name!r}, " + (f"did you mean {close[0]}? " if close else "")
              + f"use one of {', '.join(VERBS)} (python -m pipelines --help)", file=sys.stderr)
        return 2
    verb = VERBS[name]
    if {"-h", "--help"} & set(rest):
        print(verb_help(name, verb))
        return 0
    debug = "--debug" in rest or os.environ.get("HYDRA_FULL_ERROR") == "1"
    with one_line(debug) as outcome:
        outcome.code = verb.handler(parse(name, verb, [a for a in rest if a != "--debug"], debug))
    return outcome.code


if __name__ == "__main__":
    sys.exit(main())
