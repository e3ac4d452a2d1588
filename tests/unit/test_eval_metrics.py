"""Evaluation metrics against hand-computed numbers (ties, None scores, y = 1, zero denominators)."""

import math

import pytest

from pjray.eval.metrics import (
    BIAS_TYPES,
    DATASET_MEAN,
    MEAN_IF_ALL,
    OVERALL,
    PAPER_MEAN,
    BatchRecord,
    ModeRecord,
    PairRecord,
    Row,
    ScoreRecord,
    aggregate_seeds,
    batch_distance,
    batch_table,
    bias_conformity,
    bias_deviation,
    bias_metric,
    bias_summary,
    majority_verdict,
    map_score,
    mode_rates,
    pair_accuracy,
    pair_table,
    pearson,
    score_table,
    vote_pairs,
    with_dataset_mean,
    with_paper_mean,
)


def test_pearson_hand_computed():
    assert pearson([1, 2, 3], [1, 2, 3]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # dx = dy-permuted (-1.5, -.5, .5, 1.5): sum dx*dy = 3, sum dx^2 = sum dy^2 = 5 -> 0.6
    assert pearson([1, 2, 3, 4], [2, 1, 4, 3]) == pytest.approx(0.6)


def test_pearson_undefined_is_none():
    assert pearson([3], [4]) is None
    assert pearson([], []) is None
    assert pearson([2, 2, 2], [1, 2, 3]) is None  # constant prediction: scipy gives nan
    with pytest.raises(ValueError):
        pearson([1, 2], [1])


def test_score_table_per_dataset_pooled_and_unparsed():
    records = [
        ScoreRecord("a", 1, 1),
        ScoreRecord("a", 2, 2),
        ScoreRecord("a", None, 5),
        ScoreRecord("b", 4, 2),
        ScoreRecord("b", 3, 3),
    ]
    t = score_table(records)
    assert t["a"] == Row(pytest.approx(1.0), n=2, unparsed=1)
    assert t["b"].value == pytest.approx(-1.0)
    # pooled over the 4 readable items: pred (1,2,4,3) vs human (1,2,2,3)
    assert t[OVERALL].value == pytest.approx(pearson([1, 2, 4, 3], [1, 2, 2, 3]))
    assert t[OVERALL].n == 4 and t[OVERALL].unparsed == 1
    mean = with_dataset_mean(t)[DATASET_MEAN]
    assert mean.value == pytest.approx(0.0) and mean.n == 4


def test_map_score():
    assert [map_score(v, "ceil_half") for v in (1, 2, 3, 9, 10)] == [1, 1, 2, 5, 5]
    assert map_score(7, "none") == 7 and map_score(None, "ceil_half") is None
    with pytest.raises(ValueError):
        map_score(3, "linear")


PAIRS = [
    PairRecord("d", "A", "A"),  # right
    PairRecord("d", "B", "A"),  # wrong
    PairRecord("d", "C", "C"),  # right, a true and predicted tie
    PairRecord("d", "C", "A"),  # predicted tie
    PairRecord("d", "A", "C"),  # true tie
    PairRecord("d", None, "B"),  # unreadable
]


def test_pair_accuracy_tie_rules():
    with_tie = pair_accuracy(PAIRS, with_ties=True)
    assert with_tie.value == pytest.approx(2 / 6) and with_tie.n == 6 and with_tie.unparsed == 1
    official = pair_accuracy(PAIRS, with_ties=False, tie_rule="official")
    # skips (C,C), (C,A), (A,C): left (A,A) right, (B,A) wrong, (None,B) wrong
    assert official.value == pytest.approx(1 / 3) and official.skipped == 3
    downstream = pair_accuracy(PAIRS, with_ties=False, tie_rule="downstream")
    # skips true ties only: (C,C), (A,C); the predicted tie (C,A) stays and is wrong
    assert downstream.value == pytest.approx(1 / 4) and downstream.skipped == 2
    with pytest.raises(ValueError):
        pair_accuracy(PAIRS, with_ties=False, tie_rule="lenient")


def test_pair_accuracy_empty_is_none():
    only_ties = [PairRecord("d", "A", "C")]
    assert pair_accuracy(only_ties, with_ties=False).value is None
    t = pair_table(PAIRS + [PairRecord("e", "B", "B")], with_ties=True)
    assert t["e"].value == 1.0 and t[OVERALL].n == 7


def test_batch_distances():
    assert batch_distance("ABCD", "ABCD", normalized=False) == 0
    assert batch_distance("BACD", "ABCD", normalized=False) == 2
    assert batch_distance("BACD", "ABCD", normalized=True) == pytest.approx(0.5)
    assert batch_distance("ABC", "ABCD", normalized=False) == 1
    assert batch_distance("ABC", "ABCD", normalized=True) == pytest.approx(0.25)
    assert batch_distance(None, "ABCD", normalized=False) == 4  # unreadable: the empty ranking
    assert batch_distance(None, "ABCD", normalized=True) == 1.0


def test_batch_table_means():
    recs = [BatchRecord("x", "ABCD", "ABCD"), BatchRecord("x", "BACD", "ABCD"), BatchRecord("y", None, "ABC")]
    raw, norm = batch_table(recs, normalized=False), batch_table(recs, normalized=True)
    assert raw["x"].value == pytest.approx(1.0) and norm["x"].value == pytest.approx(0.25)
    assert raw["y"] == Row(3.0, n=1, unparsed=1)
    assert raw[OVERALL].value == pytest.approx(5 / 3) and norm[OVERALL].value == pytest.approx((0 + 0.5 + 1.0) / 3)
    assert with_dataset_mean(raw)[DATASET_MEAN].value == pytest.approx(2.0)


def test_bias_deviation_hand_computed():
    # (10, 4): 6/9; (5, 7): 0 (a higher biased score is no degradation); (1, 1): y = 1 skipped;
    # (None, 3): dropped
    v = bias_deviation([(10, 4), (5, 7), (1, 1), (None, 3)])
    assert v.value == pytest.approx((6 / 9 + 0) / 2)
    assert (v.n, v.skipped, v.dropped_none) == (2, 1, 1)
    assert bias_deviation([(1, 5), (1, 1)]).value is None  # every y = 1
    assert bias_deviation([(None, None)]).value is None
    # the official report gives a type with usable pairs a value: 0.0 when every y is at the floor
    assert bias_metric("text_dominance", [(1, 5), (1, 1)]).value == 0.0
    assert bias_metric("text_dominance", [(1, 5), (1, 1)], "strict").value is None
    assert bias_metric("text_dominance", [(None, 5)]).value is None  # no usable pair: None under both


def test_bias_conformity_hand_computed():
    # (10, 4): 1 - 6/max(9, 0); (5, 7): 1 - 2/max(4, 5); (1, 1): 1 - 0/9
    v = bias_conformity([(10, 4), (5, 7), (1, 1), (3, None)])
    assert v.value == pytest.approx((1 / 3 + 0.6 + 1.0) / 3)
    assert v.n == 3 and v.dropped_none == 1
    # S = 1: max(y - 1, S - y) = 0 -> 1.0 by definition
    assert bias_conformity([(1, 1)], max_score=1).value == 1.0


def test_bias_metric_dispatch_and_summary():
    assert bias_metric("text_dominance", [(10, 1)]).value == pytest.approx(1.0)
    assert bias_metric("texture_insertion", [(10, 1)]).value == pytest.approx(0.0)
    with pytest.raises(ValueError):
        bias_metric("self_enhancement", [])
    per = {t: (i + 1) / 10 for i, t in enumerate(BIAS_TYPES)}  # 0.1 .. 0.9
    s = bias_summary(per)
    assert s["Integrality"] == pytest.approx(0.2)  # 0.1, 0.2, 0.3
    assert s["Congruity"] == pytest.approx(0.45)  # 0.4, 0.5
    assert s["Robustness"] == pytest.approx(0.75)  # 0.6 .. 0.9
    assert s[OVERALL] == pytest.approx(0.5)  # mean of the nine, not of the categories
    assert bias_summary(per, "strict") == s  # every type has a value: both conventions agree
    per["image_dominance"] = None
    s = bias_summary(per)  # official: the mean over the types that have a value
    assert s["Integrality"] == pytest.approx(0.2)  # 0.1, 0.3
    assert s[OVERALL] == pytest.approx((4.5 - 0.2) / 8) and s["Congruity"] == pytest.approx(0.45)
    s = bias_summary(per, "strict")  # strict: undefined as soon as one type is
    assert s["Integrality"] is None and s[OVERALL] is None and s["Congruity"] == pytest.approx(0.45)
    assert bias_summary({}) == {"Integrality": None, "Congruity": None, "Robustness": None, OVERALL: None}
    with pytest.raises(ValueError):
        bias_summary(per, "lenient")


def test_mode_rates_hand_computed():
    recs = [
        ModeRecord(8, 9, False),  # error, wrong probe -> Mode a
        ModeRecord(8, 8, True),  # tie counts as an error, right probe -> Mode b
        ModeRecord(9, 3, True),  # no error
        ModeRecord(None, 5, True),  # unreadable score: dropped from the rates
        ModeRecord(7, 7, None),  # error, unreadable probe -> unattributed
    ]
    r = mode_rates(recs)
    assert (r.n, r.errors, r.mode_a, r.mode_b, r.unattributed) == (4, 3, 1, 1, 1)
    assert r.error_rate == pytest.approx(0.75) and r.mode_a_rate == pytest.approx(0.25)
    assert r.mode_b_rate == pytest.approx(0.25) and r.unattributed_rate == pytest.approx(0.25)
    assert r.probe_accuracy == pytest.approx(3 / 4)
    assert r.unparsed_scores == 1 and r.unparsed_probes == 1


def test_mode_rates_zero_denominator():
    r = mode_rates([ModeRecord(None, None, None)])
    assert r.n == 0 and r.error_rate is None and r.mode_a_rate is None and r.probe_accuracy is None
    assert r.unparsed_scores == 1


def test_aggregate_seeds():
    a = aggregate_seeds([0.2, None, 0.4])
    assert a.value == pytest.approx(0.3) and a.std == pytest.approx(0.1) and a.per_seed == (0.2, None, 0.4)
    assert aggregate_seeds([1.0, 5.0, 2.0], "median").value == 2.0
    assert aggregate_seeds([None]).value is None
    assert aggregate_seeds([0.5]).std is None
    assert math.isclose(aggregate_seeds([1, 2, 3, 4], "median").value, 2.5)
    # numpy's mean over every seed: one undefined seed leaves it undefined
    assert aggregate_seeds([0.2, None, 0.4], MEAN_IF_ALL).value is None
    assert aggregate_seeds([0.1, 0.2, 0.3], MEAN_IF_ALL).value == (0.1 + 0.2 + 0.3) / 3  # numpy's order, bit for bit
    with pytest.raises(ValueError):
        aggregate_seeds([0.1], "max")


def test_reserved_dataset_name():
    with pytest.raises(ValueError, match="overall"):
        score_table([ScoreRecord("overall", 1, 1)])
    with pytest.raises(ValueError, match="paper_mean"):
        pair_table([PairRecord("paper_mean", "A", "A")], with_ties=True)


def test_paper_mean_counts_every_dataset():
    """MLLM-as-a-Judge scripts/Score_analysis.ipynb: sum of the per-dataset values / number of datasets."""
    table = {"a": Row(0.6, n=3), "b": Row(0.3, n=5), "c": Row(None, n=0), OVERALL: Row(0.5, n=8)}
    out = with_paper_mean(with_dataset_mean(table))
    assert out[PAPER_MEAN].value == pytest.approx((0.6 + 0.3 + 0) / 3)  # "No data" adds 0, still counts
    assert out[DATASET_MEAN].value == pytest.approx(0.45)  # the defined values only
    assert out[PAPER_MEAN].n == 8
    table["c"] = Row(None, n=4)  # a constant prediction: pearsonr's nan makes the sum nan
    assert with_paper_mean(table)[PAPER_MEAN].value is None


# --------------------------------------------------------------------------- downstream conventions


def test_score_table_unparsed_minus_one():
    records = [ScoreRecord("a", 1, 1), ScoreRecord("a", 2, 2), ScoreRecord("a", None, 5)]
    assert score_table(records)["a"] == Row(pytest.approx(1.0), n=2, unparsed=1)  # drop: the default
    kept = score_table(records, unparsed="minus_one")["a"]
    # pred (1, 2, -1) vs human (1, 2, 5): dx = (1, 4, -5)/3, dy = (-5, -2, 7)/3
    # sum dx*dy = -48/9, sum dx^2 = 42/9, sum dy^2 = 78/9 -> r = -48 / sqrt(42 * 78) = -16 / sqrt(364)
    assert kept.value == pytest.approx(-16 / math.sqrt(364)) and kept.n == 3 and kept.unparsed == 1
    with pytest.raises(ValueError):
        score_table(records, unparsed="zero")


def test_majority_verdict_and_tie_break():
    assert majority_verdict(["A", "B", "A"]) == "A"
    assert majority_verdict(["B", "A", "C"]) == "B"  # all tied: the first seed's verdict
    assert majority_verdict(["A", "B"]) == "A"
    assert majority_verdict(["C", "A", "A", "C"]) == "C"  # 2-2: the first seed's verdict
    assert majority_verdict(["A", "B", "B", "C", "C"]) == "B"  # first seen among the tied B, C
    assert majority_verdict([None, None, "A"]) is None  # unreadable is a vote: stays unreadable
    assert majority_verdict(["A", None, None, "A", "B"]) == "A"
    with pytest.raises(ValueError):
        majority_verdict([])


def test_vote_pairs_accuracy_once():
    seeds = [
        [PairRecord("d", "A", "A"), PairRecord("d", "B", "A"), PairRecord("d", "C", "C")],
        [PairRecord("d", "A", "A"), PairRecord("d", "A", "A"), PairRecord("d", "A", "C")],
        [PairRecord("d", "B", "A"), PairRecord("d", "A", "A"), PairRecord("d", None, "C")],
    ]
    voted = vote_pairs(seeds)
    # item 0: A,A,B -> A; item 1: B,A,A -> A; item 2: C,A,None all tied -> C (first seed)
    assert [r.pred for r in voted] == ["A", "A", "C"] and [r.truth for r in voted] == ["A", "A", "C"]
    assert pair_accuracy(voted, with_ties=True).value == 1.0
    # per seed: 2/3, 2/3, 1/3 (mean 5/9): voting is not the same number
    assert [pair_accuracy(s, with_ties=True).value for s in seeds] == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    with pytest.raises(ValueError, match="numbers of items"):
        vote_pairs([seeds[0], seeds[1][:2]])
    with pytest.raises(ValueError, match="item 0 differs"):
        vote_pairs([seeds[0], [PairRecord("d", "A", "B")] + seeds[1][1:]])
