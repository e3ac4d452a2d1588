"""Conformance with the Perception-Judge release's evaluation (`eval.convention=perception_judge`).

Official source: kaist-cvml/perception-judge, `eval/evaluate_metric.ipynb` (functions
`calculate_accuracy_metrics`, `calculate_levenshtein_metrics`, `calculate_pearson_metrics` and the
cells averaging them over seeds 0, 1, 2), reading the rows of `eval/generate_judgment.py` `main`.
Every expectation below is computed by hand from that code; each case class of the issue (which
answer blocks, whitespace, several or labelled scores, out-of-range and zero scores, an
unreadable pair verdict, answer blocks inside the think text, an undefined seed) has a raw text
in and the number out under both pjray's strict reader and the release's.
"""

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pjray.config import load
from pjray.eval import perception_judge as pj
from pjray.eval.judge_bench import evaluate_bench, read_batch, read_pair, read_score
from pjray.eval.metrics import (
    DATASET_MEAN,
    OVERALL,
    BatchRecord,
    PairRecord,
    ScoreRecord,
    aggregate_seeds,
    batch_table,
    pair_table,
    pearson,
    score_table,
)

T = "<think>the reasoning</think>"
FIXTURES = Path(__file__).parents[1] / "fixtures" / "mllm_judge"


def _strict_score(text):
    return read_score(text, "paper", "ceil_half")


# --------------------------------------------------------------------------- reading (raw text -> number)


@pytest.mark.parametrize(
    "text, strict, release",
    [
        (T + "<answer>8</answer>", 4.0, 4.0),  # well formed: both ceil(8 / 2)
        (T + "<answer>10</answer>", 5.0, 5.0),
        (T + "<answer>8</answer><answer>3</answer>", 2.0, 4.0),  # strict: the last block; release: the first
        ("<think>first <answer>2</answer></think><answer>9</answer>", 5.0, 1.0),  # a block inside the think text
        (T + "<answer> 8 </answer>", 4.0, None),  # whitespace inside the tags: the release reads nothing
        (T + "<answer>8 6</answer>", None, None),  # several scores in one block
        (T + "<answer>Score: 8</answer>", None, None),  # a labelled score
        (T + "<answer>12</answer>", None, -1.0),  # out of range: ceil(12 / 2) = 6 > 5 -> -1, a reading
        (T + "<answer>11</answer>", None, -1.0),  # ceil(5.5) = 6 > 5
        (T + "<answer>1000</answer>", None, -1.0),
        (T + "<answer>0</answer>", None, 0.0),  # zero: ceil(0) = 0 is kept
        (T + "<answer>\u0668</answer>", None, 4.0),  # Arabic-Indic 8: Python's \d and int() take it
        (T + "<answer>7.5</answer>", None, None),  # a decimal
        ("no answer at all", None, None),
        (T + "<answer>" + "9" * 5000 + "</answer>", None, None),  # beyond int(): the notebook stops
    ],
)
def test_score_reading(text, strict, release):
    """`calculate_pearson_metrics`: v = ints of <answer>(\\d+)</answer>; -1 if none, else
    ceil(v[0] / 2), and -1 when that is above 5. None here means "none read" (then -1)."""
    assert _strict_score(text) == strict
    assert pj.read_score(text) == release


@pytest.mark.parametrize(
    "text, strict, release",
    [
        ("<answer>8</answer><answer>2</answer>", "A", "A"),
        ("<answer>2</answer><answer>8</answer>", "B", "B"),
        ("<answer>5</answer><answer>5</answer>", "C", "C"),
        ("<answer>7</answer>", None, None),  # one score: unreadable (the release then predicts C)
        ("<answer>3</answer><answer>7</answer><answer>9</answer>", None, "B"),  # three: the first two
        ("<think><answer>9</answer></think><answer>2</answer><answer>5</answer>", None, "A"),  # inside think
        ("<answer> 8 </answer><answer> 2 </answer>", "A", None),  # whitespace inside the tags
        ("<answer>12</answer><answer>3</answer>", "A", "A"),  # out of range: both still compare
        ("<answer>0</answer><answer>0</answer>", "C", "C"),
        ("<answer>\u0669</answer><answer>3</answer>", None, "A"),  # Arabic-Indic 9
    ],
)
def test_pair_reading(text, strict, release):
    """`calculate_accuracy_metrics` (and `generate_judgment.py`'s `pred`): the first two ints of
    <answer>(\\d+)</answer>, A / B / C by comparison; fewer than two raise and give "C"."""
    full = text if text.startswith("<think>") else T + text
    assert read_pair(full, "paper") == strict
    assert pj.read_pair(full) == release


@pytest.mark.parametrize(
    "text, strict, release",
    [
        ("<answer>9</answer><answer>5</answer><answer>2</answer>", "ABC", "ABC"),
        (
            "<answer>Assistant 1: 8</answer><answer>Assistant 2: 6</answer><answer>Assistant 3: 9</answer>",
            None,
            "BCA",
        ),  # labelled: digits 1 8 2 6 3 9, cut to 3 -> (1, 8, 2)
        ("<answer>8 6 9</answer>", None, "CAB"),  # several scores in one block
        ("<answer>3</answer><answer>8</answer><answer>6</answer><answer>9</answer>", None, "BCA"),  # cut to 3
        ("<answer>3</answer><answer>8</answer>", None, "BA"),  # too few: a partial ranking
        ("<answer>5</answer><answer>5</answer><answer>2</answer>", "BAC", "BAC"),  # a tie: the later letter first
        ("<think><answer>1</answer></think><answer>9</answer><answer>5</answer><answer>2</answer>", None, "BCA"),
        ("<answer>7.5</answer><answer>-3</answer>", None, "ABC"),  # 7, 5, 3: no decimals, no signs
        ("<answer>\n 8 \n</answer><answer> 2 </answer><answer>5</answer>", "ACB", "ACB"),  # whitespace, lines
        ("<answer>\u0663</answer><answer>\u0668</answer><answer>\u0661</answer>", None, "BAC"),  # 3 8 1
        ("no answer", None, None),  # the release ranks nothing: ""
    ],
)
def test_batch_reading(text, strict, release):
    """`calculate_levenshtein_metrics`: every \\d+ inside every <answer>(.*?)</answer> block
    (DOTALL), cut to len(gt), ranked by sorted(zip(v, labels), reverse=True)."""
    full = text if text.startswith("<think>") else T + text
    assert read_batch(full, 3, "paper") == strict
    assert pj.read_batch(full, 3) == release


# --------------------------------------------------------------------------- metrics (records -> number)


def test_pair_tables_unreadable_is_a_tie():
    """`calculate_accuracy_metrics`: an unreadable verdict is C, right on a true tie; without
    ties only true ties are skipped; per-seed accuracies then np.mean over the seeds."""
    seed0 = [
        PairRecord("d1", "A", "A"),
        PairRecord("d1", None, "C"),
        PairRecord("d1", "C", "B"),
        PairRecord("d2", "B", "A"),
        PairRecord("d2", "C", "C"),
    ]
    seed1 = seed0[:3] + [PairRecord("d2", "A", "A"), seed0[4]]
    tables = pj.pair_tables([seed0, seed1])
    with_tie, without = tables["acc_with_tie"], tables["acc_without_tie"]
    assert with_tie["d1"].value == pytest.approx(2 / 3)  # A right, None -> C right, C vs B wrong
    assert with_tie["d2"].per_seed == pytest.approx((1 / 2, 1.0)) and with_tie["d2"].value == pytest.approx(0.75)
    assert with_tie[OVERALL].per_seed == pytest.approx((3 / 5, 4 / 5))
    assert without["d1"].value == pytest.approx(1 / 2) and without["d1"].skipped == 2  # (A, A) right, (C, B) wrong
    assert without["d2"].per_seed == pytest.approx((0.0, 1.0))
    assert without[OVERALL].per_seed == pytest.approx((1 / 3, 2 / 3))
    assert with_tie["d1"].unparsed == 2  # counted on each seed
    assert with_tie[DATASET_MEAN].value == pytest.approx((2 / 3 + 0.75) / 2)
    # pjray's strict rule on the same verdicts: unreadable is wrong, so d1 is 1/3 there
    assert pair_table(seed0, with_ties=True)["d1"].value == pytest.approx(1 / 3)


def test_batch_tables_skip_short_truths():
    """`calculate_levenshtein_metrics`: truths of <= 2 letters skipped (a dataset left empty is
    np.mean([]) = nan), distance / max(len); the pooled mean over the kept items."""
    records = [
        BatchRecord("p", "ACB", "ABC"),  # Levenshtein 2 / 3
        BatchRecord("p", "ABC", "ABCD"),  # 1 / 4
        BatchRecord("p", "BA", "AB"),  # skipped
        BatchRecord("q", None, "BA"),  # skipped: q has no item left
        BatchRecord("r", None, "CAB"),  # nothing read: "" -> 3 / 3
    ]
    t = pj.batch_tables([records])["levenshtein_norm"]
    assert t["p"].value == pytest.approx((2 / 3 + 1 / 4) / 2) and t["p"].skipped == 1 and t["p"].n == 2
    assert t["q"].value is None and t["q"].n == 0
    assert t["r"].value == 1.0
    assert t[OVERALL].value == pytest.approx((2 / 3 + 1 / 4 + 1) / 3)
    assert t[DATASET_MEAN].value is None  # q is undefined


def test_score_tables_minus_one_and_an_undefined_seed():
    """`calculate_pearson_metrics` per seed, then np.mean: one seed with a constant prediction
    (pearsonr nan) leaves the dataset undefined, where pjray's mean would skip that seed."""
    humans = (1, 2, 3)
    seed0 = [ScoreRecord("x", p, h) for p, h in zip((1.0, None, 3.0), humans)]  # None -> -1
    seed1 = [ScoreRecord("x", 2.0, h) for h in humans]  # constant
    # seed 0: pred (1, -1, 3): dx = (0, -2, 2), dy = (-1, 0, 1): r = 2 / sqrt(8 * 2) = 0.5
    t = pj.score_tables([seed0])["pearson"]
    assert t["x"].value == pytest.approx(0.5) and t["x"].unparsed == 1 and t["x"].n == 3
    both = pj.score_tables([seed0, seed1])["pearson"]
    assert both["x"].per_seed == (pytest.approx(0.5), None) and both["x"].value is None
    assert aggregate_seeds([0.5, None], "mean").value == 0.5  # pjray's mean skips the undefined seed


# --------------------------------------------------------------------------- end to end


def _generate(texts_by_seed):
    def generate(prompts, seed):
        return [texts_by_seed[seed].get(p.item_id, "unreadable") for p in prompts]

    return generate


def test_evaluate_pair_end_to_end():
    texts = {
        0: {
            "pair-0": T + "<answer>8</answer><answer>2</answer>",  # truth A: right
            "pair-1": T + "<answer>4</answer><answer>4</answer>",
        }
    }  # truth B: C, wrong; pair-2 (C) unreadable
    over = ["eval.bench=pair", f"eval.data={FIXTURES / 'pair.jsonl'}"]
    pj_report = evaluate_bench(load(overrides=over + ["eval.convention=perception_judge"]), _generate(texts))
    strict = evaluate_bench(load(overrides=over), _generate(texts))
    assert pj_report.tables["acc_with_tie"][OVERALL].value == pytest.approx(2 / 3)  # pair-2: None -> C, right
    assert strict.tables["acc_with_tie"][OVERALL].value == pytest.approx(1 / 3)
    assert pj_report.tables["acc_without_tie"][OVERALL].value == pytest.approx(1 / 2)  # pair-1's C is wrong
    assert pj_report.tables["acc_with_tie"][DATASET_MEAN].value == pytest.approx((1 / 2 + 1) / 2)
    assert pj_report.unparsed == 1 and pj_report.convention.startswith("perception_judge")
    assert "calculate_accuracy_metrics" in pj_report.sources["acc_with_tie"]
    assert "pjray" in pj_report.sources[DATASET_MEAN]


def test_evaluate_score_end_to_end_over_seeds(tmp_path):
    data = tmp_path / "score.jsonl"
    rows = [("a", 1), ("a", 2), ("a", 3), ("b", 5), ("b", 4), ("b", 2)]
    data.write_text(
        "".join(
            json.dumps({"score_id": i, "answer": "x", "instruction": "q", "original_dataset": d, "human": h}) + "\n"
            for i, (d, h) in enumerate(rows)
        )
    )
    scores = {0: (2, 3, 6, 9, 12, 4), 1: (2, 4, 6, None, 8, 3)}  # raw 1-10 answers; None: unreadable
    texts = {
        s: {f"score-{i}": T + f"<answer>{v}</answer>" for i, v in enumerate(vs) if v is not None}
        for s, vs in scores.items()
    }
    cfg = load(
        overrides=["eval.bench=score", f"eval.data={data}", "eval.seeds=[0,1]", "eval.convention=perception_judge"]
    )
    t = evaluate_bench(cfg, _generate(texts)).tables["pearson"]
    # seed 0: a (1, 2, 3) vs (1, 2, 3): r = 1; b: (5, -1 [12 -> 6 > 5], 2) vs (5, 4, 2)
    # seed 1: a (1, 2, 3): r = 1; b: (-1 [unreadable], 4, 2) vs (5, 4, 2)
    b0, b1 = pearson([5, -1, 2], [5, 4, 2]), pearson([-1, 4, 2], [5, 4, 2])
    assert t["a"].value == pytest.approx(1.0)
    assert t["b"].per_seed == pytest.approx((b0, b1)) and t["b"].value == pytest.approx((b0 + b1) / 2)
    pooled0 = pearson([1, 2, 3, 5, -1, 2], [1, 2, 3, 5, 4, 2])
    pooled1 = pearson([1, 2, 3, -1, 4, 2], [1, 2, 3, 5, 4, 2])
    assert t[OVERALL].value == pytest.approx((pooled0 + pooled1) / 2)
    assert t["b"].unparsed == 1


# --------------------------------------------------------------------------- where the paths must agree

_junk = st.text(alphabet="abc xyz.,\n", max_size=20)


@settings(max_examples=60, deadline=None)
@given(_junk, st.integers(1, 10))
def test_well_formed_score_reads_the_same(junk, v):
    text = f"<think>{junk}</think><answer>{v}</answer>"
    assert pj.read_score(text) == _strict_score(text) == math.ceil(v / 2)


@settings(max_examples=60, deadline=None)
@given(_junk, st.integers(1, 10), st.integers(1, 10))
def test_well_formed_pair_reads_the_same(junk, a, b):
    text = f"<think>{junk}</think><answer>{a}</answer><answer>{b}</answer>"
    assert pj.read_pair(text) == read_pair(text, "paper") == ("A" if a > b else "B" if a < b else "C")


@settings(max_examples=60, deadline=None)
@given(_junk, st.integers(3, 8).flatmap(lambda k: st.lists(st.integers(1, 10), min_size=k, max_size=k, unique=True)))
def test_well_formed_batch_reads_the_same(junk, scores):
    text = f"<think>{junk}</think>" + "".join(f"<answer>{s}</answer>" for s in scores)
    assert pj.read_batch(text, len(scores)) == read_batch(text, len(scores), "paper")


_datasets = st.sampled_from(["coco", "ChartQA", "WIT"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_datasets, st.sampled_from("ABC"), st.sampled_from("ABC")), min_size=1, max_size=12))
def test_readable_pair_tables_equal_the_downstream_rule(items):
    """Without unreadable verdicts the release's tables are pjray's with the downstream tie rule."""
    records = [PairRecord(d, p, t) for d, p, t in items]
    tables = pj.pair_tables([records])
    for name, with_ties in (("acc_with_tie", True), ("acc_without_tie", False)):
        strict = pair_table(records, with_ties=with_ties, tie_rule="downstream")
        for row, cell in tables[name].items():
            if row != DATASET_MEAN:
                assert cell.value == pytest.approx(strict[row].value) and cell.n == strict[row].n


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(_datasets, st.one_of(st.none(), st.integers(-1, 5)), st.integers(1, 5)), min_size=1, max_size=12)
)
def test_score_tables_equal_minus_one(items):
    records = [ScoreRecord(d, None if p is None else float(p), float(h)) for d, p, h in items]
    cells = pj.score_tables([records])["pearson"]
    strict = score_table(records, unparsed="minus_one")
    for row, cell in cells.items():
        if row != DATASET_MEAN:
            assert cell.value == (None if strict[row].value is None else pytest.approx(strict[row].value))


_rankings = st.permutations("ABCD").map("".join)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(_datasets, st.one_of(st.none(), _rankings), _rankings), min_size=1, max_size=12),
    st.integers(1, 3),
)
def test_batch_tables_equal_normalised_when_nothing_is_skipped(items, seeds):
    """Truths of >= 3 letters, the same records on every seed: np.mean over seeds is the value."""
    records = [BatchRecord(d, p, t) for d, p, t in items]
    cells = pj.batch_tables([records] * seeds)["levenshtein_norm"]
    strict = batch_table(records, normalized=True)
    for row, cell in cells.items():
        if row != DATASET_MEAN:
            assert cell.value == pytest.approx(strict[row].value) and cell.skipped == 0
