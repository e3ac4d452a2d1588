"""The looking protocol: balanced letters, a blank control with no object, image-following against
its nulls for judges that read the pixels, the text alone, or a coin, and the forced disposition."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from pjray.data.prompts import LETTERS
from pjray.ppjd.shortcuts import scene_qa
from pjray.eval.looking import (
    LookingItem,
    balanced_letters,
    blank_change,
    forced_prefill,
    held_out_tuples,
    judge_looking,
    looking_items,
    looking_rates,
    looking_report,
    nulls,
    paired_change,
    permutation_null,
    statement,
    wilson,
)
from pjray.models.base_judge import disposition
from pjray.ppjd.perturb import final_answer
from pjray.types import JudgePrompt
from support.pixels import measure, measured_size, pixels

PER_KIND = 12


@pytest.fixture(scope="module")
def items() -> list[LookingItem]:
    return looking_items(held_out_tuples(PER_KIND, seed=7, image_size=96, objects=(1, 1)), letters_seed=3)


def verdict(letter_order: str, think: str = "x") -> str:
    return f"{think}\n</think>\n<answer>{' > '.join(letter_order)}</answer>"


def reads_pixels(prompt: JudgePrompt, items: list[LookingItem]) -> str:
    """A judge that looks: it measures the object in the image and puts the candidate whose final
    answer names what it measured first (the others in the order shown); no object: the order shown."""
    blobs = measure(prompt.image)
    item = next(it.pair.original for it in items if it.pair.original.id == prompt.item_id.split(":")[0])
    letters = list(LETTERS[: len(prompt.shown)])
    if blobs:
        kind = item.meta["kind"]
        seen = blobs[0].color if kind == "color" else measured_size(blobs[0], 96)
        letters.sort(key=lambda letter: final_answer(item.candidates[prompt.shown[LETTERS.index(letter)]]) != seen)
    return verdict("".join(letters))


def test_letters_are_balanced_per_kind(items: list[LookingItem]) -> None:
    balanced_letters(items)  # raises otherwise
    assert [it.kind for it in items].count("color") == PER_KIND
    lopsided = [replace(it, shown=it.pair.original.order) for it in items]  # the correct answer always under A
    with pytest.raises(AssertionError, match="not balanced"):
        balanced_letters(lopsided)
    with pytest.raises(ValueError, match="multiple of 6"):
        held_out_tuples(10, seed=7, image_size=96, objects=(1, 1))


def test_the_blank_control_shows_the_scene_without_its_object(items: list[LookingItem]) -> None:
    for it in items[:6]:
        original, blank = it.pair.original, it.blank
        scene = scene_qa(original.meta).scene
        img = pixels(blank.image)
        assert img.shape == pixels(original.image).shape  # same size: the same image tokens
        assert (img == scene.background).all()  # nothing but the background
        assert measure(blank.image) == [] and len(measure(original.image)) == 1
        assert blank.candidates == original.candidates and blank.order == original.order


def test_a_judge_that_reads_the_pixels_follows_the_image_and_not_the_blank(items: list[LookingItem]) -> None:
    verdicts, _ = judge_looking(lambda ps: [reads_pixels(p, items) for p in ps], items, forced=False)
    rates = looking_report(verdicts, reps=500)
    for s in ("pooled", "color", "size"):
        r = rates[s]
        assert r["correct_first"] == 1.0 and r["correct_first_swapped"] == 1.0 and r["image_following"] == 1.0
        assert r["same_top"] == 0.0
        assert r["blank_correct_first"] == pytest.approx(1 / 3, abs=1e-3)  # balanced letters: the order shown is chance
        assert r["image_following_ci"][0] > r["nulls"]["drop_contradicting"]
        # Right on every image: the same marginals unlinked are right on every pair too.
        assert r["nulls"]["permutation"]["mean"] == 1.0


def test_a_judge_that_reads_the_text_alone_scores_zero_image_following(items: list[LookingItem]) -> None:
    verdicts, texts = judge_looking(lambda ps: [verdict("ABC", "Image: red. Verdict: by the text.") for _ in ps], items, forced=False)
    r = looking_report(verdicts, reps=500)["pooled"]
    assert r["image_following"] == 0.0 and r["same_top"] == 1.0
    assert r["correct_first"] == pytest.approx(1 / 3, abs=1e-3) and r["blank_correct_first"] == pytest.approx(1 / 3, abs=1e-3)
    assert r["disposition_image"] == 0.0 and r["forced"] is None
    assert r["nulls"]["permutation"]["p"] == 1.0
    assert len(texts) == len(items)


def test_a_coin_per_image_scores_near_its_null() -> None:
    """Many items: a judge that drops the self-contradicting answer and picks one of the other two
    at random on each image scores 1/(K-1)^2; the rates are pure functions of the verdicts."""
    rng = random.Random(0)
    tuples = looking_items(held_out_tuples(60, seed=9, image_size=96, objects=(1, 1)), letters_seed=1)

    def coin(p: JudgePrompt, it: LookingItem) -> str:
        first = LETTERS[p.shown.index(rng.choice(it.pair.original.order[:2]))]
        return verdict(first + "".join(x for x in LETTERS[:3] if x != first))

    by_id = {it.pair.original.id: it for it in tuples}
    verdicts, _ = judge_looking(lambda ps: [coin(p, by_id[p.item_id.split(":")[0]]) for p in ps], tuples, forced=False)
    r = looking_rates(verdicts, reps=500)
    assert abs(r["image_following"] - nulls(3)["drop_contradicting"]) < 0.1
    perm = r["nulls"]["permutation"]
    assert perm["lo"] <= r["image_following"] <= perm["hi"] and perm["p"] > 0.05


def test_nulls_and_the_permutation_null_are_exact_where_they_can_be() -> None:
    assert nulls(3) == {"text_only": 0.0, "random": 1 / 9, "drop_contradicting": 0.25}
    assert nulls(4)["drop_contradicting"] == pytest.approx(1 / 9)
    # Every original right, half the swapped right: every pairing scores exactly one half.
    hits = [(True, i % 2 == 0) for i in range(20)]
    perm = permutation_null(hits, ["a"] * 20, reps=200, seed=0)
    assert perm["mean"] == perm["lo"] == perm["hi"] == 0.5
    # Linked hits (right on both or wrong on both) beat the unlinked pairing.
    linked = [(i % 2 == 0, i % 2 == 0) for i in range(40)]
    perm = permutation_null(linked, ["a"] * 20 + ["b"] * 20, reps=500, seed=0)
    assert perm["mean"] < 0.3 and perm["p"] < 0.01
    # Pairs are never an item with itself: one right item alone in its group pairs with nothing.
    assert permutation_null([(True, True), (False, False)], ["a", "b"], reps=50, seed=0)["mean"] == 0.0


def test_intervals() -> None:
    assert wilson(0, 60) == (0.0, 0.0602)
    lo, hi = wilson(30, 60)
    assert lo < 0.5 < hi and hi - 0.5 == pytest.approx(0.5 - lo, abs=1e-4)
    change = paired_change([False] * 50 + [True] * 50, [True] * 100, reps=500)
    assert change["mean"] == 0.5 and 0.35 < change["lo"] < 0.5 < change["hi"] < 0.65
    assert paired_change([True, False], [True, False], reps=100) == {"mean": 0.0, "lo": 0.0, "hi": 0.0}


def test_forced_prefill_keeps_the_judges_own_statement() -> None:
    text = "Image: red. Verdict: by the text.\n</think>\n<answer>A > B > C</answer>"
    assert forced_prefill(text) == "Image: red. " + disposition(True)
    assert forced_prefill("nothing readable") == disposition(True)
    assert statement(text) == "red" and statement("no statement") is None


def test_the_forced_pass_continues_from_the_prefill(items: list[LookingItem]) -> None:
    """A judge that reads the image only once its think text says so: 0 image-following on its
    own, 1 with the disposition forced; the prefill reaches the prompts and the reading."""
    seen: list[str] = []

    def judge(ps: list[JudgePrompt]) -> list[str]:
        out = []
        for p in ps:
            seen.append(p.prefill)
            if p.prefill.endswith(disposition(True)):
                out.append(reads_pixels(p, items).removeprefix("x"))  # the continuation after the prefill
            else:
                out.append(verdict("ABC", "Image: red. Verdict: by the text."))
        return out

    verdicts, _ = judge_looking(judge, items, forced=True)
    r = looking_report(verdicts, reps=200)["pooled"]
    assert r["image_following"] == 0.0 and r["forced"]["image_following"] == 1.0 and r["forced"]["correct_first"] == 1.0
    assert seen.count("") == 3 * len(items) and seen.count("Image: red. " + disposition(True)) == 3 * len(items)
    assert all(v.blank_statement == "red" for v in verdicts)


def test_blank_change_is_paired_by_item(items: list[LookingItem]) -> None:
    base, _ = judge_looking(lambda ps: [verdict("ABC") for _ in ps], items, forced=False)
    better = [replace(v, top_blank=v.best) for v in base]
    change = blank_change(base, better)
    assert change["pooled"]["mean"] == pytest.approx(2 / 3, abs=1e-3) and change["pooled"]["lo"] > 0
    assert set(change) == {"pooled", "color", "size"}
    with pytest.raises(ValueError, match="same items"):
        blank_change(base, better[::-1])
    assert np.isclose(looking_rates(better, reps=10)["blank_correct_first"], 1.0)
