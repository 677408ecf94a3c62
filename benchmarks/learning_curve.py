"""Learning curve of one grid cell: evaluate the same run at step 0 and at chosen steps, write no run folder.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learning_curve.py --at 0 15 30 60 \\
        --eval-tasks basic_arithmetic -- method=prism privacy=nondp suite=math10k train.steps=60

The overrides after ``--`` are those of ``python -m pipelines run`` and are validated the same way
(bad input: one ``error:`` line, exit 2, before any model load). The cell is built and trained by
:func:`prism.train.build` and :func:`prism.train.train_step` — the same Poisson batches, σ (calibrated
for ``train.steps``) and updates as the pipeline's run of that config — and scored by
:func:`prism.evaluation.evaluate.evaluate_suite` at every step of ``--at`` (default: 0 and ``train.steps``;
each ≤ ``train.steps``). ``--eval-tasks`` scores only some tasks; training still uses all of them.

One table row per checkpoint and task: the score, the share of unparsed responses, and the share of
the most frequent parsed answer with that answer (near 1: the model answers one value for every row,
a collapse that a score alone hides); the mean per-example training loss (mean over supervised tokens)
of the steps since the previous checkpoint; the CPU seconds of this process spent training up to this
checkpoint (cumulative) and evaluating at it. Nothing is written to disk except the shared
frozen-layer caches. Every response is kept by raising ``prism.evaluation.evaluate.N_SAMPLES`` for the call.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipelines.config.compose import resolve  # noqa: E402
from pipelines.config.validate import ConfigError, load_job  # noqa: E402
from pipelines.runs.runner import quiet_third_party_warnings  # noqa: E402
from prism.evaluation import evaluate  # noqa: E402
from prism.evaluation.metrics import COLUMN_RULES, extract_choice, extract_number, parse_glue_label  # noqa: E402

HEADER = ("| step | task | column | score | unparsed | top answer (share) | train loss | train CPU s | eval CPU s |\n"
          "|---|---|---|---|---|---|---|---|---|")


def parsed_answer(column: str, text: str, choice_rule: str = "lookaround") -> Any:
    """The answer the column's rule reads from `text` (None when it reads none), as scored."""
    rule = COLUMN_RULES[column]
    if rule == "number":
        return extract_number(text)
    if rule == "choice":
        return extract_choice(text, choice_rule)
    label, ok = parse_glue_label(rule, text)
    return label if ok else None


def top_answer(answers: Sequence[Any]) -> tuple[Any, float]:
    """The most frequent parsed answer and its share of all responses ((None, 0.0) if none parsed)."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None, 0.0
    answer, count = counts.most_common(1)[0]
    return answer, count / len(answers)


def checkpoint_rows(step: int, result: dict[str, Any], columns: dict[str, str], choice_rule: str,
                    loss: float, train_s: float, eval_s: float) -> list[dict[str, Any]]:
    """One record per task of an :func:`prism.evaluation.evaluate.evaluate_suite` result whose ``samples`` hold
    every response; `loss`: the mean training loss of the steps since the previous checkpoint."""
    rows = []
    for task, score in result["scores"].items():
        answer, share = top_answer([parsed_answer(columns[task], t, choice_rule) for t in result["samples"][task]])
        rows.append({"step": step, "task": task, "column": columns[task], "score": score,
                     "unparsed": result["parse_failure"][task], "top_answer": answer, "top_share": share,
                     "train_loss": loss, "train_cpu_s": train_s, "eval_cpu_s": eval_s})
    return rows


def format_row(row: dict[str, Any]) -> str:
    answer = "—" if row["top_answer"] is None else f"{row['top_answer']:g}" if isinstance(row["top_answer"], float) \
        else str(row["top_answer"])
    return (f"| {row['step']} | {row['task']} | {row['column']} | {row['score']:.3f} | {row['unparsed']:.1%} "
            f"| {answer} ({row['top_share']:.0%}) | {row['train_loss']:.3f} | {row['train_cpu_s']:.1f} | {row['eval_cpu_s']:.1f} |")


def checkpoints(at: Sequence[int] | None, steps: int) -> list[int]:
    """Sorted distinct checkpoints, default (0, ``steps``); a :class:`ConfigError` outside [0, steps]."""
    points = sorted(set(at)) if at else sorted({0, steps})
    bad = [p for p in points if not 0 <= p <= steps]
    if bad:
        raise ConfigError(f"--at {bad} lies outside [0, train.steps={steps}], raise train.steps or drop those steps")
    return points


def learning_curve(cfg: DictConfig, at: Sequence[int], eval_tasks: Sequence[str] | None = None,
                   emit=print) -> list[dict[str, Any]]:
    """Train the cell of `cfg` to ``max(at)`` steps, evaluating at every step of `at` (see module doc)."""
    from prism.train import build, train_step

    s = build(cfg)
    if eval_tasks:
        unknown = sorted(set(eval_tasks) - set(s.suite.eval))
        if unknown:
            raise ConfigError(f"--eval-tasks {unknown} are not tasks of this suite ({', '.join(s.suite.eval)})")
        s.suite.eval = {task: rows for task, rows in s.suite.eval.items() if task in eval_tasks}
    all_rows = max(map(len, s.suite.eval.values()))
    choice_rule = cfg.suite.decoding.get("choice_regex", "lookaround")
    records: list[dict[str, Any]] = []
    step, train_s = 0, 0.0
    emit(HEADER)
    for point in at:
        tic, losses = time.process_time(), []
        while step < point:
            record = train_step(s, cfg, diagnostics=False)
            if "loss" in record:  # absent on an empty non-private batch
                losses.append(float(record["loss"]))
            step += 1
        train_s += time.process_time() - tic
        loss = sum(losses) / len(losses) if losses else math.nan
        tic = time.process_time()
        with mock.patch.object(evaluate, "N_SAMPLES", all_rows):  # keep every response, not the first few
            result = evaluate.evaluate_suite(s.model, s.tokenizer, s.suite, cfg.suite.decoding,
                                             cfg.train.eval_batch_size)
        rows = checkpoint_rows(step, result, s.suite.task_columns, choice_rule, loss, train_s, time.process_time() - tic)
        for row in rows:
            emit(format_row(row))
        records.extend(rows)
    return records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--at", type=int, nargs="+", help="steps to evaluate at (default: 0 and train.steps)")
    parser.add_argument("--eval-tasks", nargs="+", help="score only these tasks (training uses all)")
    parser.add_argument("overrides", nargs="*", help="`python -m pipelines run` overrides, e.g. suite=math10k privacy=nondp")
    args = parser.parse_args(argv)
    quiet_third_party_warnings()
    try:
        cfg = resolve(load_job(args.overrides))
        at = checkpoints(args.at, int(cfg.train.steps))
        if args.eval_tasks:
            from prism.data.embedded import EMBEDDED_TASKS

            known = set(cfg.suite.embedded.get("tasks") or EMBEDDED_TASKS.get(cfg.suite.name, {}))
            unknown = sorted(set(args.eval_tasks) - known) if cfg.suite.scale == "embedded" else []
            if unknown:
                raise ConfigError(f"--eval-tasks {unknown} are not tasks of this run ({', '.join(sorted(known))}), "
                                  "name tasks of suite.embedded.tasks")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    learning_curve(cfg, at, args.eval_tasks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
