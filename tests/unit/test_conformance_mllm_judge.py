"""Conformance with MLLM-as-a-Judge's own metric code (`eval.convention=strict`, the default).

Official sources: Dongping-Chen/MLLM-Judge `scripts/calculate_metrics.ipynb`
(`calculate_accuracy_metrics`, `calculate_levenshtein_metrics`, `calculate_pearson_metrics`: the
per-dataset values and the pooled `overall`) and the paper's analysis notebooks
`scripts/Score_analysis.ipynb` and `scripts/pair_analysis.ipynb` (the per-dataset tables and their
average: the sum of the per-dataset values over the number of datasets, `paper_mean`). These
notebooks read verdicts, not judge texts: the reading is pjray's (see the Perception-Judge and
Flex-Judge modules for the releases' readings).
"""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pjray.config import load
from pjray.eval.judge_bench import evaluate_bench
from pjray.eval.metrics import (
    DATASET_MEAN,
    OVERALL,
    PAPER_MEAN,
    BatchRecord,
    PairRecord,
    ScoreRecord,
    batch_table,
    pair_table,
    pearson,
    score_table,
    with_dataset_mean,
    with_paper_mean,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "mllm_judge"


def test_accuracy_metrics():
    """`calculate_accuracy_metrics`: include_ties=False skips an item whose truth OR prediction
    is C; per dataset correct / total, overall pooled."""
    records = [
        PairRecord("a", "A", "A"),
        PairRecord("a", "C", "B"),
        PairRecord("a", "B", "C"),
        PairRecord("b", "B", "A"),
        PairRecord("b", "C", "C"),
    ]
    without = pair_table(records, with_ties=False)
    assert without["a"].value == 1.0 and without["a"].skipped == 2
    assert without["b"].value == 0.0 and without[OVERALL].value == 0.5
    with_ties = pair_table(records, with_ties=True)
    assert with_ties["a"].value == pytest.approx(1 / 3) and with_ties[OVERALL].value == pytest.approx(2 / 5)


def test_levenshtein_metrics_raw():
    """`calculate_levenshtein_metrics`: the raw distance (not normalised), per dataset and pooled."""
    records = [BatchRecord("a", "ABCD", "ABCD"), BatchRecord("a", "BADC", "ABCD"), BatchRecord("b", "CAB", "ABC")]
    t = batch_table(records, normalized=False)
    # Levenshtein(BADC, ABCD) = 3 (A+BADC -> AB[A->C]DC -> ABCD[-C]); CAB -> ABC: 2 (drop C, append C)
    assert t["a"].value == 1.5 and t["b"].value == 2.0 and t[OVERALL].value == pytest.approx(5 / 3)


def test_pearson_metrics():
    """`calculate_pearson_metrics`: pearsonr per dataset and on the pooled items."""
    records = [
        ScoreRecord("a", 1, 1),
        ScoreRecord("a", 3, 2),
        ScoreRecord("a", 2, 3),
        ScoreRecord("b", 4, 4),
        ScoreRecord("b", 5, 5),
    ]
    t = score_table(records)
    assert t["a"].value == pytest.approx(0.5)  # dx = (-1, 1, 0), dy = (-1, 0, 1): 1 / 2
    assert t["b"].value == pytest.approx(1.0)
    assert t[OVERALL].value == pytest.approx(pearson([1, 3, 2, 4, 5], [1, 2, 3, 4, 5]))


def test_paper_average_and_dataset_mean():
    """`Score_analysis.ipynb` / `pair_analysis.ipynb`: `sum += correlation` for each dataset with
    data, then `sum / 10` (the number of datasets): a dataset with no readable item adds 0."""
    records = [
        ScoreRecord("a", 1, 1),
        ScoreRecord("a", 3, 2),
        ScoreRecord("a", 2, 3),
        ScoreRecord("b", 4, 4),
        ScoreRecord("b", 5, 5),
        ScoreRecord("c", None, 3),
    ]
    t = with_paper_mean(with_dataset_mean(score_table(records)))  # drop: c has no item left
    assert t[PAPER_MEAN].value == pytest.approx((0.5 + 1.0 + 0) / 3)
    assert t[DATASET_MEAN].value == pytest.approx((0.5 + 1.0) / 2)


def test_strict_reports_name_the_notebooks():
    texts = {"pair-0": "<think>x</think><answer>8</answer><answer>2</answer>"}
    cfg = load(overrides=["eval.bench=pair", f"eval.data={FIXTURES / 'pair.jsonl'}"])
    report = evaluate_bench(cfg, lambda prompts, seed: [texts.get(p.item_id, "?") for p in prompts])
    t = report.tables["acc_with_tie"]
    assert t[PAPER_MEAN].value == pytest.approx((1 / 2 + 0) / 2)  # ChartQA 1/2, coco 0 (unreadable: wrong)
    assert "calculate_metrics.ipynb" in report.sources[OVERALL] and "Score_analysis" in report.sources[PAPER_MEAN]
    assert report.convention.startswith("strict")
    cfg = load(overrides=["eval.bench=batch", f"eval.data={FIXTURES / 'batch.jsonl'}"])
    batch = evaluate_bench(cfg, lambda prompts, seed: ["?"] * len(prompts))
    assert PAPER_MEAN not in batch.tables["levenshtein_raw"]  # no analysis notebook for batch


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["coco", "WIT", "ChartQA"]), st.sampled_from("ABC"), st.sampled_from("ABC")),
        min_size=1,
        max_size=15,
    )
)
def test_paper_mean_is_the_dataset_mean_when_every_dataset_has_items(items):
    t = with_paper_mean(with_dataset_mean(pair_table([PairRecord(*i) for i in items], with_ties=True)))
    assert t[PAPER_MEAN].value == pytest.approx(t[DATASET_MEAN].value)
    correct = sum(p == g for _, p, g in items)
    assert t[OVERALL].value == pytest.approx(correct / len(items))  # pooled
