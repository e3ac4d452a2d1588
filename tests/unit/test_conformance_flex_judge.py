"""Conformance with Flex-Judge's evaluation (`eval.convention=flex_judge`).

Official source: jongwooko/flex-judge, `test/evaluate.py` `mllm_judge_eval` (pair, score and batch
branches: what it prints per dataset and as "Ave"), fed by `test/mllm_as_a_judge_vllm.py` `main`
(the per-seed `pred` of a pair: the first two <answer>(\\d+)</answer> integers, C on failure).
Expectations are computed by hand from that code. It also settles three conventions pjray had
attributed to Flex-Judge: its pair vote is the sign of a sum, not a plurality
(`eval.pair_vote=majority` is pjray's); its score median is over growing pools of seeds, not over
per-seed r (`eval.seed_agg=median` is pjray's); an unreadable score is -1 (`unparsed_score=minus_one`
matches).
"""

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pjray.config import load
from pjray.eval import flex_judge as fj
from pjray.eval.judge_bench import evaluate_bench, read_batch, read_pair, read_score
from pjray.eval.metrics import (
    DATASET_MEAN,
    OVERALL,
    BatchRecord,
    PairRecord,
    ScoreRecord,
    batch_table,
    majority_verdict,
    pair_table,
    pearson,
    score_table,
)

T = "<think>the reasoning</think>"
FIXTURES = Path(__file__).parents[1] / "fixtures" / "mllm_judge"


# --------------------------------------------------------------------------- reading (raw text -> number)


@pytest.mark.parametrize(
    "text, strict, release",
    [
        (T + "<answer>4</answer>", 4.0, 4.0),
        (T + "<answer>8</answer><answer>3</answer>", 3.0, 8.0),  # strict: the last block; Flex: the first
        ("<think>first <answer>2</answer></think><answer>9</answer>", 9.0, 2.0),  # a block inside think
        (T + "<answer> 8 </answer>", 8.0, None),  # whitespace inside the tags: Flex reads nothing (-1)
        (T + "<answer>Score: 8</answer>", None, None),  # labelled
        (T + "<answer>12</answer>", None, 12.0),  # out of range: Flex keeps it as it is
        (T + "<answer>0</answer>", None, 0.0),  # zero: kept
        (T + "<answer>\u0668</answer>", None, 8.0),  # Arabic-Indic 8
        ("nothing", None, None),
    ],
)
def test_score_reading(text, strict, release):
    """`mllm_judge_eval` score: v = ints of <answer>(\\d+)</answer>; -1 if none, else v[0] as is."""
    assert read_score(text, "paper", "none") == strict
    assert fj.read_score(text) == release


@pytest.mark.parametrize(
    "text, strict, release",
    [
        ("<answer>3</answer><answer>7</answer><answer>9</answer>", None, "B"),
        ("<answer>7</answer>", None, None),  # fewer than two: the generation script writes C
        ("<answer> 8 </answer><answer> 2 </answer>", "A", None),
    ],
)
def test_pair_reading(text, strict, release):
    """`mllm_as_a_judge_vllm.py` `main`: pred from the first two answer integers, C on failure."""
    assert read_pair(T + text, "paper") == strict
    assert fj.read_pair(T + text) == release


@pytest.mark.parametrize(
    "text, strict, release",
    [
        ("<answer>9</answer><answer>5</answer><answer>2</answer>", "ABC", "ABC"),
        ("<answer>3</answer><answer>8</answer><answer>6</answer><answer>9</answer>", None, "DBCA"),  # all, uncut
        ("<answer>Assistant 1: 8</answer><answer>Assistant 2: 6</answer><answer>Assistant 3: 9</answer>", None, None),
        ("<answer>8 6 9</answer>", None, None),
        ("<answer>\n8</answer><answer>2</answer><answer>5</answer>", "ACB", "BA"),  # only the tight blocks: 2, 5
        ("<answer>5</answer><answer>5</answer><answer>2</answer>", "BAC", "BAC"),
    ],
)
def test_batch_reading(text, strict, release):
    """`mllm_judge_eval` batch: every <answer>(\\d+)</answer> integer, ranked (no cut to len(truth))."""
    assert read_batch(T + text, 3, "paper") == strict
    assert fj.read_batch(T + text) == release


# --------------------------------------------------------------------------- across seeds (records -> number)


@pytest.mark.parametrize(
    "verdicts, voted, plurality",
    [
        (("A", "B", "C"), "C", "A"),  # -1 + 1 + 0 = 0: a tie; pjray's plurality takes the first seed's
        (("A", "C", "C"), "A", "C"),  # -1: A, where the plurality says C
        (("C", "C", "A"), "A", "C"),
        (("A", "A", "B"), "A", "A"),
        ((None, None, "B"), "B", None),  # unreadable counts as C (0)
        (("A", "B"), "C", "A"),
    ],
)
def test_sign_vote(verdicts, voted, plurality):
    """`mllm_judge_eval` pair: p2n = {A: -1, B: 1, C: 0}; e = sum; A if e < 0, B if e > 0, else C."""
    assert fj.sign_vote(verdicts) == voted
    assert majority_verdict(verdicts) == plurality


def test_pair_tables_vote_and_rounded_ave():
    """Accuracy of the voted verdicts per dataset; "Ave" averages the values rounded to 3 decimals."""
    seeds = [
        [
            PairRecord("d1", "A", "A"),
            PairRecord("d1", "B", "B"),
            PairRecord("d1", None, "C"),
            PairRecord("d2", "A", "A"),
            PairRecord("d2", "B", "B"),
            PairRecord("d2", "B", "A"),
        ],
        [
            PairRecord("d1", "C", "A"),
            PairRecord("d1", "A", "B"),
            PairRecord("d1", None, "C"),
            PairRecord("d2", "A", "A"),
            PairRecord("d2", "B", "B"),
            PairRecord("d2", None, "A"),
        ],
        [
            PairRecord("d1", "C", "A"),
            PairRecord("d1", "C", "B"),
            PairRecord("d1", None, "C"),
            PairRecord("d2", "B", "A"),
            PairRecord("d2", "B", "B"),
            PairRecord("d2", "C", "A"),
        ],
    ]
    # d1: (A, C, C) -> A right; (B, A, C) -> C wrong; (None x3) -> C right
    # d2: (A, A, B) -> A right; (B, B, B) right; (B, None, C) -> B wrong
    tables = fj.pair_tables(seeds)
    with_tie, without = tables["acc_with_tie"], tables["acc_without_tie"]
    assert with_tie["d1"].value == pytest.approx(2 / 3) and with_tie["d2"].value == pytest.approx(2 / 3)
    assert with_tie[DATASET_MEAN].value == (0.667 + 0.667) / 2  # not 2/3: the rounded values
    assert without["d1"].value == 0.5 and without["d1"].skipped == 1 and without["d2"].value == pytest.approx(2 / 3)
    assert without[DATASET_MEAN].value == (0.5 + 0.667) / 2
    assert with_tie["d1"].unparsed == 3 and with_tie["d2"].unparsed == 1
    assert OVERALL not in with_tie  # the script prints no pooled row


def test_score_tables_growing_pools_and_median():
    """Seed k's r is over the items of seeds 0..k (the lists are never reset); nan -> 0; median."""
    humans = (1.0, 2.0, 3.0)

    def seed(dataset, preds):
        return [ScoreRecord(dataset, p, h) for p, h in zip(preds, humans)]

    seeds = [
        seed("x", (3.0, 2.0, 1.0)) + seed("y", (2.0, 2.0, 2.0)),
        seed("x", (1.0, 2.0, 3.0)) + seed("y", (None, 2.0, 3.0)),
        seed("x", (1.0, 2.0, 3.0)) + seed("y", (2.0, 2.0, 2.0)),
    ]
    t = fj.score_tables(seeds)["pearson"]
    # x: pools r = -1, 0, 1/3 -> median 0 (per-seed r would be -1, 1, 1: median 1)
    assert t["x"].value == pytest.approx(0.0, abs=1e-12) and t["x"].n == 9
    # y: seed 0 constant -> nan -> 0; pool of 6 (x = 2 2 2 -1 2 3): Sxy = 4, Sxx = 84/9, Syy = 4 -> 6 / sqrt(84);
    # pool of 9 (x = 2 2 2 -1 2 3 2 2 2): Sxy = 36 - 16 * 18 / 9 = 4, Sxx = 38 - 256/9 = 86/9, Syy = 6
    # -> 12 / sqrt(516); median of (0, 0.655, 0.528) = 12 / sqrt(516)
    assert t["y"].value == pytest.approx(12 / math.sqrt(516)) and t["y"].unparsed == 1
    assert t[DATASET_MEAN].value == pytest.approx((0 + 12 / math.sqrt(516)) / 2)
    assert pearson([2, 2, 2, -1, 2, 3], [1, 2, 3] * 2) == pytest.approx(6 / math.sqrt(84))


def test_batch_tables_growing_pools_and_maximum():
    """Seed k's value is the mean distance over seeds 0..k; each dataset takes the maximum."""
    seeds = [
        [BatchRecord("z", "ABC", "ABC"), BatchRecord("w", "ABDC", "ABCD")],
        [BatchRecord("z", None, "ABC"), BatchRecord("w", "ABDC", "ABCD")],
        [BatchRecord("z", "ABC", "ABC"), BatchRecord("w", "ABDC", "ABCD")],
    ]
    t = fj.batch_tables(seeds)["levenshtein_norm"]
    assert t["z"].value == 0.5  # means 0, 1/2, 1/3 -> max 1/2 (pjray's per-seed mean: 1/3)
    assert t["w"].value == 0.5  # Levenshtein(ABDC, ABCD) = 2, / 4
    assert t[DATASET_MEAN].value == 0.5 and t["z"].unparsed == 1


def test_undefined_where_the_script_stops():
    """A dataset with only true ties divides by zero in the no-tie accuracy; one item is too few
    for pearsonr: no official number, undefined here (and so is "Ave")."""
    tables = fj.pair_tables([[PairRecord("d", "A", "C"), PairRecord("e", "A", "A")]])
    assert tables["acc_without_tie"]["d"].value is None and tables["acc_without_tie"][DATASET_MEAN].value is None
    assert tables["acc_with_tie"][DATASET_MEAN].value == 0.5  # d: 0, e: 1
    t = fj.score_tables([[ScoreRecord("one", 3.0, 3.0)]])["pearson"]
    assert t["one"].value is None and t[DATASET_MEAN].value is None
    with pytest.raises(ValueError, match="different numbers of items"):
        fj.pair_tables([[PairRecord("d", "A", "A")], []])
    with pytest.raises(ValueError, match="item 0 differs"):
        fj.pair_tables([[PairRecord("d", "A", "A")], [PairRecord("d", "A", "B")]])


# --------------------------------------------------------------------------- end to end


def test_evaluate_pair_and_score_end_to_end(tmp_path):
    texts = {"pair-0": T + "<answer>8</answer><answer>2</answer>", "pair-1": T + "<answer>4</answer><answer>4</answer>"}
    cfg = load(
        overrides=[
            "eval.bench=pair",
            f"eval.data={FIXTURES / 'pair.jsonl'}",
            "eval.seeds=[0,1,2]",
            "eval.convention=flex_judge",
        ]
    )
    report = evaluate_bench(cfg, lambda prompts, seed: [texts.get(p.item_id, "unreadable") for p in prompts])
    # pair-0 A right; pair-1 C vs B wrong; pair-2 unreadable -> C, right on the true tie
    assert report.tables["acc_with_tie"]["ChartQA"].value == 0.5 and report.tables["acc_with_tie"]["coco"].value == 1.0
    assert report.tables["acc_with_tie"][DATASET_MEAN].value == 0.75
    assert report.tables["acc_without_tie"][DATASET_MEAN].value is None  # coco has only a true tie
    assert report.unparsed == 3 and "sign vote" in report.sources["acc_with_tie"]
    assert report.convention.startswith("flex_judge")

    data = tmp_path / "score.jsonl"
    data.write_text(
        "".join(
            json.dumps({"score_id": i, "answer": "x", "instruction": "q", "original_dataset": "d", "human": h}) + "\n"
            for i, h in enumerate((1, 2, 3))
        )
    )
    answers = {0: (9, 6, 1), 1: (2, 4, 6), 2: (2, 4, 6)}  # raw scores on the judge's scale, no mapping
    cfg = load(overrides=["eval.bench=score", f"eval.data={data}", "eval.seeds=[0,1,2]", "eval.convention=flex_judge"])
    report = evaluate_bench(cfg, lambda prompts, seed: [T + f"<answer>{answers[seed][i]}</answer>" for i in range(3)])
    pools = ([9, 6, 1], [9, 6, 1, 2, 4, 6], [9, 6, 1, 2, 4, 6, 2, 4, 6])  # seeds 0..k together
    rs = sorted(pearson(pool, [1, 2, 3] * (len(pool) // 3)) for pool in pools)
    assert report.tables["pearson"]["d"].value == pytest.approx(rs[1])  # the median
    assert report.tables["pearson"][DATASET_MEAN].value == pytest.approx(rs[1])


# --------------------------------------------------------------------------- where the paths must agree

_datasets = st.sampled_from(["coco", "ChartQA", "WIT"])


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 3).flatmap(lambda n: st.lists(st.sampled_from("AB"), min_size=2 * n + 1, max_size=2 * n + 1)))
def test_sign_vote_is_the_plurality_without_ties_or_c(verdicts):
    assert fj.sign_vote(verdicts) == majority_verdict(verdicts)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_datasets, st.sampled_from("ABC"), st.sampled_from("ABC")), min_size=1, max_size=12))
def test_one_seed_pair_tables_equal_the_downstream_rule(items):
    records = [PairRecord(d, p, t) for d, p, t in items]
    tables = fj.pair_tables([records])
    for name, with_ties in (("acc_with_tie", True), ("acc_without_tie", False)):
        strict = pair_table(records, with_ties=with_ties, tie_rule="downstream")
        for row, cell in tables[name].items():
            if row != DATASET_MEAN:
                assert cell.value == pytest.approx(strict[row].value)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(_datasets, st.one_of(st.none(), st.integers(0, 12)), st.integers(1, 5)), min_size=2, max_size=12
    ),
    st.integers(1, 3),
)
def test_identical_seeds_score_is_one_seeds_r(items, seeds):
    """Pools of copies of one seed have that seed's r; a nan r is 0 in the script."""
    records = [ScoreRecord(d, None if p is None else float(p), float(h)) for d, p, h in items]
    cells = fj.score_tables([records] * seeds)["pearson"]
    strict = score_table(records, unparsed="minus_one")
    for row, cell in cells.items():
        if row == DATASET_MEAN:
            continue
        if strict[row].value is not None:
            assert cell.value == pytest.approx(strict[row].value)
        else:
            assert cell.value == (0.0 if strict[row].n >= 2 else None)


_rankings = st.permutations("ABCD").map("".join)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(_datasets, st.one_of(st.none(), _rankings), _rankings), min_size=1, max_size=12),
    st.integers(1, 3),
)
def test_identical_seeds_batch_is_one_seeds_mean(items, seeds):
    records = [BatchRecord(d, p, t) for d, p, t in items]
    cells = fj.batch_tables([records] * seeds)["levenshtein_norm"]
    strict = batch_table(records, normalized=True)
    for row, cell in cells.items():
        if row != DATASET_MEAN:
            assert cell.value == pytest.approx(strict[row].value)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 10),
    st.integers(1, 10),
    st.integers(3, 6).flatmap(lambda k: st.lists(st.integers(1, 10), min_size=k, max_size=k, unique=True)),
)
def test_well_formed_outputs_read_the_same(a, b, scores):
    pair = f"{T}<answer>{a}</answer><answer>{b}</answer>"
    assert fj.read_pair(pair) == read_pair(pair, "paper")
    assert fj.read_score(f"{T}<answer>{a}</answer>") == read_score(f"{T}<answer>{a}</answer>", "paper", "none") == a
    batch = T + "".join(f"<answer>{s}</answer>" for s in scores)
    assert fj.read_batch(batch) == read_batch(batch, len(scores), "paper")
