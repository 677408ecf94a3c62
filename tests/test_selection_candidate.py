"""A private selection's candidate in the training loop (prism/train.py; docs/PRIVACY.md "ε includes
tuning"): it trains at the selection's σ from seeds of its own, outside the validation rows, and records
the noised count of its correct validation rows and nothing else about them; an ordinary run keeps its seeds."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_cfg

from pipelines.runs import store
from prism import train as T
from prism.privacy.selection import calibrate_candidate_sigma, selection_epsilon
from prism.record import SelectionBlock

SELECTION = ["+privacy.selection={mean:3.0,shape:1.0,score_noise:5.0,candidate:1}", "+suite.validation_per_task=3"]


def test_a_candidate_trains_at_the_selections_sigma_and_records_only_the_noised_count(tmp_path: Path) -> None:
    cfg = tiny_cfg("privacy=eps6", "suite.embedded.unscored=[]", *SELECTION)  # both stand-ins scored: 2 × 3 rows
    final = T.train_and_evaluate(cfg, tmp_path, lambda record: None)
    q, steps = 8 / 32, 3
    sigma = calibrate_candidate_sigma(6.0, 1e-5, q, steps, score_sigma=5.0, mean=3.0, shape=1.0)
    block = SelectionBlock.from_json(final["selection"])
    assert final["sample_rate"] == pytest.approx(q) and final["sigma"] == block.sigma == sigma
    assert block.epsilon == pytest.approx(selection_epsilon(sigma, q, steps, 1e-5, score_sigma=5.0, mean=3.0,
                                                            shape=1.0)) and block.epsilon <= 6.0
    assert (block.rows, block.candidate, block.mean, block.shape, block.score_noise) == (6, 1, 3.0, 1.0, 5.0)
    assert block.score != round(block.score)  # noised, never the count itself
    # the test rows are published as usual; no per-row or un-noised validation figure is kept anywhere
    assert set(final["per_example"]) == {"tweet_sentiment", "syllogism"} and final["eval_rows"] == {
        "tweet_sentiment": 2, "syllogism": 2}
    assert set(final["selection"]) == {"score", "rows", "candidate", "mean", "shape", "score_noise",
                                                    "sigma", "epsilon"}
    # the embedded training rows are the ordinary run's (the validation rows are drawn outside them)
    assert final["n_train"] == 32


def test_candidates_draw_their_own_seeds_and_an_ordinary_run_keeps_its_seed() -> None:
    ordinary = tiny_cfg("privacy=eps6", "seed=7")
    assert T.run_seed(ordinary) == 7
    seeds = {T.run_seed(tiny_cfg("privacy=eps6", "seed=7", *SELECTION, f"privacy.selection.candidate={k}"))
             for k in range(4)}
    assert len(seeds) == 4 and 7 not in seeds
    # a selection key on a non-private run changes nothing (the rules refuse it before a run starts)
    assert T.run_seed(tiny_cfg("privacy=nondp", "seed=7", *SELECTION)) == 7


def test_the_os_noise_source_draws_the_scores_noise_from_the_csprng() -> None:
    from prism.privacy.selection import noised_count

    draws = [noised_count(np.array([1, 0, 1]), 5.0, T._SecureDraws()) for _ in range(3)]
    assert len(set(draws)) == 3 and all(isinstance(d, float) for d in draws)


def test_a_selection_block_without_a_field_is_refused_in_one_line() -> None:
    final = {"selection": {"score": 3.2, "rows": 6}}
    assert store.final_problem(json.loads(json.dumps({**final, "run": {
        "hash": "h", "experiment": "e", "attempts": 1, "versions": {}, "git_commit": None, "git_dirty": None,
        "hostname": "x"}}))) == "final.json's `selection` block lacks `candidate`"


def test_a_custom_task_candidate_trains_outside_the_validation_rows_it_scores(tmp_path: Path) -> None:
    """The 40 rows fall apart into training, validation and test rows, the validation split being the one
    ``build_suite`` draws for ``suite.eval_split=validation`` (each row by its own draw, prism.data.custom)."""
    from omegaconf import OmegaConf

    from pipelines.config.compose import compose_config, resolve
    from prism.data import build_suite, row_key

    lines = [{"prompt": f"Review {i}: {'great' if i % 2 else 'awful'}.", "target": "positive" if i % 2 else "negative"}
            for i in range(40)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cfg = resolve(compose_config(["backbone=tiny-llama", "suite=custom", f"suite.custom.train={tmp_path / 't.jsonl'}",
                                  "suite.custom.labels=[positive,negative]", "suite.cutoff_len=1024", "train.steps=1",
                                  "train.batch_size=8", "train.micro_batch_size=4", "logging=disabled",
                                  "privacy=eps6", *SELECTION]))
    s = T.build(cfg)
    train, scored, test = ({row_key(ex) for ex in part} for part in (s.suite.train, s.validation.eval["custom"],
                                                                     s.suite.eval["custom"]))
    assert len(train) + len(scored) + len(test) == 40 and min(len(train), len(scored), len(test)) > 0
    assert not train & scored and not train & test and not scored & test
    validation = build_suite({**OmegaConf.to_container(cfg.suite), "eval_split": "validation"}, cfg.seed)
    assert s.suite.train == validation.train and s.validation.eval == validation.eval
