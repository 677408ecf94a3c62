"""GLUE/Math metrics against closed-form computations on fixed vectors (docs/DECISIONS.md D30)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import rankdata

from prism.evaluation.metrics import glue_score, gold_is_valid, score_outputs

GOLD = [1, 0, 1, 1, 0, 1, 0, 0, 1, 1]
PRED = [1, 0, 0, 1, 1, 1, 0, 1, 1, 0]


def _confusion(g, p):
    g, p = np.asarray(g), np.asarray(p)
    return (int(((g == 1) & (p == 1)).sum()), int(((g == 0) & (p == 0)).sum()),
            int(((g == 0) & (p == 1)).sum()), int(((g == 1) & (p == 0)).sum()))


def test_cola_is_matthews_closed_form() -> None:
    tp, tn, fp, fn = _confusion(GOLD, PRED)
    mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert glue_score("cola", PRED, GOLD) == pytest.approx(mcc)
    assert glue_score("cola", [0] * 10, GOLD) == 0.0  # constant predictions (e.g. all fallbacks)


@pytest.mark.parametrize("task", ["mrpc", "qqp"])
def test_mrpc_qqp_mean_of_accuracy_and_f1(task: str) -> None:
    tp, tn, fp, fn = _confusion(GOLD, PRED)
    acc = (tp + tn) / len(GOLD)
    f1 = 2 * tp / (2 * tp + fp + fn)
    assert glue_score(task, PRED, GOLD) == pytest.approx((acc + f1) / 2)


@pytest.mark.parametrize("task", ["sst2", "qnli", "rte", "mnli"])
def test_accuracy_tasks(task: str) -> None:
    gold, pred = [0, 1, 2, 2, 1, 0], [0, 2, 2, 2, 1, 1]
    if task != "mnli":
        gold, pred = [min(x, 1) for x in gold], [min(x, 1) for x in pred]
    expected = np.mean(np.asarray(gold) == np.asarray(pred))
    assert glue_score(task, pred, gold) == pytest.approx(expected)


def test_stsb_mean_of_pearson_and_spearman() -> None:
    gold = np.array([0.0, 1.2, 2.5, 3.1, 4.8, 5.0, 2.2])
    pred = np.array([0.5, 1.0, 3.0, 2.9, 4.0, 4.4, 3.5])
    pearson = np.corrcoef(gold, pred)[0, 1]
    spearman = np.corrcoef(rankdata(gold), rankdata(pred))[0, 1]
    assert glue_score("stsb", pred, gold) == pytest.approx((pearson + spearman) / 2)
    assert glue_score("stsb", [0.0] * 7, gold) == 0.0  # undefined correlation → 0


def test_score_outputs_glue_and_math() -> None:
    texts = ["acceptable", "unacceptable", "yes", "???"]
    score, failures = score_outputs("CoLA", texts, [1, 0, 1, 1])
    tp, tn, fp, fn = _confusion([1, 0, 1, 1], [1, 0, 1, 0])
    assert failures == 2
    assert score == pytest.approx((tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))
    assert score_outputs("GSM8K", ["The answer is 1,000.", "7", "none"], [1000.0, 8.0, 0.0]) == (1 / 3, 1)
    assert score_outputs("AQuA", ["(B)", "the answer is c", "123"], ["B", "C", "A"]) == (2 / 3, 1)
    assert score_outputs("SVAMP", [], []) == (0.0, 0)
    with pytest.raises(ValueError, match="valid"):
        score_outputs("WNLI", ["x"], [0])


def test_gold_validation() -> None:
    assert gold_is_valid("MNLI", 2) and not gold_is_valid("RTE", 2) and not gold_is_valid("SST-2", -1)
    assert gold_is_valid("STS-B", 3.4) and gold_is_valid("GSM8K", 12.0) and not gold_is_valid("GSM8K", math.nan)
    assert gold_is_valid("AQuA", "E") and not gold_is_valid("AQuA", "F") and not gold_is_valid("MAWPS", "7")
