"""Reward functions and the judge-response parser: hand-computed numbers and properties."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pjray.config import RewardConfig
from pjray.reward import (
    judge_reward,
    kendall_reward,
    levenshtein_distance,
    levenshtein_reward,
    normalized_levenshtein,
    pair_reward,
    parse_judgment,
    parse_pair,
    parse_score,
    ranking_from_scores,
    score_reward,
)
from pjray.reward.workers import RewardWorker, overlong_penalty
from pjray.types import Completion

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def wrap(answer: str, think: str = "the image shows two red cars") -> str:
    return f"<think>{think}</think>\n<answer>{answer}</answer>"


# --- ranking rewards: hand-computed values ---------------------------------------------------


def test_levenshtein_reward_k3_hand_values():
    # BAC -> ABC: two substitutions.
    assert levenshtein_reward("BAC", "ABC") == pytest.approx(1 - 2 / 3)
    assert levenshtein_reward("ABC", "ABC") == 1.0
    # Every other permutation of 3 letters is at distance exactly 2 from ABC (CBA: 2 substitutions;
    # BCA, CAB: one insertion + one deletion), so R_Batch on K=3 only takes the values 1 and 1/3,
    # never the 2/3 and 0 the paper lists.
    values = {"".join(p): levenshtein_reward("".join(p), "ABC") for p in itertools.permutations("ABC")}
    assert values == {
        "ABC": 1.0,
        "ACB": pytest.approx(1 / 3),
        "BAC": pytest.approx(1 / 3),
        "BCA": pytest.approx(1 / 3),
        "CAB": pytest.approx(1 / 3),
        "CBA": pytest.approx(1 / 3),
    }


def test_kendall_reward_k3_hand_values():
    # Discordant pairs against ABC: ACB {BC}, BAC {AB}, BCA {AB, AC}, CAB {AC, BC}, CBA all 3.
    values = {"".join(p): kendall_reward("".join(p), "ABC") for p in itertools.permutations("ABC")}
    assert values == {
        "ABC": 1.0,
        "ACB": pytest.approx(2 / 3),
        "BAC": pytest.approx(2 / 3),
        "BCA": pytest.approx(1 / 3),
        "CAB": pytest.approx(1 / 3),
        "CBA": 0.0,
    }
    assert sorted(set(round(v, 9) for v in values.values())) == [0.0, 0.333333333, 0.666666667, 1.0]


def test_kendall_matches_release_table_for_every_target():
    """The released K=3 lookup table: adjacent swaps 2/3, rotations 1/3, reverse 0."""
    for target in map("".join, itertools.permutations("ABC")):
        for pred in map("".join, itertools.permutations("ABC")):
            disc = sum(1 for a, b in itertools.combinations(target, 2) if pred.index(a) > pred.index(b))
            assert kendall_reward(pred, target) == pytest.approx(1 - disc / 3)
        assert kendall_reward(target[::-1], target) == 0.0


@pytest.mark.parametrize(
    "pred, lev, kendall",
    [
        ("ABCD", 1.0, 1.0),
        ("ABDC", 1 - 2 / 4, 1 - 1 / 6),  # last two swapped: 2 substitutions, 1 discordant pair
        ("BADC", 1 - 3 / 4, 1 - 2 / 6),  # two swaps: insert A, B kept, A->C, D kept, delete C; 2 pairs
        ("BCDA", 1 - 2 / 4, 1 - 3 / 6),  # rotation: delete + insert, A behind 3 letters
        ("DCBA", 0.0, 0.0),  # reverse: distance 4, all 6 pairs discordant
        ("ACBD", 1 - 2 / 4, 1 - 1 / 6),
    ],
)
def test_k4_hand_values(pred, lev, kendall):
    assert levenshtein_reward(pred, "ABCD") == pytest.approx(lev)
    assert kendall_reward(pred, "ABCD") == pytest.approx(kendall)


def test_levenshtein_reward_non_permutations_and_clipping():
    assert levenshtein_reward("BA", "BAC") == pytest.approx(2 / 3)  # one deletion
    assert levenshtein_reward("", "BAC") == 0.0
    assert levenshtein_reward("XYZW", "ABC") == 0.0  # 1 - 4/3 clipped at 0
    with pytest.raises(ValueError):
        levenshtein_reward("A", "")


def test_kendall_reward_non_permutations_are_zero():
    assert kendall_reward("BA", "BAC") == 0.0
    assert kendall_reward("BAA", "BAC") == 0.0
    assert kendall_reward("BACD", "BAC") == 0.0
    assert kendall_reward("A", "A") == 1.0
    with pytest.raises(ValueError):
        kendall_reward("AB", "AA")


def test_distances():
    assert levenshtein_distance("CDAB", "ABCD") == 4
    assert levenshtein_distance("BA", "BAC") == 1
    assert normalized_levenshtein("BA", "BAC") == pytest.approx(1 / 3)
    assert normalized_levenshtein("BACDE", "BAC") == pytest.approx(2 / 5)  # max length
    assert normalized_levenshtein("", "") == 0.0
    assert normalized_levenshtein("", "AB") == 1.0


def test_pair_and_score_rewards():
    assert pair_reward("A", "A") == 1.0
    assert pair_reward("C", "A") == 0.0
    assert pair_reward(None, "A") == 0.0
    assert score_reward(7, 7) == 1.0
    assert score_reward(7, 10) == pytest.approx(1 - 3 / 9)
    assert score_reward(1, 10) == 0.0
    assert score_reward(None, 5) == 0.0
    assert score_reward(3, 5, max_score=5) == pytest.approx(1 - 2 / 4)
    assert score_reward(30, 1) == 0.0  # off the scale clips at 0
    with pytest.raises(ValueError):
        score_reward(1, 1, max_score=1)


# --- parser: accepted syntaxes -----------------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [
        "B > A > C",
        "B>A>C",
        "BAC",
        "B A C",
        "B, A, C",
        "B,A,C",
        "[[B]], [[A]], [[C]]",
        "[[B]] > [[A]] > [[C]]",
        "[[B]][[A]][[C]]",
        "  B  >\n A >  C \n",
        "B \u227b A \u227b C",
        "B > A, C",  # mixed separators are read too
    ],
)
def test_parser_accepts_ranking_syntaxes(answer):
    j = parse_judgment(wrap(answer), 3)
    assert (j.ranking, j.format_ok, j.reason) == ("BAC", True, "")
    assert j.think == "the image shows two red cars"
    assert j.answer == answer


@pytest.mark.parametrize(
    "answer",
    ["b > a > c", "B < A < C", "B >> A >> C", "1. B 2. A 3. C", "B is best, then A", "B > A > C."],
)
def test_parser_rejects_other_syntaxes(answer):
    j = parse_judgment(wrap(answer), 3)
    assert j.ranking is None and not j.format_ok
    assert "not a ranking" in j.reason


def test_parser_think_prefilled():
    j = parse_judgment("the cars are red.\n</think>\n<answer>C > A > B</answer>", 3, think_prefilled=True)
    assert (j.ranking, j.format_ok, j.think) == ("CAB", True, "the cars are red.\n")
    # Without the flag the same text lacks its opening tag.
    j = parse_judgment("the cars are red.\n</think>\n<answer>C > A > B</answer>", 3)
    assert (j.ranking, j.format_ok) == ("CAB", False)
    # With the flag, a second opening tag is a format error.
    j = parse_judgment("<think>x</think><answer>CAB</answer>", 3, think_prefilled=True)
    assert not j.format_ok and "repeated" in j.reason
    j = parse_judgment("x<answer>CAB</answer>", 3, think_prefilled=True)
    assert not j.format_ok and "no </think>" in j.reason


def test_parser_scores_style():
    j = parse_judgment(wrap("3</answer><answer>8</answer><answer> 6 "), 3, style="scores")
    assert (j.scores, j.ranking, j.format_ok) == ((3, 8, 6), "BCA", True)
    j = parse_judgment(wrap("10</answer><answer>1"), 2, style="scores")
    assert (j.scores, j.ranking, j.format_ok) == ((10, 1), "AB", True)
    assert ranking_from_scores((3, 8, 6, 9)) == "DBCA"


# --- parser: invalid formats, with reasons ----------------------------------------------------


@pytest.mark.parametrize(
    "text, ranking, reason",
    [
        ("<answer>B > A > C</answer>", "BAC", "no <think> block"),
        (wrap("BAC") + "<answer>ABC</answer>", "ABC", "2 <answer> blocks"),  # last one is read
        ("<answer>BAC</answer><think>x</think>", "BAC", "<answer> before </think>"),
        ("<think>x<answer>BAC</answer></think>", "BAC", "<answer> before </think>"),
        ("<think>a</think><think>b</think><answer>BAC</answer>", "BAC", "2 <think> and 2 </think>"),
        ("</think>x<think><answer>BAC</answer>", "BAC", "</think> before <think>"),
        (wrap("BAB"), None, "duplicated letter(s) B"),
        (wrap("BA"), "BA", "missing letter(s) C"),
        (wrap("BACD"), None, "letter(s) D not among ABC"),
        ("<think>x</think>", None, "no <answer> block"),
        ("<think>x</think><answer>BAC", None, "unclosed <answer> block"),
        ("<think>x</think><answer><answer>BAC</answer>", None, "unbalanced <answer> tags"),
        ("", None, "no <answer> block"),
    ],
)
def test_parser_invalid_ranking_style(text, ranking, reason):
    j = parse_judgment(text, 3)
    assert not j.format_ok
    assert j.ranking == ranking
    assert reason in j.reason


@pytest.mark.parametrize(
    "answers, scores, reason",
    [
        ("3</answer><answer>11</answer><answer>6", (3, 11, 6), "outside 1..10"),
        ("0</answer><answer>8</answer><answer>6", (0, 8, 6), "outside 1..10"),
        ("3</answer><answer>3</answer><answer>6", (3, 3, 6), "tied scores"),
        ("3</answer><answer>8", (3, 8), "2 scores, expected 3"),
        ("3</answer><answer>8</answer><answer>6</answer><answer>1", (3, 8, 6, 1), "4 scores"),
        ("3</answer><answer>B</answer><answer>6", None, "answer 2 'B' is not an integer"),
        ("3</answer><answer>7.5</answer><answer>6", None, "not an integer"),
        ("3</answer><answer>123456</answer><answer>6", None, "not an integer"),
    ],
)
def test_parser_invalid_scores_style(answers, scores, reason):
    j = parse_judgment(wrap(answers), 3, style="scores")
    assert not j.format_ok
    assert j.scores == scores
    assert reason in j.reason
    if "outside" in reason:  # distinct scores still give a ranking to log
        assert j.ranking == ranking_from_scores(scores)
    else:
        assert j.ranking is None


def test_parser_rejects_bad_arguments():
    with pytest.raises(ValueError, match="style"):
        parse_judgment("", 3, style="ranks")
    with pytest.raises(ValueError, match="num_candidates"):
        parse_judgment("", 27)


def test_parse_pair():
    assert parse_pair(wrap("7</answer><answer>4")).ranking == "A"
    assert parse_pair(wrap("4</answer><answer>7")).ranking == "B"
    tie = parse_pair(wrap("5</answer><answer>5"))
    assert (tie.ranking, tie.format_ok) == ("C", True)
    assert parse_pair(wrap("5")).reason == "1 scores, expected 2"
    for answer, verdict in [("A", "A"), (" [[B]] ", "B"), ("C", "C")]:
        j = parse_pair(wrap(answer), style="ranking")
        assert (j.ranking, j.format_ok) == (verdict, True)
    j = parse_pair(wrap("D"), style="ranking")
    assert j.ranking is None and not j.format_ok


def test_parse_score():
    j = parse_score(wrap(" 8 "))
    assert (j.scores, j.format_ok, j.ranking) == ((8,), True, None)
    j = parse_score(wrap("12"))
    assert (j.scores, j.format_ok) == ((12,), False)
    j = parse_score("8</think><answer>6</answer>", think_prefilled=True)
    assert (j.scores, j.format_ok) == ((6,), True)
    assert not parse_score(wrap("eight")).format_ok


# --- judge_reward ----------------------------------------------------------------------------


def test_judge_reward_total_is_format_times_ranking():
    r = judge_reward(wrap("B > A > C"), "BAC")
    assert (r.total, r.format, r.ranking, r.pred, r.reason) == (1.0, 1.0, 1.0, "BAC", "")
    r = judge_reward(wrap("A > B > C"), "BAC", metric="kendall")
    assert (r.total, r.format, r.pred) == (pytest.approx(2 / 3), 1.0, "ABC")
    r = judge_reward(wrap("A > B > C"), "BAC")
    assert r.total == pytest.approx(1 / 3)
    # Bad format: the ranking part is still computed (for logging), the total is 0.
    r = judge_reward("<answer>B > A > C</answer>", "BAC")
    assert (r.total, r.format, r.ranking, r.pred) == (0.0, 0.0, 1.0, "BAC")
    assert "no <think> block" in r.reason
    # Nothing readable: everything 0.
    r = judge_reward(wrap("BAB"), "BAC")
    assert (r.total, r.format, r.ranking, r.pred) == (0.0, 0.0, 0.0, None)


def test_judge_reward_scores_style_and_prefill():
    text = "reasoning</think><answer>4</answer><answer>9</answer><answer>2</answer>"
    r = judge_reward(text, "BAC", style="scores", think_prefilled=True, metric="kendall")
    assert (r.total, r.pred) == (1.0, "BAC")


def test_judge_reward_unknown_metric_is_named():
    with pytest.raises(ValueError, match="'spearman'"):
        judge_reward(wrap("BAC"), "BAC", metric="spearman")


# --- properties --------------------------------------------------------------------------------

_FRAGMENTS = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<answer>",
        "</answer>",
        "A",
        "B",
        "C",
        "Z",
        "a",
        " > ",
        ">",
        ",",
        " ",
        "\n",
        "[[",
        "]]",
        "3",
        "10",
        "0",
        "99999",
        "x",
        "\u227b",
        "<",
        "/",
    ]
)
_RESPONSES = st.one_of(st.text(max_size=300), st.lists(_FRAGMENTS, max_size=40).map("".join))


@settings(max_examples=400, deadline=None)
@given(text=_RESPONSES, k=st.integers(1, 26), style=st.sampled_from(["ranking", "scores"]), prefilled=st.booleans())
def test_parser_never_raises(text, k, style, prefilled):
    j = parse_judgment(text, k, style=style, think_prefilled=prefilled)
    assert j.format_ok == (j.reason == "")
    if j.format_ok:
        assert j.ranking is not None and sorted(j.ranking) == list(LETTERS[:k])
    if j.ranking is not None:
        assert len(set(j.ranking)) == len(j.ranking)
    parse_pair(text, style="ranking" if style == "scores" else "scores", think_prefilled=prefilled)
    parse_score(text, think_prefilled=prefilled)


@settings(max_examples=300, deadline=None)
@given(
    text=_RESPONSES,
    target=st.permutations("ABCD").map("".join),
    metric=st.sampled_from(["levenshtein", "kendall"]),
    style=st.sampled_from(["ranking", "scores"]),
)
def test_judge_reward_in_unit_interval(text, target, metric, style):
    r = judge_reward(text, target, metric=metric, style=style)
    assert 0.0 <= r.ranking <= 1.0 and 0.0 <= r.total <= 1.0
    assert r.format in (0.0, 1.0) and r.total == r.format * r.ranking


@settings(max_examples=300, deadline=None)
@given(data=st.data(), k=st.integers(1, 26))
def test_reward_is_one_iff_exact(data, k):
    target = "".join(data.draw(st.permutations(LETTERS[:k])))
    pred = "".join(data.draw(st.permutations(LETTERS[:k])))
    for fn in (levenshtein_reward, kendall_reward):
        v = fn(pred, target)
        assert 0.0 <= v <= 1.0
        assert (v == 1.0) == (pred == target)
    assert kendall_reward(target[::-1], target) == (1.0 if k == 1 else 0.0)


@settings(max_examples=300, deadline=None)
@given(pred=st.text(alphabet="ABCDEFxyz", max_size=12), k=st.integers(1, 6))
def test_rewards_in_unit_interval_for_any_pred(pred, k):
    target = LETTERS[:k]
    for fn in (levenshtein_reward, kendall_reward):
        assert 0.0 <= fn(pred, target) <= 1.0
    assert 0.0 <= normalized_levenshtein(pred, target) <= 1.0


# --------------------------------------------------------------------------- runaway and truncated responses


def test_only_whitespace_and_end_of_turn_may_follow_the_final_answer():
    assert judge_reward(wrap("BAC"), "BAC").total == 1.0
    assert judge_reward(wrap("BAC") + " \n\t<|im_end|>\n", "BAC").total == 1.0
    rambling = judge_reward(wrap("BAC") + " and so on, the cars are red, red, red", "BAC")
    assert rambling.format == 0.0 and rambling.total == 0.0 and rambling.ranking == 1.0
    assert "text after the final </answer>" in rambling.reason
    # In the scores style the final block is the K-th one; text between blocks is not policed.
    scores = "<think>x</think><answer>3</answer> so <answer>9</answer>\n<answer>5</answer>"
    assert judge_reward(scores, "BCA", style="scores").total == 1.0
    assert judge_reward(scores + "!", "BCA", style="scores").format == 0.0
    assert not parse_score("<think>x</think><answer>7</answer> I think").format_ok
    assert not parse_pair("<think>x</think><answer>3</answer><answer>5</answer>...", style="scores").format_ok


def test_truncated_response_gets_no_format_credit():
    r = judge_reward(wrap("BAC"), "BAC", truncated=True)
    assert (r.total, r.format, r.ranking, r.pred) == (0.0, 0.0, 1.0, "BAC")
    assert r.reason == "cut at the token limit"


def _completion(text: str, finish_reason: str = "stop", length: int = 10) -> Completion:
    return Completion(
        prompt_index=0,
        sample_index=0,
        token_ids=tuple(range(length)),
        logprobs=(-1.0,) * length,
        text=text,
        finish_reason=finish_reason,
    )


def test_reward_worker_reads_the_finish_reason():
    worker = RewardWorker(RewardConfig(), max_new_tokens=10)
    done, cut = _completion(wrap("BAC"), "stop"), _completion(wrap("BAC"), "length")
    assert [r.total for r in worker.score([done, cut], ["BAC", "BAC"], [False, False])] == [1.0, 0.0]
    lenient = RewardWorker(RewardConfig(score_truncated=True), max_new_tokens=10)
    assert [r.total for r in lenient.score([done, cut], ["BAC", "BAC"], [False, False])] == [1.0, 1.0]
    with pytest.raises(ValueError, match="finish_reason 'abort'"):
        worker.score([_completion(wrap("BAC"), "abort")], ["BAC"], [False])


def test_reward_worker_takes_the_think_prefill_per_response():
    worker = RewardWorker(RewardConfig(), max_new_tokens=10)
    prefilled = _completion("the cars are red</think>\n<answer>BAC</answer>")
    opened = _completion(wrap("BAC"))
    got = worker.score([prefilled, opened, prefilled, opened], ["BAC"] * 4, [True, True, False, False])
    assert [r.total for r in got] == [1.0, 0.0, 0.0, 1.0]


def test_overlong_penalty_is_dapo_soft_punishment():
    # L_max 20, buffer 8: free up to 12 tokens, then linear to -factor at 20.
    assert [overlong_penalty(n, 20, 8, 1.0) for n in (1, 12, 13, 16, 20)] == [0.0, 0.0, -0.125, -0.5, -1.0]
    assert overlong_penalty(16, 20, 8, 0.5) == -0.25
    assert overlong_penalty(20, 20, 0, 1.0) == 0.0  # buffer 0: off
    worker = RewardWorker(RewardConfig(overlong_buffer=8, overlong_penalty=0.5), max_new_tokens=20)
    results = worker.score(
        [_completion(wrap("BAC"), length=16), _completion(wrap("BAC"), "length", 20)], ["BAC", "BAC"], [False, False]
    )
    assert [r.total for r in results] == [1.0 - 0.25, 0.0 - 0.5]


def test_custom_reward_function_sees_truncated_text_but_pays_the_overlong_penalty():
    cfg = RewardConfig(function="pjray.reward:levenshtein_reward", overlong_buffer=4)
    worker = RewardWorker(cfg, max_new_tokens=10)
    results = worker.score(
        [_completion("BAC", "length", 10), _completion("BAC", "stop", 6)], ["BAC", "BAC"], [False, False]
    )
    assert [r.total for r in results] == [0.0, 1.0]  # 1.0 - 1.0 (at the limit) and 1.0 - 0
