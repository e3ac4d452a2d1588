"""The text-only shortcut audit: nested PPJD tuples rank from the text alone, independent ones do not."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from pjray.ppjd.perturb import scene_items
from pjray.ppjd.pipeline import _frame
from pjray.ppjd.shortcuts import (
    TextSignals,
    audit,
    chance_scores,
    expected_correct_first,
    expected_exact,
    odd_one_out,
    rank,
    scene_qa,
    text_only_ranking,
    text_signals,
)
from pjray.ppjd.sources import RawRow, scene_rows
from pjray.ppjd.stages import perturb_rules, to_item


def one_object_tuples(construction: str) -> list:
    return scene_items(
        1000,
        seed=11,
        num_candidates=3,
        image_size=96,
        kinds=("color", "size"),
        objects=(1, 1),
        construction=construction,
    )


def test_nested_tuples_rank_perfectly_from_the_text_alone():
    report = audit(one_object_tuples("nested"))
    assert report["items"] == 1000
    assert (report["correct_first"], report["exact"]) == (1.0, 1.0)
    assert (report["chance_correct_first"], report["chance_exact"]) == (1 / 3, 1 / 6)  # exact, not approximately
    # Each rule alone gets half the way: consistency cannot tell the chosen answer from the
    # perception-only one, the odd one out cannot tell the two wrong ones apart.
    assert report["by_rule"]["consistency"] == {"correct_first": 0.5, "exact": 0.5}
    assert report["by_rule"]["odd_one_out"] == {"correct_first": 1.0, "exact": 0.5}
    assert report["by_rule"]["combined"] == {"correct_first": 1.0, "exact": 1.0}
    assert sorted(report["by_kind"]) == ["color", "size"]
    assert all(k["correct_first"] == k["exact"] == 1.0 for k in report["by_kind"].values())


def test_independent_tuples_leave_only_a_coin_flip_between_the_intact_candidates():
    report = audit(one_object_tuples("independent"))
    assert report["items"] == 1000
    # The self-contradicting candidate still goes last; the other two state different facts.
    assert report["correct_first"] == pytest.approx(1 / 2, abs=0.01)
    assert report["exact"] == pytest.approx(1 / 2, abs=0.01)
    odd = report["by_rule"]["odd_one_out"]
    assert odd["correct_first"] == pytest.approx(1 / 3, abs=0.01) and odd["exact"] == pytest.approx(1 / 6, abs=0.01)


def test_tied_rankings_score_the_expected_value_of_a_random_tie_break():
    order = (2, 0, 1)  # best -> worst
    assert (expected_correct_first([[2], [0], [1]], order), expected_exact([[2], [0], [1]], order)) == (1.0, 1.0)
    assert (expected_correct_first([[0, 2], [1]], order), expected_exact([[0, 2], [1]], order)) == (0.5, 0.5)
    assert (expected_correct_first([[2], [0, 1]], order), expected_exact([[2], [0, 1]], order)) == (1.0, 0.5)
    assert (expected_correct_first([[0, 1, 2]], order), expected_exact([[0, 1, 2]], order)) == (
        Fraction(1, 3),
        Fraction(1, 6),
    )
    assert (expected_correct_first([[0], [2, 1]], order), expected_exact([[0], [2, 1]], order)) == (0.0, 0.0)
    assert (expected_correct_first([[2, 1], [0]], order), expected_exact([[2, 1], [0]], order)) == (0.5, 0.0)
    # A ranker that ties everything scores exactly chance.
    for k in (2, 3, 4, 5):
        everything = [list(range(k))]
        best_first = tuple(range(k))
        assert (
            (expected_correct_first(everything, best_first), expected_exact(everything, best_first))
            == chance_scores(k)
            == (Fraction(1, k), Fraction(1, math.factorial(k)))
        )


def test_odd_one_out_needs_all_others_to_agree():
    assert odd_one_out(["x", "y", "y"]) == 0 and odd_one_out(["y", "y", "y", "x"]) == 3
    assert odd_one_out(["x", "y", "z"]) is None  # no shared fact
    assert odd_one_out(["x", "x", "y", "y"]) is None  # two camps
    assert odd_one_out(["x", "y"]) is None  # either one is the odd one
    assert odd_one_out(["y", "y", "y"]) is None


def test_consistency_orders_first_and_the_odd_one_out_breaks_its_ties():
    signals = TextSignals(problems=(0, 0, 2, 1), odd=1)
    assert rank(signals, ("consistency",)) == [[0, 1], [3], [2]]
    assert rank(signals, ("odd_one_out",)) == [[1], [0, 2, 3]]
    assert rank(signals) == [[1], [0], [3], [2]]
    # An odd one that contradicts itself stays below the consistent candidates.
    assert rank(TextSignals(problems=(0, 0, 1), odd=2)) == [[0, 1], [2]]


def test_free_text_rows_compare_the_attribute_words_they_state():
    candidates = [
        "The ball is blue and sits on the left. Final Answer: blue",
        "The ball is red and sits on the left. Final Answer: red",
        "The ball is red and sits on the left. It is red. Final Answer: red",  # more mentions, same facts
    ]
    assert text_only_ranking(candidates) == [[0], [1, 2]]
    assert text_only_ranking(candidates[:2] + ["The ball is green and sits on the left. Final Answer: green"]) == [
        [0, 1, 2]
    ]


def test_ppjd_rows_are_audited_from_their_scene_reference():
    rows = _frame(0, scene_rows(30, seed=5, image_size=96)).to_dict("records")
    items = []
    for row in rows:
        assert perturb_rules(row, 3) is None
        items.append(to_item(row, 3))
    in_process = scene_items(30, seed=5, num_candidates=3, image_size=96)
    for item, same in zip(items, in_process):
        assert scene_qa(item.meta) == scene_qa(same.meta) is not None
    report = audit(items)
    assert report == audit(in_process)
    assert (report["items"], report["correct_first"], report["exact"]) == (30, 1.0, 1.0)
    assert sum(k["items"] for k in report["by_kind"].values()) == 30 and len(report["by_kind"]) == 5


def free_text_rows(n: int, seed: int = 0) -> list[RawRow]:
    """Answers about a few coloured shapes, every other one a colour question and a count question;
    each ends in a conclusion a reasoning error can negate."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        shape = rng.choice(["circle", "square", "triangle", "star"])
        a, b = rng.sample(["red", "blue", "green", "yellow", "purple", "orange"], 2)
        if i % 2 == 0:
            question, answer = f"What colour is the {shape} on the left?", a
            chosen = (
                f"The image shows two {shape}s side by side.\nThe {shape} on the left is {a} and the one on the "
                f"right is {b}.\nSo the {shape} on the left is {a}.\nFinal Answer: {a}"
            )
        else:
            many, few = rng.sample(range(3, 10), 2)
            question, answer = f"How many {a} {shape}s are there?", str(many)
            chosen = (
                f"The picture shows {many} {a} {shape}s and {few} {b} {shape}s.\nI count the {a} {shape}s one by "
                f"one.\nSo the number of {a} {shape}s is {many}.\nFinal Answer: \\boxed{{{many}}}"
            )
        rows.append(RawRow(f"text-{i}", "test", question, chosen, answer))
    return rows


@pytest.mark.parametrize("construction, correct_first", [("nested", 1.0), ("independent", 1 / 3)])
def test_free_text_tuples_of_the_independent_construction_leave_the_text_only_ranker_at_chance(
    construction, correct_first
):
    items = []
    for row in _frame(0, free_text_rows(40)).to_dict("records"):
        assert perturb_rules(row, 3, construction) is None
        items.append(to_item(row, 3))
    report = audit(items)
    # Free text has no reasoning check, so only the odd one out can rank: it always fires on nested
    # tuples (the two wrong candidates state one wrong value) and never on independent ones.
    assert report["items"] == 40
    assert report["correct_first"] == report["by_rule"]["odd_one_out"]["correct_first"] == correct_first
    if construction == "independent":
        assert all(text_signals(item.candidates).odd is None for item in items)
