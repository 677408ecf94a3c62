"""Generation-based evaluation of a suite (docs/DECISIONS.md D9–D12, D30, D31).

Batched ``model.generate`` (left padding, KV cache, greedy or beam search); the text after the first
``### Response:`` is parsed per task rule (:mod:`prism.evaluation.metrics`, re-exported here) and scored
per task, per Table 2 column (MNLI = mean of matched and mismatched) and as the suite average.
Greedy batches compute the KV cache of their prompts' common prefix once and put each row's remainder
behind it left-padded (``[prefix | padding | rest]``, padding masked): the same greedy tokens as
generating a row alone (``tests/test_evaluate.py``). With LoRA on the top layers only, the frozen
layers' prompt cache comes from :class:`prism.fastpath.prompt_cache.FrozenPrompts`; generation runs
:mod:`prism.fastpath.grouped_attention`. ``decoding.shared_prefix`` / ``decoding.frozen_prefix``
(default true) switch either off.
"""
from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from prism.data import Suite
from prism.data.config import DecodingConfig
from prism.data.prompts import collate, encode_prompt_as_trained, eval_prompt, response_text
from prism.evaluation.metrics import (
    extract_choice,
    extract_number,
    gold_is_valid,
    math_correct,
    parse_glue_label,
    row_outcomes,
    score_outputs,
    score_task,
    task_predictions,
)
from prism.fastpath.grouped_attention import grouped_eager
from prism.fastpath.prefix import common_prefix_length
from prism.fastpath.prompt_cache import FrozenPrompts
from prism.typed import node_of

__all__ = [
    "evaluate_suite", "generate_responses", "parse_glue_label", "extract_number", "math_correct",
    "extract_choice",
]
N_SAMPLES = 3  # generated responses kept per task in the result, for inspection


def _left_padded(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of `rows` left-padded with `pad`, on `device`."""
    batch = collate([{"input_ids": row} for row in rows], pad, pad_to_multiple_of=None, padding_side="left")
    return {k: batch[k].to(device) for k in ("input_ids", "attention_mask")}


def _shared_prefix_batch(model: Any, rows: Sequence[Sequence[int]], pad: int,
                         device: torch.device) -> dict[str, Any]:
    """``generate`` inputs for `rows` as ``[shared prefix | left padding | rest]`` with the prefix's KV
    cache (computed once, repeated per row); plain left padding when no prefix is shared."""
    shared = common_prefix_length(rows)
    if shared == 0:
        return _left_padded(rows, pad, device)
    prefix = torch.tensor([list(rows[0][:shared])], dtype=torch.long, device=device)
    cache = model(input_ids=prefix, use_cache=True).cache
    cache.batch_repeat_interleave(len(rows))
    rest = _left_padded([row[shared:] for row in rows], pad, torch.device("cpu"))
    ones = torch.ones(len(rows), shared, dtype=torch.long)
    return {"input_ids": torch.cat([prefix.cpu().expand(len(rows), -1), rest["input_ids"]], 1).to(device),
            "attention_mask": torch.cat([ones, rest["attention_mask"]], 1).to(device),
            "cache": cache}


@torch.inference_mode()
def generate_responses(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    cfg_decoding: DecodingConfig | Mapping[str, Any],
    batch_size: int,
    max_new_tokens: int | None = None,
) -> list[str]:
    """Responses (text after the first ``### Response:``) for `prompts`, in input order, batched by length
    and decoded with ``do_sample=False``. `cfg_decoding` (a :class:`~prism.data.config.DecodingConfig`, or a
    mapping :func:`prism.typed.node_of` builds one of): ``num_beams``, ``max_new_tokens`` (the argument
    wins), ``max_input_length`` (keep a longer prompt's last tokens), ``shared_prefix`` / ``frozen_prefix``
    (module docstring), ``prompt_encoding`` (``text``, the released code's, or ``as_trained``:
    :func:`prism.data.prompts.encode_prompt_as_trained`), ``renormalize_logits`` / ``remove_invalid_values``
    (passed to ``generate``; the released evaluation sets both)."""
    decoding = node_of(DecodingConfig, cfg_decoding)
    max_input = decoding.max_input_length
    # padding: the tokenizer's pad, else EOS, else 0 (the released code's choice)
    pad = next((int(c) for c in (tokenizer.pad_token_id, tokenizer.eos_token_id) if c is not None), 0)
    device = next(model.parameters()).device
    if decoding.prompt_encoding == "as_trained":
        encoded = [encode_prompt_as_trained(tokenizer, p) for p in prompts]
    else:
        encoded = [list(tokenizer(p)["input_ids"]) for p in prompts]
    if max_input:
        encoded = [ids[-max_input:] for ids in encoded]
    num_beams = decoding.num_beams
    share = num_beams == 1 and decoding.shared_prefix
    frozen = FrozenPrompts.build(model, encoded) if share and decoding.frozen_prefix else None
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    out: list[str] = [""] * len(prompts)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        rows = [encoded[i] for i in idx]
        if frozen is not None:
            batch = frozen.generate_inputs(idx, **_left_padded(rows, pad, device))
        elif share:
            batch = _shared_prefix_batch(model, rows, pad, device)
        else:
            batch = _left_padded(rows, pad, device)
        with grouped_eager(model):
            generated = model.generate(
                **batch,
                do_sample=False,
                num_beams=num_beams,
                max_new_tokens=max_new_tokens or decoding.max_new_tokens,
                pad_token_id=pad,
                eos_token_id=tokenizer.eos_token_id,
                renormalize_logits=decoding.renormalize_logits,
                remove_invalid_values=decoding.remove_invalid_values,
            )
        for i, text in zip(idx, tokenizer.batch_decode(generated, skip_special_tokens=True)):
            out[i] = response_text(text)
    return out


def new_tokens(cfg_decoding: DecodingConfig, task: str) -> int:
    """The generation cap of `task`: ``max_new_tokens_per_task[task]`` when set (one task's longer answers leave
    the others' decoding as it was), else ``max_new_tokens``."""
    per_task = cfg_decoding.max_new_tokens_per_task or {}
    return per_task.get(task) or cfg_decoding.max_new_tokens


def evaluate_suite(model: Any, tokenizer: Any, suite: Suite, cfg_decoding: DecodingConfig | Mapping[str, Any],
                   batch_size: int) -> dict:
    """Evaluate every task of `suite`: ``scores`` (task → score), ``columns`` (Table 2 column → mean of its
    tasks' scores), ``average`` (mean over the suite's columns; a user task's score), ``parse_failure`` (task →
    fraction of responses the rules could not parse; still scored), ``unparseable`` (task → their count),
    ``metrics`` (user tasks: task → every metric of :func:`prism.evaluation.metrics.score_task`, the later ones
    also columns), ``data`` (user tasks: the files and their identifiers, :func:`prism.data.custom.file_id`),
    ``n`` (task → examples scored), ``skipped`` (task → rows with an invalid gold answer), ``samples`` (task →
    first responses), ``seconds`` (task → time), ``eval_rows`` (task → evaluation rows, scored or skipped), ``per_example`` (task → its
    ``column``, :func:`prism.evaluation.metrics.row_outcomes` of the scored rows in order, and ``rows``: the
    sha256 of their prompts, so the aggregator's bootstrap can resample and pair runs on them; a user
    classification task also has ``<task>/Macro-F1``: each row's parsed and gold label and the label count)."""
    decoding = node_of(DecodingConfig, cfg_decoding)
    was_training = model.training
    model.eval()
    result: dict[str, dict] = {k: {} for k in ("scores", "parse_failure", "n", "skipped", "samples", "seconds",
                                                  "eval_rows", "per_example")}
    try:
        for task, examples in suite.eval.items():
            column, rule = suite.task_columns[task], suite.rules.get(task)
            rows = examples if rule else [ex for ex in examples if gold_is_valid(column, ex.answer)]
            started = time.perf_counter()
            texts = generate_responses(
                model, tokenizer, [eval_prompt(ex, suite.family, decoding.math_eval_template) for ex in rows], decoding,
                batch_size, max_new_tokens=new_tokens(decoding, task),
            )
            golds, choice_rule = [ex.answer for ex in rows], decoding.choice_regex
            keys = "\x1e".join(f"{ex.instruction}\x1f{ex.input}" for ex in rows)
            rows_hash = hashlib.sha256(keys.encode()).hexdigest()[:16]
            if rule:  # a user task (suite=custom): its metrics are its columns; per row, the first one's (Accuracy)
                metrics, failures = score_task(rule, texts, golds)
                result.setdefault("metrics", {})[task] = metrics
                result.setdefault("unparseable", {})[task] = failures
                column = rule.columns[0]
                score = metrics[column]
                preds, correct = task_predictions(rule, texts, golds)
                outcomes = {"correct": [int(c) for c in correct]}
                if rule.kind == "classification":  # and the label per row, for Macro-F1's interval
                    result["per_example"][f"{task}/Macro-F1"] = {
                        "column": "Macro-F1", "pred": [-1 if p is None else int(p) for p in preds],
                        "gold": [int(g) for g in golds], "labels": len(rule.labels), "rows": rows_hash}
            else:
                score, failures = score_outputs(column, texts, golds, choice_rule=choice_rule)
                outcomes = row_outcomes(column, texts, golds, choice_rule=choice_rule)
            result["scores"][task] = score
            result["parse_failure"][task] = failures / len(rows) if rows else 0.0
            result["n"][task] = len(rows)
            result["skipped"][task] = len(examples) - len(rows)
            result["eval_rows"][task] = len(examples)
            result["samples"][task] = texts[:N_SAMPLES]
            result["per_example"][task] = {"column": column, **outcomes, "rows": rows_hash}
            result["seconds"][task] = time.perf_counter() - started
    finally:
        model.train(was_training)
    by_column: dict[str, list[float]] = {}
    for task, score in result["scores"].items():
        by_column.setdefault(suite.task_columns[task], []).append(score)
        for metric, value in list(result.get("metrics", {}).get(task, {}).items())[1:]:
            by_column.setdefault(metric, []).append(value)
    columns = {col: sum(v) / len(v) for col, v in by_column.items()}
    average = sum(columns.values()) / len(columns) if columns else math.nan
    if suite.rules:  # a user task: the average is its score, not a mean over unlike metrics
        average = sum(result["scores"].values()) / len(result["scores"])
    extra = {"data": suite.source} if suite.source else {}
    return {**result, "columns": columns, "average": average, "suite": suite.name, "scale": suite.scale, **extra}
