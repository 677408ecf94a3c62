"""The grids of the verbs that plan their own jobs: a user's task as overrides (``python -m pipelines compare``,
``tune task=``, ``grid experiment=compare``; docs/custom-task.md), the privacy settings of ``eps=``, the cells
of the Table 2 grid (``tune``, ``select``) and the comma-separated lists they are given."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.config.compose import hydra_value
from prism.data.custom import file_id
from prism.methods import registry

EXPERIMENT = "compare"  # the experiment of a user's task: conf/experiment/compare.yaml, its view in the store
KEY_OVERRIDES = {"task": "suite.custom.train", "eval": "suite.custom.eval", "type": "suite.custom.type",
                 "labels": "suite.custom.labels", "model": "backbone.path", "methods": "method"}
"""The override each key of ``python -m pipelines compare`` (and of ``tune``'s task sweep) becomes; an error line about the
override names the key the user typed (:func:`pipelines.__main__.as_typed`)."""
EPSILONS = (math.inf, 6.0, 3.0)
PRIVACY_GROUPS = {math.inf: "nondp", 6.0: "eps6", 3.0: "eps3"}


def privacy_overrides(epsilon: float) -> list[str]:
    """The overrides of one privacy setting: the shipped group for ∞/6/3, else ε=6's group at this ε."""
    if epsilon in PRIVACY_GROUPS:
        return [f"privacy={PRIVACY_GROUPS[epsilon]}"]
    return ["privacy=eps6", f"privacy.epsilon={epsilon:g}", f"privacy.name=eps{epsilon:g}"]


@dataclass(frozen=True)
class Kind:
    """What each item of a comma-separated list is: its parse (``ValueError`` if the text is not one), its name
    in an error line and an example list."""

    parse: Callable[[str], Any]
    noun: str
    example: str


def _budget(text: str) -> float:
    return math.inf if text.lower() in ("inf", "nondp", "non-dp") else float(text)


NAMES = Kind(str, "a name", "a,b")
INTEGERS = Kind(int, "an integer", "42,43")
NUMBERS = Kind(float, "a number", "6,3")
BUDGETS = Kind(_budget, "a number or inf (non-DP)", "inf,6,3")


def comma_list(value: str, key: str, kind: Kind = NAMES, choices: Sequence[str] | None = None) -> list[Any]:
    """The items of ``key=value``, a comma-separated list as typed (``[a,b]`` as Hydra writes a list), each
    parsed by ``kind`` and, with ``choices``, one of them; ``ValueError`` on one line naming ``key=`` as typed,
    the item at fault and a list that works, when it lists nothing or an item that does not parse or is no choice."""
    texts = [v.strip() for v in str(value).strip().strip("[]").split(",") if v.strip()]
    among = f" among {','.join(choices)}" if choices else ""
    fix = f"give a comma-separated list{among}, e.g. {key}={','.join(choices[:2]) if choices else kind.example}"
    if not texts:
        raise ValueError(f"{key}={value} lists nothing; {fix}")
    if choices and (unknown := [t for t in texts if t not in choices]):
        raise ValueError(f"{key}={value}: {', '.join(unknown)} is not a choice; {fix}")
    items = []
    for text in texts:
        try:
            items.append(kind.parse(text))
        except ValueError:
            raise ValueError(f"{key}={value}: {text!r} is not {kind.noun}; {fix}") from None
    return items


def quoted(text: str) -> str:
    """``text`` as a quoted Hydra string, so ``labels=true,false`` or ``1,2,3`` stay the text typed (unquoted,
    Hydra reads them as booleans and numbers)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def pinned(role: str, path: Path) -> list[str]:
    """The overrides naming a task file (``role``: train or eval) as this command does: its absolute
    path and its identifier (:func:`~prism.data.custom.file_id`), so the same file gives the same runs
    however it was named."""
    return [f"suite.custom.{role}={hydra_value(str(path))}", f"suite.custom.{role}_sha256={file_id(path)}"]


def pin_task_files(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with each ``suite.custom.train=`` / ``eval=`` file made absolute and pinned by its
    identifier (:func:`pinned`) unless the user pinned it: the jobs ``slurm/submit.sh compare`` writes are
    then the runs of ``make compare`` on the same file. A missing file is left for validation to name."""
    given = {o.split("=", 1)[0] for o in overrides}
    out = []
    for override in overrides:
        key, _, value = override.partition("=")
        role = key.removeprefix("suite.custom.")
        path = Path(value).expanduser()
        if key in ("suite.custom.train", "suite.custom.eval") and path.is_file() and f"{key}_sha256" not in given:
            out += pinned(role, path.resolve())
        else:
            out.append(override)
    return out


def absolute(text: str, key: str) -> Path:
    """The path ``key=text`` names, absolute; ``ValueError`` naming the key where it cannot be followed
    (a symlink loop: ``RuntimeError`` before Python 3.13, ``OSError`` after)."""
    try:
        return Path(text).expanduser().resolve()
    except (OSError, RuntimeError) as err:
        raise ValueError(f"{key}={text} cannot be followed ({err}), "
                         f"point {key}= at the real file or folder") from None


def task_overrides(keys: dict[str, str], overrides: Sequence[str]) -> list[str]:
    """The overrides that name the task and model of ``keys`` (``task``, ``eval``, ``type``, ``labels``,
    ``model``), files absolute and pinned by their identifiers (:func:`pinned`); ``ValueError`` for a missing file."""
    task = absolute(keys["task"], "task")
    if not task.is_file():
        raise ValueError(f"task={keys['task']}: no such task file; give a .jsonl or .csv file of prompt/target rows")
    out = ["suite=custom", *pinned("train", task)]
    if "eval" in keys:
        eval_file = absolute(keys["eval"], "eval")
        if not eval_file.is_file():
            raise ValueError(f"eval={keys['eval']}: no such file")
        out += pinned("eval", eval_file)
    if "type" in keys:
        out.append(f"{KEY_OVERRIDES['type']}={keys['type']}")
    if "labels" in keys:
        out.append(f"{KEY_OVERRIDES['labels']}=[{','.join(map(quoted, comma_list(keys['labels'], 'labels')))}]")
    if keys.get("model"):
        if any(o.startswith("backbone=") for o in overrides):
            raise ValueError("model= and backbone= both choose the model, give one of them")
        out += ["backbone=local", f"{KEY_OVERRIDES['model']}={hydra_value(str(absolute(keys['model'], 'model')))}"]
    return out


def budgets(keys: dict[str, str]) -> list[float]:
    """The privacy budgets of ``eps=`` (default ∞, 6, 3)."""
    if "eps" not in keys:
        return list(EPSILONS)
    values = comma_list(keys["eps"], "eps", BUDGETS)
    if bad := [e for e in values if not e > 0]:
        raise ValueError(f"eps={bad[0]:g} must be > 0 (or inf for non-DP)")
    return values


def default_methods() -> list[str]:
    """The registered methods ``make compare`` runs without ``methods=`` (trait ``compare_by_default``)."""
    return [n for n in registry.names() if registry.lookup(n).compare_by_default]


@dataclass(frozen=True, order=True)
class Cell:
    """One cell of the Table 2 grid: its group choices."""

    suite: str
    privacy: str
    method: str

    def overrides(self) -> list[str]:
        return [f"method={self.method}", f"privacy={self.privacy}", f"suite={self.suite}"]
