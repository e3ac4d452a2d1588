"""Judge prompt rendering: letters, shuffles, targets, and the pair / score protocols."""

from __future__ import annotations

import collections
import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pjray.data.prompts import (
    LETTERS,
    SYSTEM_BATCH_RANKING,
    SYSTEM_BATCH_SCORES,
    SYSTEM_PAIR_RANKING,
    SYSTEM_PAIR_SCORES,
    SYSTEM_SCORE,
    order_from_ranking,
    render_batch,
    render_pair,
    render_score,
)
from pjray.data.sampler import shown_order
from pjray.reward import judge_reward, parse_pair, parse_score
from pjray.types import JudgeItem


def make_item(k: int = 3, order: tuple[int, ...] | None = None) -> JudgeItem:
    return JudgeItem(
        id=f"item-{k}",
        image=b"\x89PNG fake",
        question="How many red cars are there?",
        candidates=tuple(f"answer number {i}" for i in range(k)),
        order=tuple(range(k)) if order is None else order,
        source="scenes",
    )


def answer_for(prompt, item: JudgeItem, style: str) -> str:
    """A perfect response: the item's best -> worst candidates, written in the prompt's letters."""
    letter_of = {cand: LETTERS[pos] for pos, cand in enumerate(prompt.shown)}
    if style == "ranking":
        return "<think>ok</think><answer>" + " > ".join(letter_of[c] for c in item.order) + "</answer>"
    # scores: the best candidate gets the highest score; scores listed in letter order.
    k = len(item.order)
    score_of = {cand: 10 - rank for rank, cand in enumerate(item.order)} if k <= 10 else None
    if score_of is None:
        raise ValueError("scores style holds at most 10 distinct scores")
    return "<think>ok</think>" + "".join(f"<answer>{score_of[c]}</answer>" for c in prompt.shown)


def test_render_batch_layout_and_target():
    item = make_item(3, order=(2, 0, 1))
    p = render_batch(item, random.Random(0))
    assert (p.protocol, p.style, p.num_candidates) == ("batch", "ranking", 3)
    assert (p.item_id, p.image) == ("item-3", item.image)
    assert sorted(p.shown) == [0, 1, 2]
    expected_user = "[Question]\nHow many red cars are there?\n\n" + "\n\n".join(
        f"[Assistant {LETTERS[i]}'s Answer]\nanswer number {c}" for i, c in enumerate(p.shown)
    )
    assert p.user == expected_user
    assert "<image>" not in p.user and "image_pad" not in p.user
    # target: letters of candidates 2, 0, 1 under this shuffle.
    assert p.target == "".join(LETTERS[p.shown.index(c)] for c in (2, 0, 1))
    assert p.system == SYSTEM_BATCH_RANKING


def test_render_batch_shows_a_given_order():
    item = make_item(3, order=(2, 0, 1))
    p = render_batch(item, None, shown=(1, 2, 0))
    assert p.shown == (1, 2, 0)
    assert p.user.index("answer number 1") < p.user.index("answer number 2") < p.user.index("answer number 0")
    assert p.target == "BCA"  # candidate 2 under B, 0 under C, 1 under A
    with pytest.raises(ValueError, match="not a permutation"):
        render_batch(item, None, shown=(0, 0, 1))
    with pytest.raises(ValueError, match="needs an rng"):
        render_batch(item, None)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_training_stream_shows_every_order_once_per_block(k):
    blocks = math.factorial(k)
    n = 3 * blocks + 40
    orders = [shown_order(i, k, seed=7) for i in range(n)]
    for b in range(n // blocks):
        assert sorted(orders[b * blocks : (b + 1) * blocks]) == sorted(itertools.permutations(range(k)))
    assert orders == [shown_order(i, k, seed=7) for i in range(n)]  # a function of the index
    assert orders != [shown_order(i, k, seed=8) for i in range(n)]
    # Any window of 40 prompts (5 steps of 8) holds each order 40 / k! times, give or take the
    # partial blocks at its two ends.
    for start in range(3 * blocks):
        counts = collections.Counter(orders[start : start + 40])
        assert max(abs(counts[o] - 40 / blocks) for o in itertools.permutations(range(k))) <= 2


def test_training_stream_shuffles_each_prompt_past_four_candidates():
    orders = [shown_order(i, 6, seed=0) for i in range(50)]
    assert all(sorted(o) == list(range(6)) for o in orders)
    assert len(set(orders)) > 40


def test_render_batch_without_shuffle_keeps_stored_letters():
    item = make_item(4, order=order_from_ranking("CDAB"))
    p = render_batch(item, random.Random(0), shuffle=False)
    assert p.shown == (0, 1, 2, 3) and p.target == "CDAB"
    assert order_from_ranking("CDAB") == (2, 3, 0, 1)
    with pytest.raises(ValueError):
        order_from_ranking("CDAA")


def test_system_prompts_ask_for_think_and_answer():
    systems = [SYSTEM_BATCH_RANKING, SYSTEM_BATCH_SCORES, SYSTEM_PAIR_RANKING, SYSTEM_PAIR_SCORES]
    for s in systems + [SYSTEM_SCORE]:
        assert "<think> </think>" in s and "<answer> </answer>" in s
    assert "DO NOT assign the same score to multiple assistants" in SYSTEM_BATCH_SCORES
    assert "1-10" in SYSTEM_BATCH_SCORES and "1-10" in SYSTEM_SCORE
    assert "<answer>B > A > C</answer>" in SYSTEM_BATCH_RANKING
    assert render_batch(make_item(), random.Random(0), style="scores").system == SYSTEM_BATCH_SCORES


@pytest.mark.parametrize(
    "item, style, match",
    [
        (make_item(1), "ranking", "1 candidates"),
        (make_item(27, order=tuple(range(27))), "ranking", "27 candidates"),
        (make_item(3, order=(0, 1, 1)), "ranking", "not a permutation"),
        (make_item(3, order=(0, 1)), "ranking", "not a permutation"),
        (make_item(3), "ranks", "unknown batch style"),
        (make_item(11), "scores", "at most 10"),
    ],
)
def test_render_batch_rejects_bad_items(item, style, match):
    with pytest.raises(ValueError, match=match):
        render_batch(item, random.Random(0), style=style)


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    k=st.integers(2, 26),
    seed=st.integers(0, 2**32 - 1),
    metric=st.sampled_from(["levenshtein", "kendall"]),
)
def test_answering_item_order_gets_full_reward(data, k, seed, metric):
    order = tuple(data.draw(st.permutations(range(k))))
    item = make_item(k, order=order)
    styles = ["ranking", "scores"] if k <= 10 else ["ranking"]
    for style in styles:
        p = render_batch(item, random.Random(seed), style=style)
        assert p.num_candidates == k and len(p.target) == k and sorted(p.target) == list(LETTERS[:k])
        for i, c in enumerate(p.shown):  # the answer under letter i is candidates[shown[i]]
            assert f"[Assistant {LETTERS[i]}'s Answer]\n{item.candidates[c]}" in p.user
        r = judge_reward(answer_for(p, item, style), p.target, metric=metric, style=style)
        assert (r.total, r.format, r.pred, r.reason) == (1.0, 1.0, p.target, "")


def test_shuffle_is_roughly_uniform_and_varies_per_call():
    rng = random.Random(1234)
    item = make_item(3)
    n = 6000
    counts = collections.Counter(render_batch(item, rng).shown for _ in range(n))
    assert len(counts) == 6
    for perm, c in counts.items():
        assert abs(c - n / 6) < 0.1 * n / 6, (perm, c)
    # With order (0, 1, 2) the best candidate lands under each letter about equally often.
    firsts = collections.Counter(render_batch(item, rng).target[0] for _ in range(3000))
    assert all(abs(firsts[letter] - 1000) < 100 for letter in "ABC")


def test_render_pair():
    p = render_pair("Q?", b"img", "first", "second", item_id="7", truth="A")
    assert (p.protocol, p.style, p.num_candidates, p.shown, p.target) == ("pair", "scores", 2, (0, 1), "A")
    assert p.user == "[Question]\nQ?\n\n[Assistant A's Answer]\nfirst\n\n[Assistant B's Answer]\nsecond"
    assert p.system == SYSTEM_PAIR_SCORES
    swapped = render_pair("Q?", b"img", "first", "second", truth="A", swap=True, style="ranking")
    assert (swapped.shown, swapped.target, swapped.system) == ((1, 0), "B", SYSTEM_PAIR_RANKING)
    assert swapped.user.index("second") < swapped.user.index("first")
    assert render_pair("Q?", None, "a", "b", truth="C", swap=True).target == "C"
    assert render_pair("Q?", None, "a", "b").target == ""
    with pytest.raises(ValueError, match="'D'"):
        render_pair("Q?", None, "a", "b", truth="D")
    # A response in the prompt's style is read back into a verdict comparable with target.
    verdict = parse_pair("<think>x</think><answer>2</answer><answer>9</answer>").ranking
    assert verdict == "B"


def test_render_score():
    p = render_score("Q?", b"img", "an answer", item_id="3", truth="4")
    assert (p.protocol, p.style, p.num_candidates, p.shown, p.target) == ("score", "scores", 1, (0,), "4")
    assert p.user == "[Question]\nQ?\n\n[Assistant's Answer]\nan answer"
    assert p.system == SYSTEM_SCORE
    assert render_score("Q?", None, "a", truth=5).target == "5"
    assert render_score("Q?", None, "a").target == ""
    with pytest.raises(ValueError, match="item '3'"):
        render_score("Q?", None, "a", item_id="3", truth="four")
    assert parse_score("<think>x</think><answer>9</answer>").scores == (9,)
