"""The looking protocol: balanced letters, a blank control with no object, image-following against
its nulls for judges that read the pixels, the text alone, or a coin, and the forced disposition."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from support.pixels import measure, measured_size, pixels

from pjray.data.prompts import LETTERS
from pjray.eval.held_out import parts
from pjray.eval.looking import (
    LookingItem,
    LookingVerdict,
    balanced_letters,
    blank_change,
    ceiling_test,
    evaluate_looking,
    forced_prefill,
    held_out_tuples,
    judge_looking,
    looking_items,
    looking_rates,
    looking_report,
    nulls,
    paired_change,
    statement,
    swap_test,
    wilson,
)
from pjray.models.base_judge import BaseJudgeRecipe, disposition
from pjray.ppjd.perturb import final_answer
from pjray.ppjd.shortcuts import scene_qa
from pjray.types import JudgePrompt

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
    rates = looking_report(verdicts)
    for s in ("pooled", "color", "size"):
        r = rates[s]
        assert r["correct_first"] == 1.0 and r["correct_first_swapped"] == 1.0 and r["image_following"] == 1.0
        assert r["same_top"] == 0.0
        assert r["blank_correct_first"] == pytest.approx(1 / 3, abs=1e-3)  # balanced letters: the order shown is chance
        assert r["image_following_ci"][0] > r["nulls"]["drop_contradicting"]
        # The perception-error answer moves from never first to always first with the image.
        swap = r["swap_test"]
        assert swap["perception_error_first_original"] == 0.0 and swap["perception_error_first_swapped"] == 1.0
        assert swap["b"] == r["items"] and swap["c"] == 0 and swap["p"] < 1e-3


def test_a_judge_that_reads_the_text_alone_scores_zero_image_following(items: list[LookingItem]) -> None:
    verdicts, texts = judge_looking(
        lambda ps: [verdict("ABC", "Image: red. Verdict: by the text.") for _ in ps], items, forced=False
    )
    r = looking_report(verdicts)["pooled"]
    assert r["image_following"] == 0.0 and r["same_top"] == 1.0
    assert r["correct_first"] == pytest.approx(1 / 3, abs=1e-3) and r["blank_correct_first"] == pytest.approx(
        1 / 3, abs=1e-3
    )
    assert r["disposition_image"] == 0.0 and r["forced"] is None
    assert r["swap_test"]["b"] == r["swap_test"]["c"] == 0 and r["swap_test"]["p"] == 1.0  # the verdict never moves
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
    r = looking_rates(verdicts)
    assert abs(r["image_following"] - nulls(3)["drop_contradicting"]) < 0.1
    # A coin per image moves the perception-error answer both ways about equally: no link shown.
    assert r["swap_test"]["p"] > 0.05 and r["swap_test"]["b"] > 0 and r["swap_test"]["c"] > 0


def _verdict(i: int, kind: str, original: int | None, swapped: int | None, **forced) -> LookingVerdict:
    """A verdict on a tuple whose correct answer is candidate 0 and perception error candidate 1."""
    return LookingVerdict(f"t{i}", kind, "red", "blue", 0, 1, original, swapped, 2, False, False, False, None, **forced)


def test_nulls_and_the_swap_test_are_exact_where_they_can_be() -> None:
    assert nulls(3) == {"text_only": 0.0, "random": 1 / 9, "drop_contradicting": 0.25}
    assert nulls(4)["drop_contradicting"] == pytest.approx(1 / 9)
    # Perception error first on the swapped image only (6 items), on the original only (1), on neither (3).
    verdicts = (
        [_verdict(i, "color", 0, 1) for i in range(6)]
        + [_verdict(6, "color", 1, 0)]
        + [_verdict(i, "color", 2, 2) for i in range(7, 10)]
    )
    t = swap_test(verdicts)
    assert (t["b"], t["c"]) == (6, 1) and t["p"] == pytest.approx(
        2 * 8 / 128
    )  # exact McNemar: 2 P(X <= 1), X ~ B(7, 1/2)
    assert t["perception_error_first_original"] == 0.1 and t["perception_error_first_swapped"] == 0.6


def test_the_ceiling_test_pairs_the_judge_with_the_forced_base_judge() -> None:
    base = [
        _verdict(
            i, "color" if i < 4 else "size", 2, 2, forced=True, forced_original=0, forced_swapped=1 if i % 2 else 0
        )
        for i in range(8)
    ]
    judge = [_verdict(i, "color" if i < 4 else "size", 0, 1) for i in range(8)]  # follows the image on every item
    out = ceiling_test(base, judge)
    assert out["pooled"] == {"judge": 1.0, "forced_base": 0.5, "b": 4, "c": 0, "p": pytest.approx(2 / 16)}
    assert set(out) == {"pooled", "color", "size"} and out["color"]["b"] == 2
    with pytest.raises(ValueError, match="same items"):
        ceiling_test(base, judge[::-1])


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
    r = looking_report(verdicts)["pooled"]
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
    assert np.isclose(looking_rates(better)["blank_correct_first"], 1.0)
    # A base judge run forced is compared by its forced blank verdicts: forced right on every
    # blank, it leaves the judge no gain there.
    forced = [replace(v, forced=True, forced_blank=v.best) for v in base]
    assert blank_change(forced, better)["pooled"]["mean"] == 0.0


def test_a_judge_of_one_disposition_is_forced_from_its_own_statement_alone(items: list[LookingItem]) -> None:
    """With no disposition sentence to force (sentence=""), the forced pass starts from the
    judge's own statement, so a judge that looks gives its own verdicts there."""
    assert forced_prefill("Image: red. A: red vs red, yes.\n</think>\n<answer>A</answer>", "") == "Image: red."
    assert forced_prefill("nothing readable", "") == ""
    seen: list[str] = []

    def judge(ps: list[JudgePrompt]) -> list[str]:
        seen.extend(p.prefill for p in ps)
        return [reads_pixels(p, items) for p in ps]

    verdicts, _ = judge_looking(judge, items, forced=True, sentence="")
    assert all(
        (v.forced_original, v.forced_swapped, v.forced_blank) == (v.top_original, v.top_swapped, v.top_blank)
        for v in verdicts
    )
    assert disposition(True) not in "".join(seen)


@pytest.mark.parametrize("force", [True, False])
def test_the_looking_bench_forces_the_disposition_only_when_asked(force: bool, tmp_path) -> None:
    """`pjray eval --bench looking`: the forced pass writes "Verdict: by the image." after the
    judge's own statement with eval.force_disposition, and nothing more without it (a judge of one
    disposition); its report says which."""
    from pjray.config import load

    cfg = load(
        overrides=[
            "eval.bench=looking",
            "eval.scene_kinds=[color]",
            "eval.num_items=6",
            "eval.scene_objects=[1,1]",
            f"eval.force_disposition={str(force).lower()}",
            f"eval.output_dir={tmp_path}",
        ]
    )
    calls: list[list[str]] = []

    def generate(prompts: list[JudgePrompt], seed: int) -> list[str]:
        calls.append([p.prefill for p in prompts])
        return ["Image: red. A: red vs red, yes.\n</think>\n<answer>A > B > C</answer>"] * len(prompts)

    report = evaluate_looking(cfg, generate)
    assert len(calls) == 2 and not any(calls[0]) and len(calls[1]) == 18
    assert set(calls[1]) == {f"Image: red. {disposition(True)}" if force else "Image: red."}
    assert (disposition(True) in " ".join(report.notes)) == force


def test_the_taught_and_untaught_parts_are_slices_of_their_own(items: list[LookingItem]) -> None:
    """held_out.parts: an item is untaught when either of its images shows an untaught value; the
    report, the ceiling test and the blank change then have a slice per part and per kind and part."""
    verdicts, _ = judge_looking(lambda ps: [reads_pixels(p, items) for p in ps], items, forced=False)
    part = parts(BaseJudgeRecipe(untaught=("orange", "purple")))
    untaught = [v for v in verdicts if {v.truth, v.swapped_to} & {"orange", "purple"}]
    assert untaught and all(v.kind == "color" for v in untaught)
    report = looking_report(verdicts, part)
    assert set(report) == {
        "pooled",
        "color",
        "size",
        "taught",
        "untaught",
        "color/taught",
        "color/untaught",
        "size/taught",
    }
    assert report["untaught"]["items"] == report["color/untaught"]["items"] == len(untaught)
    assert report["taught"]["items"] + report["untaught"]["items"] == report["pooled"]["items"]
    assert report["size/taught"]["items"] == report["size"]["items"]
    assert set(ceiling_test([replace(v, forced=True) for v in verdicts], verdicts, part)) == set(report)
    assert set(blank_change(verdicts, verdicts, part)) == set(report)
