"""suite=custom under the threat model of docs/PRIVACY.md ("A user's task file"): each row's side of a
hold-out (evaluation, or validation for a tuning run and a selection candidate) is decided by that row
alone, so removing a row moves no other row between training and hold-out; and nothing published
(config, run hash, table and tuned-file names, ``make compare``'s header, final.json's ``data``) is the
file's sha256, a function of every row, but a keyed hash under a key that stays on the machine."""
from __future__ import annotations

import hashlib
import hmac
import json
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from pipelines.config import identity
from pipelines.config.compose import compose_config, resolve
from pipelines.verbs import compare
from prism.data import Suite, build_suite
from prism.data.custom import TaskFileError, load_task
from prism.fileio import sha256_file

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tweet_sentiment"
LABELS = "positive,negative,neutral"
UNPINNED = {"tolerance": 1e-3, "train_sha256": None, "eval_sha256": None}
"""The ``suite.custom`` keys of a classification task whose files are not pinned (suite/custom.yaml's)."""


def _config(train: Path, *overrides: str) -> object:
    return resolve(compose_config(["backbone=tiny-llama", "suite=custom", f"suite.custom.train={train}",
                                   f"suite.custom.labels=[{LABELS}]", "logging=disabled", *overrides]))


def _candidate_split(cfg: object) -> Suite:
    """A selection candidate's training and validation rows, built as prism/train.py's ``build`` builds them
    (tests/test_selection_candidate.py checks that they are the rows the candidate trains on and scores)."""
    return build_suite({**OmegaConf.to_container(cfg.suite), "eval_split": "validation"}, cfg.seed)


# mode -> (overrides, the suite whose ``train`` and ``eval`` are the two sides)
MODES: dict[str, tuple[list[str], Callable[[object], Suite]]] = {
    "an ordinary run's evaluation hold-out": ([], lambda cfg: build_suite(cfg.suite, cfg.seed)),
    "a tuning run's validation hold-out": (["experiment=tune", f"suite.custom.eval={EXAMPLE / 'eval.jsonl'}"],
                                           lambda cfg: build_suite(cfg.suite, cfg.seed)),
    "a selection candidate's validation hold-out": (["experiment=table2-accounted", "privacy=eps6"], _candidate_split),
}


def _sides(suite: Suite) -> Counter:
    """(prompt, target, side) of every row the run trains on or scores."""
    return Counter([(ex.instruction, ex.output, "train") for ex in suite.train]
                   + [(ex.instruction, ex.output, "held out") for ex in suite.eval["custom"]])


@pytest.mark.parametrize("mode", MODES)
def test_removing_a_row_moves_no_other_row_between_sides(mode: str, tmp_path: Path) -> None:
    """For 20 random rows of the shipped example file: the file without that row puts every other row on
    the side it had (training, held out, or neither: a validation split's evaluation rows)."""
    overrides, split = MODES[mode]
    lines = (EXAMPLE / "train.jsonl").read_text().splitlines(keepends=True)
    cfg = _config(EXAMPLE / "train.jsonl", *overrides)
    full = _sides(split(cfg))
    assert sum(full.values()) > 100 and {side for *_, side in full} == {"train", "held out"}
    for index in random.Random(7).sample(range(len(lines)), 20):
        removed = json.loads(lines[index])
        smaller = tmp_path / "train.jsonl"
        smaller.write_text("".join(lines[:index] + lines[index + 1:]))
        cfg.suite.custom.train = str(smaller)
        after = _sides(split(cfg))
        moved = {key[:2] for key in full.keys() | after.keys()
                 if key[:2] != (removed["prompt"], removed["target"]) and full[key] != after[key]}
        assert not moved, f"removing line {index + 1} moved {len(moved)} other row(s) ({mode})"


def test_rows_repeating_a_prompt_land_on_one_side_so_the_hold_out_never_repeats_a_training_prompt(
        tmp_path: Path) -> None:
    """Each prompt twice (once with different whitespace, once with another target): never one copy trained
    on and the other scored, so no leakage warning, in the evaluation hold-out and in the validation one."""
    rows = []
    for i in range(200):
        rows += [{"prompt": f"Review {i}: fine.", "target": "positive"},
                 {"prompt": f"Review  {i}:\tfine.", "target": "negative"}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    node = {"train": str(path), "eval": None, "eval_fraction": 0.2, "validation_fraction": 0.2,
            "type": "classification", "labels": LABELS.split(","), **UNPINNED}
    for validating in (False, True):
        task, _ = load_task(node, validating)
        assert task.warning is None and len(task.eval) % 2 == 0 and len(task.train) % 2 == 0


def test_the_hold_out_sizes_are_binomial_at_the_configured_fractions(tmp_path: Path) -> None:
    """20,000 distinct rows: the held-out counts lie within 4.5 standard deviations of Binomial(N, p)'s mean
    (evaluation: p = eval_fraction; validation: p = validation_fraction of the rows left for training)."""
    n = 20_000
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"row {i}", "target": "positive"}) + "\n" for i in range(n)))
    node = {"train": str(path), "eval": None, "eval_fraction": 0.2, "validation_fraction": 0.17,
            "type": "classification", "labels": LABELS.split(","), **UNPINNED}
    test, _ = load_task(node)
    held = len(test.eval)
    assert abs(held - 0.2 * n) < 4.5 * (n * 0.2 * 0.8) ** 0.5, held
    val, _ = load_task(node, True)
    pool = n - held
    assert len(val.train) + len(val.eval) == pool
    assert abs(len(val.eval) - 0.17 * pool) < 4.5 * (pool * 0.17 * 0.83) ** 0.5, len(val.eval)


@pytest.mark.parametrize("fraction, words", [(1e-6, "no row fell in the hold-out"), (1 - 1e-6, "every row fell")])
def test_an_empty_side_is_one_line_naming_the_fraction(fraction: float, words: str, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"row {i}", "target": "positive"}) + "\n" for i in range(5)))
    node = {"train": str(path), "eval": None, "eval_fraction": fraction, "validation_fraction": fraction,
            "type": "classification", "labels": LABELS.split(","), **UNPINNED}
    with pytest.raises(TaskFileError) as err:
        load_task(node)
    message = str(err.value)
    assert "\n" not in message and words in message and f"suite.custom.eval_fraction={fraction:g}" in message, message
    node["eval"] = str(EXAMPLE / "eval.jsonl")
    with pytest.raises(TaskFileError) as err:
        load_task(node, True)
    assert words in str(err.value) and f"suite.custom.validation_fraction={fraction:g}" in str(err.value), err.value


# ------------------------------------------------------------------------------------------ identity
def _published(task: Path) -> tuple[str, list[str]]:
    """The identifier ``make compare`` pins for ``task`` and everything it publishes from it: the run hash
    input, final.json's ``data`` block, the table's name and the header."""
    plan = compare.plan({"task": str(task), "labels": LABELS, "methods": "adamw", "eps": "6"},
                        ["backbone=tiny-llama", "suite.cutoff_len=1024"])
    cfg = plan.configs[0]
    texts = [identity.canonical(identity.hash_payload(cfg)), json.dumps(build_suite(cfg.suite, cfg.seed).source),
             compare.table_spec(plan).name,
             *compare.header(plan, SimpleNamespace(spec=SimpleNamespace(title="t")))]
    return str(cfg.suite.custom.train_sha256), texts


def test_the_published_identifier_is_a_keyed_hash_under_a_private_machine_key(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Two machines (two ``$PRISM_CACHE``) publish different identifiers of the same file, neither its sha256
    nor containing its first 8 hex digits; each is HMAC-SHA256 (the standard library's) of the file's bytes
    under the machine's key file, created with mode 0600 on first use and reused after."""
    task = tmp_path / "train.jsonl"
    task.write_bytes((EXAMPLE / "train.jsonl").read_bytes())
    digest = sha256_file(task)
    ids = {}
    for machine in ("a", "b"):
        monkeypatch.setenv("PRISM_CACHE", str(tmp_path / machine))
        ids[machine], texts = _published(task)
        assert not any(digest[:8] in text for text in texts), machine
        from prism.data.custom import MACHINE_KEY

        key_file = tmp_path / machine / MACHINE_KEY
        assert key_file.stat().st_mode & 0o777 == 0o600
        key = key_file.read_bytes()
        assert ids[machine] == hmac.new(key, task.read_bytes(), hashlib.sha256).hexdigest()
        assert _published(task)[0] == ids[machine] and key_file.read_bytes() == key  # the key is reused
    assert ids["a"] != ids["b"] and digest not in ids.values()


def test_a_pinned_identifier_still_catches_a_changed_file_and_a_plain_sha256(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The check ``suite.custom.train_sha256`` is read for: the pinned identifier passes; after an edit, or
    pinned by the file's plain sha256 (which is not published any more), one line naming the key and the fix."""
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path / "cache"))
    task = tmp_path / "train.jsonl"
    task.write_bytes((EXAMPLE / "train.jsonl").read_bytes())
    identifier, _ = _published(task)
    node = {"train": str(task), "eval": None, "eval_fraction": 0.2, "validation_fraction": 0.2,
            "type": "classification", "labels": LABELS.split(","), **UNPINNED, "train_sha256": identifier}
    assert load_task(node)[0].source["train_sha256"] == identifier
    with pytest.raises(TaskFileError, match="plain sha256") as err:
        load_task({**node, "train_sha256": sha256_file(task)})
    assert "\n" not in str(err.value) and f"suite.custom.train_sha256={identifier}" in str(err.value)
    with task.open("a") as handle:
        handle.write(json.dumps({"prompt": "one more", "target": "neutral"}) + "\n")
    with pytest.raises(TaskFileError, match=rf"differs from suite.custom.train_sha256={identifier}"):
        load_task(node)
