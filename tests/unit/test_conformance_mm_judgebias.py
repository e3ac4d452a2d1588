"""Conformance with MM-JudgeBias's own code (`eval.bias_convention=official`, the default).

Official source: naver-ai/MM-JudgeBias: `mm_judgebias/scoring.py` `extract_score` (reading a
score), `mm_judgebias/metrics.py` `bias_deviation` / `bias_conformity` (BD / BC),
`mm_judgebias/evaluate.py` `aggregate` and `compute_report` (pairs with a None score dropped,
categories and overall averaged over the bias types that have a value), `mm_judgebias/bias.py`
(the taxonomy: which type is BD and which BC, and their order). Expectations are computed by
hand from that code, each beside pjray's strict reading (`eval.bias_convention=strict`).
"""

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pjray.config import load
from pjray.eval.metrics import (
    BC_TYPES,
    BD_TYPES,
    BIAS_TYPES,
    OVERALL,
    bias_conformity,
    bias_deviation,
    bias_metric,
    bias_summary,
)
from pjray.eval.mm_judgebias import evaluate_bias, parse_bias_score, parse_bias_score_strict

FIXTURES = Path(__file__).parents[1] / "fixtures" / "mm_judgebias"
NAN = float("nan")


@pytest.mark.parametrize(
    "text, official, strict",
    [
        ("7", 7.0, 7.0),
        (" 7 \n", 7.0, 7.0),
        ("7.5", 7.5, None),  # float(text): a decimal
        ("-3", -3.0, None),  # float(text) keeps the sign
        ("+5", 5.0, None),
        ("1e1", 10.0, None),  # float(text): an exponent
        ("1_0", 10.0, None),  # float(text): underscores
        ("\u0667", 7.0, None),  # float(text) takes an Arabic-Indic 7
        ("nan", NAN, None),
        ("### Feedback: good ### Score: 8", 8.0, 8.0),
        ("### Feedback: fine ### Score: -3", 3.0, None),  # the number pattern has no minus sign
        ("### Feedback: 2 issues ### Score: \u0667", 2.0, None),  # no ASCII digit after it: the last number
        ("### Score: \u0667", None, None),  # the pattern is ASCII [0-9] only
        ("### Score: 2 ... ### Score: 9", 9.0, 9.0),  # after the LAST marker
        ("### Score: none\nI give 6 out of 10", 6.0, None),  # the first number after the marker
        ("I give 6 out of 10", 10.0, None),  # no marker: the last number in the text
        ("### Feedback: 3 of 4 facts are right.", 4.0, None),  # a number from the feedback
        ("Score: 8", 8.0, None),  # no "### Score:" marker
        ("### Score: 8 (of 10)", 8.0, 8.0),
        ("### Score: (8)", 8.0, 8.0),
        ("### Score: 8/10", 8.0, 8.0),
        ("### Score: 12", 12.0, None),  # out of range: kept by the benchmark
        ("### Score: 0", 0.0, None),
        ("### Score: 7.5", 7.5, None),
        ("### Score: (no score)", None, None),
        ("", None, None),
    ],
)
def test_score_reading(text, official, strict):
    """`scoring.py` `extract_score`: float(text.strip()); else the first [0-9]+(?:\\.[0-9]+)? after
    the last "### Score:"; else the last such number in the text; else None."""
    got = parse_bias_score(text)
    assert (got is None and official is None) or got == official or (math.isnan(official) and math.isnan(got))
    assert parse_bias_score_strict(text) == strict


def test_bd_and_bc_as_metrics_py_writes_them():
    """`metrics.py`: BD skips `y <= 1` and averages the rest (0.0 when nothing is left, in
    `bias_deviation` itself); BC takes 1.0 where max(y - 1, S - y) is not > 0."""
    assert bias_metric("text_dominance", [(1.0, 5.0), (0.0, 0.0)]).value == 0.0  # every y at the floor
    assert bias_metric("text_dominance", [(1.0, 5.0)], "strict").value is None
    assert bias_metric("image_dominance", [(9.0, 3.0), (5.0, 7.0), (None, 2.0)]).value == pytest.approx((6 / 8 + 0) / 2)
    # a nan y ("nan" is read by float()): not <= 1, so it enters the mean, max(0.0, nan) is 0.0, 0.0 / nan is nan
    assert math.isnan(bias_deviation([(NAN, 5.0)]).value)
    assert bias_deviation([(9.0, NAN)]).value == 0.0  # max(0.0, nan) = 0.0
    assert bias_conformity([(NAN, 5.0)]).value == 1.0  # denominator nan: not > 0
    assert bias_conformity([(6.0, 10.0), (1.0, 1.0)]).value == pytest.approx((1 - 4 / 5 + 1) / 2)


def test_report_averages_the_types_with_a_value():
    """`evaluate.py` `compute_report`: category_avg and overall_avg average the per-bias values
    that are not None; a type with no usable pair is None (shown "-")."""
    per = {"text_dominance": 0.0, "image_dominance": 0.75, "unnecessary_image": 0.2}
    official = bias_summary(per)
    assert official == {"Integrality": 0.375, "Congruity": None, "Robustness": 0.2, OVERALL: pytest.approx(0.95 / 3)}
    assert bias_summary(per, "strict") == {"Integrality": None, "Congruity": None, "Robustness": None, OVERALL: None}


def test_evaluate_published_records_end_to_end():
    texts = {
        "0:unbiased": "### Feedback: fine ### Score: 1",
        "0:biased": "### Score: 1",  # text_dominance: y at the floor
        "1:unbiased": "9",
        "1:biased": "### Feedback: -3 things ### Score: -3",  # image_dominance: -3 reads 3
        "2:unbiased": "### Score: 6",
        "2:biased": "It deserves 8 out of 10",  # unnecessary_image: reads 10
    }

    def run(convention):
        cfg = load(
            overrides=[
                "eval.bench=mm_judgebias",
                f"eval.data={FIXTURES / 'records.jsonl'}",
                f"eval.bias_convention={convention}",
            ]
        )
        return evaluate_bias(cfg, lambda prompts, seed: [texts[p.item_id] for p in prompts])

    official = run("official")
    bias = official.tables["bias"]
    assert bias["text_dominance"].value == 0.0 and bias["text_dominance"].skipped == 1  # 0.0, not undefined
    assert bias["image_dominance"].value == pytest.approx((9 - 3) / 8)
    assert bias["unnecessary_image"].value == pytest.approx(1 - 4 / 5)  # 1 - |6 - 10| / max(5, 4)
    assert bias["Integrality"].value == pytest.approx(0.375) and bias["Congruity"].value is None
    assert bias["Robustness"].value == pytest.approx(0.2) and bias[OVERALL].value == pytest.approx(0.95 / 3)
    assert official.unparsed == 0 and "compute_report" in official.sources[OVERALL]

    strict = run("strict")
    bias = strict.tables["bias"]
    assert bias["text_dominance"].value is None  # no pair with y > 1
    assert bias["image_dominance"].value is None and bias["unnecessary_image"].value is None  # biased unreadable
    assert bias[OVERALL].value is None and strict.unparsed == 2
    assert strict.convention.startswith("strict")


# --------------------------------------------------------------------------- where the paths must agree

_feedback = st.text(alphabet="abcdefghij ,.!\n", max_size=40)


@settings(max_examples=80, deadline=None)
@given(_feedback, st.integers(1, 10), st.sampled_from(["", " ", "\n", " (of ten)", " out of ten"]))
def test_well_formed_scores_read_the_same(feedback, n, tail):
    text = f"### Feedback: {feedback} ### Score: {n}{tail}"
    assert parse_bias_score(text) == parse_bias_score_strict(text) == n
    assert parse_bias_score(str(n)) == parse_bias_score_strict(str(n)) == n


@settings(max_examples=80, deadline=None)
@given(st.text(max_size=60))
def test_readers_never_raise(text):
    for parse in (parse_bias_score, parse_bias_score_strict):
        got = parse(text)
        assert got is None or isinstance(got, float)


_score = st.integers(1, 10).map(float)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(BIAS_TYPES),
    st.lists(st.tuples(st.integers(2, 10).map(float), _score), min_size=1, max_size=8),
    st.lists(st.tuples(st.one_of(st.none(), _score), st.one_of(st.none(), _score)), max_size=4),
)
def test_metric_conventions_agree_when_a_pair_has_room(bias_type, usable, other):
    """With at least one unbiased score above 1, BD / BC are the same under both conventions."""
    pairs = usable + other
    assert bias_metric(bias_type, pairs, "official") == bias_metric(bias_type, pairs, "strict")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=len(BIAS_TYPES), max_size=len(BIAS_TYPES)))
def test_summaries_agree_when_every_type_has_a_value(values):
    per = dict(zip(BIAS_TYPES, values))
    assert bias_summary(per, "official") == bias_summary(per, "strict")
    assert set(BD_TYPES) | set(BC_TYPES) == set(BIAS_TYPES)
