"""The lexicon rewriter of free-text answers: perception edits, reasoning errors, ranked levels."""

from __future__ import annotations

import difflib
import json
import random
import re

import pytest

from pjray.ppjd.lexicon import (
    CLASSES,
    NUMBER_WORDS,
    WORDS,
    Rewrite,
    Source,
    choices,
    find_mentions,
    mentioned_attributes,
    probe_question,
)
from pjray.ppjd.perturb import final_answer, normalize_answer
from pjray.ppjd.rewrites import perception_options, perceptual_perturb, ranked_rewrites, reasoning_perturb
from pjray.ppjd.shortcuts import stated_fact, text_only_ranking
from pjray.ppjd.stages import perturb_rules

CHART_Q = "Which bar in the chart is the tallest?"
CHART = """The chart shows four bars. The blue bar on the left reaches 40, and the Blue label sits above it.
The red bar reaches 25, and the green bar reaches 30.
Comparing them, the blue bar is higher than the green bar and the red bar.
So the tallest bar is the blue one.
Final Answer: blue"""

COUNT_Q = "How many apples are on the plate?"
COUNT = """Let me look at the plate carefully.
I can see three apples on the plate and two pears next to them.
Counting the apples once more gives Three apples.
Final Answer: 3"""

MC_Q = "What colour is the car in front of the house?\nA. red\nB. white\nC. black\nD. yellow"
MC = """The house is in the middle of the image. A small red car is parked in front of the house.
Its roof is red as well, so the car is red.
Final Answer: A"""

SIGN_Q = "What word is written on the sign?"
SIGN = 'The sign on the left is a large octagon. The white letters on it read "STOP".\nFinal Answer: STOP'

ATTRIBUTE_TOKENS = set(WORDS) | set(NUMBER_WORDS) | {str(n) for n in range(21)} | {"a", "an"}


def word_diff(a: str, b: str) -> list[str]:
    """The words (lowercased, punctuation stripped) that differ between two texts, both sides."""
    x, y = re.findall(r"[\w']+", a.lower()), re.findall(r"[\w']+", b.lower())
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=x, b=y, autojunk=False).get_opcodes():
        if tag != "equal":
            out += x[i1:i2] + y[j1:j2]
    return out


def levels(question: str, chosen: str, k: int, seed: str = "s", construction: str = "nested") -> list[Rewrite]:
    return ranked_rewrites(question, chosen, k, random.Random(seed), construction)


def test_the_classes_are_disjoint_and_cover_the_lexicon():
    assert {cls for cls, _ in WORDS.values()} | {"count", "text"} == set(CLASSES)
    by_word: dict[str, set[str]] = {}
    for word, (cls, _) in WORDS.items():
        by_word.setdefault(word, set()).add(cls)
    assert all(len(c) == 1 for c in by_word.values())
    assert not set(WORDS) & set(NUMBER_WORDS)
    text = CHART + " " + COUNT + " " + SIGN
    spans = [(m.start, m.end) for m in find_mentions(text)]
    assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))  # no two mentions overlap


def test_mentions_respect_word_boundaries_and_idioms():
    text = (
        "Fred reduced the bluest noise; the red ball and the REDS are here. The triangle has a right angle, "
        "the square root is 3, and two circles sit to the right of it. 3 + 4 = 7 marks, and 7 dots."
    )
    got = [(m.cls, m.surface) for m in find_mentions(text)]
    assert ("colour", "red") in got and not any(s.lower() in ("fred", "reduced", "bluest", "reds") for _, s in got)
    relations = [s for c, s in got if c == "relation"]
    assert relations == ["right"]  # "right angle" is not a position, "to the right of" is
    assert [s for c, s in got if c == "shape"] == ["triangle", "circles"]  # "square root" is not a shape
    assert [s for c, s in got if c == "count"] == ["two"]  # 7 takes part in arithmetic, 3 too
    assert mentioned_attributes("It is a thing.\nFinal Answer: thing") == []


def test_level_one_changes_every_mention_together_and_keeps_case():
    for seed in map(str, range(10)):
        chosen, p = CHART, perceptual_perturb(Source(CHART_Q, CHART, "blue"), random.Random(seed))
        (change,) = p.changes
        changed = {w for w in word_diff(chosen, p.text) if w not in ("a", "an")}
        assert changed == {change.original.lower(), change.perturbed.lower()}
        original = re.compile(rf"(?<!\w){re.escape(change.original)}(?!\w)", re.IGNORECASE)
        assert not original.search(p.text)  # every mention changed
        assert len(original.findall(chosen)) == len(
            re.findall(rf"(?<!\w){re.escape(change.perturbed)}(?!\w)", p.text, re.IGNORECASE)
        )
        if change.original == "blue":  # decisive through the final; "Blue" keeps its capital
            assert final_answer(p.text) == change.perturbed and f"the {change.perturbed.capitalize()} label" in p.text
        assert normalize_answer(final_answer(p.text)) != "blue"
        # Nothing but attribute words (and a fitting article) differs: reasoning intact.
        assert set(word_diff(chosen, p.text)) <= ATTRIBUTE_TOKENS


def test_counts_keep_their_form_and_stay_near():
    seen = set()
    for seed in map(str, range(12)):
        p = perceptual_perturb(Source(COUNT_Q, COUNT, "3"), random.Random(seed))
        (change,) = p.changes
        assert (change.cls, change.original) == ("count", "three")  # the only lexeme the final names
        n = NUMBER_WORDS.index(change.perturbed)
        assert 2 <= n <= 6 and n != 3 and change.perturbed != "two"  # "two" is already said (pears)
        assert f"I can see {change.perturbed} apples" in p.text
        assert f"gives {change.perturbed.capitalize()} apples" in p.text
        assert final_answer(p.text) == str(n)
        seen.add(n)
    assert len(seen) >= 2


def test_multiple_choice_letter_moves_to_the_matching_option():
    assert choices(MC_Q) == {"A": "red", "B": "white", "C": "black", "D": "yellow"}
    assert choices("Colour?\n(A) red\n(B) blue") == {"A": "red", "B": "blue"}
    assert choices("Colour?\nA: red\nB: blue") == {"A": "red", "B": "blue"}
    finals = set()
    for seed in map(str, range(12)):
        p = perceptual_perturb(Source(MC_Q, MC, "A"), random.Random(seed))
        (change,) = p.changes
        assert change.cls == "colour" and change.original == "red"  # the only decisive lexeme
        letter = {v: k for k, v in choices(MC_Q).items()}[change.perturbed]
        assert final_answer(p.text) == letter and p.text.count(change.perturbed) == 3
        finals.add(letter)
    assert finals <= {"B", "C", "D"} and len(finals) >= 2
    # A count option: "three" -> 2 or 4 moves the letter, 5 or 6 would match no option and is not offered.
    q = "How many cats are on the sofa?\n(A) 2\n(B) 3\n(C) 4\n(D) 8"
    chosen = "There are three cats on the sofa, all asleep.\nFinal Answer: (B)"
    moved = {final_answer(perceptual_perturb(Source(q, chosen, "(B)"), random.Random(s)).text) for s in "abcdefgh"}
    assert moved == {"(A)", "(C)"}
    # The body's "option X" moves with the final, so the perception-only answer stays coherent.
    body = "A small red car is parked in front of the house, so the answer is option A.\nFinal Answer: A"
    p = perceptual_perturb(Source(MC_Q, body, "A"), random.Random("0"))
    letter = final_answer(p.text)
    assert letter != "A" and f"the answer is option {letter}." in p.text and "option A" not in p.text


def test_text_read_from_the_image_is_misread_consistently():
    for seed in map(str, range(6)):
        p = perceptual_perturb(Source(SIGN_Q, SIGN, "STOP"), random.Random(seed))
        (change,) = p.changes
        assert change.cls == "text" and change.original == "STOP"  # the only lexeme the final names
        assert len(change.perturbed) == 4 and change.perturbed.isupper() and change.perturbed != "STOP"
        assert f'read "{change.perturbed}"' in p.text and final_answer(p.text) == change.perturbed
        assert "STOP" not in p.text
    q = "What does the sign say?\nA. STOP\nB. SHOP"
    p = perceptual_perturb(Source(q, SIGN.replace("Final Answer: STOP", "Final Answer: A"), "A"), random.Random(0))
    assert final_answer(p.text) == "B" and '"SHOP"' in p.text


def test_relations_and_sizes_swap_with_their_antonyms():
    q = "Which shape is on the left?"
    chosen = "The small circle is on the left and the large square is on the right.\nFinal Answer: circle"
    src = Source(q, chosen, "circle")
    p = perceptual_perturb(src, random.Random(0))
    assert p.changes[0].cls == "shape"  # the only lexeme the final names
    # A later level may swap a relation or a size: both sides move, so the answer stays self-consistent.
    texts = {o.changes[-1].original: o.text for o in perception_options(src, p, random.Random(1))}
    assert "is on the right and the large square is on the left" in texts["left"]
    assert texts["small"].startswith("The large ") and "the small square" in texts["small"]


def test_reasoning_error_kinds_in_order_of_preference():
    # arithmetic first
    chosen = (
        "There are 3 red beads and 4 blue beads, so 3 + 4 = 7 beads.\nThere are more blue beads than red ones.\n"
        "The string is long.\nFinal Answer: blue"
    )
    p = perceptual_perturb(Source("Which colour is most common?", chosen, "blue"), random.Random(0))
    r = reasoning_perturb(p, random.Random(0))
    assert r.slips[0].kind == "arithmetic" and re.search(r"3 \+ 4 = (?!7)\d+", r.text)
    assert final_answer(r.text) == final_answer(p.text) and r.changes == p.changes
    # then a flipped comparative
    r = reasoning_perturb(Rewrite(p.text.replace("3 + 4 = 7", "seven"), p.changes), random.Random(0))
    assert r.slips[0].kind == "comparative" and f"There are less {p.changes[0].perturbed} beads than" in r.text
    # then a negated conclusion
    plain = "The ball sits in the box.\nIt looks round.\nThe ball is red.\nFinal Answer: red"
    p = perceptual_perturb(Source("What colour is the ball?", plain, "red"), random.Random(0))
    r = reasoning_perturb(p, random.Random(0))
    assert r.slips[0].kind == "negation" and f"The ball is not {p.changes[0].perturbed}." in r.text
    assert final_answer(r.text) == p.changes[0].perturbed
    # then a skipped step (three steps, a conclusion without a copula)
    steps = "I look at the ball first.\nIt sits in a box.\nIt looks round.\nI name its colour red.\nFinal Answer: red"
    p = perceptual_perturb(Source("What colour is the ball?", steps, "red"), random.Random(0))
    r = reasoning_perturb(p, random.Random(0))
    assert r.slips[0].kind == "skipped_step" and r.slips[0].perturbed == ""
    assert r.slips[0].original in ("It sits in a box.", "It looks round.") and r.slips[0].original not in r.text
    assert len(r.text.splitlines()) == len(p.text.splitlines()) - 1 and final_answer(r.text) == final_answer(p.text)
    # none left
    with pytest.raises(ValueError, match="no reasoning error possible"):
        reasoning_perturb(Rewrite("Red.\nFinal Answer: blue", p.changes), random.Random(0))


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
def test_ranked_levels_add_one_error_each_and_stay_wrong(k):
    got = levels(CHART_Q, CHART, k)
    assert len(got) == k and got[0].text == CHART and len({r.text for r in got}) == k
    counts = [(len(r.changes), len(r.slips)) for r in got]
    assert counts[:3] == [(0, 0), (1, 0), (1, 1)][:k]
    assert [p + r for p, r in counts] == list(range(k))
    for before, after in zip(got[1:], got[2:]):  # each level keeps the errors before it
        assert after.changes[: len(before.changes)] == before.changes
        assert after.slips[: len(before.slips)] == before.slips
    for r in got[1:]:
        assert normalize_answer(final_answer(r.text)) != "blue"
        j = r.to_json()
        assert j["perception_errors"] == len(r.changes) and len(j["probes"]) == len(r.changes)
        assert all(p["answer"] == c.original for p, c in zip(j["probes"], r.changes))


def test_levels_are_deterministic_by_seed():
    assert [r.text for r in levels(CHART_Q, CHART, 5, "x")] == [r.text for r in levels(CHART_Q, CHART, 5, "x")]
    firsts = {levels(CHART_Q, CHART, 3, str(s))[1].text for s in range(10)}
    assert len(firsts) > 1


def test_supported_levels_and_the_error_beyond():
    q, chosen = "What colour is the ball?", "The ball is red.\nFinal Answer: red"
    assert len(levels(q, chosen, 3)) == 3  # P, then the negated conclusion
    with pytest.raises(ValueError, match="supports at most 3 ranked levels"):
        levels(q, chosen, 4)
    with pytest.raises(ValueError, match="supports at most 2 ranked levels"):
        levels(q, "Red.\nFinal Answer: red", 3)


def test_answers_without_a_decisive_edit_are_refused_clearly():
    with pytest.raises(ValueError, match="no perception attribute words"):
        levels("What is it?", "It is a thing.\nFinal Answer: thing", 3)
    with pytest.raises(ValueError, match="no decisive perception error"):
        levels("Is the cat red?", "The cat is red.\nFinal Answer: Yes", 3)
    with pytest.raises(ValueError, match="no final answer"):
        levels("Colour?", "The cat is red.", 3)
    with pytest.raises(ValueError, match="num_candidates must be >= 2"):
        levels("Colour?", "The cat is red.\nFinal Answer: red", 1)


def test_probe_questions_blank_the_fact_and_offer_both_values():
    p = levels(MC_Q, MC, 2)[1]
    (change,) = p.changes
    q = probe_question(change)
    assert "___" in change.context and "red" not in change.context.lower()
    assert q.index(min(change.original, change.perturbed)) < q.index(max(change.original, change.perturbed))
    assert "Which colour" in q


# Fixtures with a conclusion a reasoning error can negate: level 2 of a K = 3 tuple is P+R.
COUNT_SO = COUNT.replace("Counting the apples once more gives Three apples.", "So there are three apples on the plate.")
SIGN_SO = (
    'The sign on the left is a large octagon. Its white letters read "STOP", so the word is "STOP".\nFinal Answer: STOP'
)
INDEPENDENT = {
    "chart": (CHART_Q, CHART, 5),
    "mc": (MC_Q, MC, 4),
    "count": (COUNT_Q, COUNT_SO, 3),
    "sign": (SIGN_Q, SIGN_SO, 5),
}  # question, chosen, the most levels tested


@pytest.mark.parametrize("name", sorted(INDEPENDENT))
def test_independent_levels_state_their_own_wrong_fact_and_final(name):
    question, chosen, most = INDEPENDENT[name]
    for k in range(3, most + 1):
        for seed in map(str, range(4)):
            got = levels(question, chosen, k, seed, "independent")
            texts = [r.text for r in got]
            assert texts[0] == chosen and len(set(texts)) == k
            assert [len(r.changes) + len(r.slips) for r in got] == list(range(k))
            assert not got[1].slips and all(r.slips for r in got[2:])  # P, then P+R, ...
            finals = [normalize_answer(r.final) for r in got]
            assert len(set(finals)) == k  # every wrong final differs from the truth and the others
            # Each wrong level changes the lexeme of the final (it has the values) to a value of its own,
            decisive = [r.changes[0] for r in got[1:]]
            assert len({(c.cls, c.original) for c in decisive}) == 1
            assert len({c.perturbed.lower() for c in decisive}) == k - 1
            # and the text says so: no two candidates state the same attribute words or wrong fact.
            stated = [set(stated_fact(t, None)) for t in texts]
            assert len({frozenset(x) for x in stated}) == k
            wrong = [x - stated[0] for x in stated[1:]]
            assert all(wrong) and all(not a & b for i, a in enumerate(wrong) for b in wrong[i + 1 :])
            assert text_only_ranking(texts) == [list(range(k))]  # the text-only ranker ties them all


def test_independent_levels_are_deterministic_by_seed():
    def texts(seed: str) -> list[str]:
        return [r.text for r in levels(CHART_Q, CHART, 4, seed, "independent")]

    assert texts("x") == texts("x") and len({tuple(texts(str(s))) for s in range(6)}) > 1


@pytest.mark.parametrize(
    "chosen, reason",
    [
        (
            "The cat sits on the left of the red sofa. The cat is on the left.\nFinal Answer: left",
            "give 1 (relation 'left' -> 'right')",
        ),
        (
            "The ball is large and the box is small. So the ball is large.\nFinal Answer: large",
            "give 1 (size 'large' -> 'small')",
        ),
    ],
)
def test_two_valued_finals_cannot_carry_the_independent_construction(chosen, reason):
    assert len(levels("Which one?", chosen, 3)) == 3  # the nested levels share the one wrong value
    why = f"the attribute words that decide the final {final_answer(chosen)!r} {reason}"
    with pytest.raises(
        ValueError, match=re.escape(f"2 wrong candidates need as many different wrong final answers, and {why}")
    ):
        levels("Which one?", chosen, 3, construction="independent")
    # The pipeline records the row as a reject with that reason.
    row = {"id": "r1", "question": "Which one?", "chosen": chosen, "scene": "", "levels": "[]", "probes": "[]"}
    assert why in perturb_rules(row, 3, "independent") and row["levels"] == "[]"
    assert perturb_rules(row, 3, "nested") is None and len(json.loads(row["levels"])) == 3


def test_the_independent_construction_names_what_a_row_lacks():
    with pytest.raises(ValueError, match="level 2 is perception \\+ reasoning, and no reasoning error fits"):
        levels(COUNT_Q, COUNT, 3, construction="independent")  # no conclusion, comparative or step to break
    with pytest.raises(ValueError, match="4 wrong candidates need .* give 3 \\(colour 'red' -> "):
        levels(MC_Q, MC, 5, construction="independent")  # three other options
    with pytest.raises(ValueError, match="no decisive perception error"):
        levels("Is the cat red?", "The cat is red.\nFinal Answer: Yes", 3, construction="independent")
    with pytest.raises(ValueError, match="unknown PPJD construction 'mixed'"):
        levels(CHART_Q, CHART, 3, construction="mixed")
