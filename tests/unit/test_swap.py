"""Image swap: the re-rendered scene makes exactly the intended candidate correct, by the scene
facts and by the pixels; a verdict is read through the letters shown."""

from __future__ import annotations

import pytest
from support.pixels import measure, measured_size

from pjray.data.prompts import render_batch
from pjray.eval.looking import top_choice
from pjray.ppjd.perturb import scene_items
from pjray.ppjd.scene_checks import is_correct, perception_problems, reasoning_problems
from pjray.ppjd.shortcuts import scene_qa
from pjray.ppjd.swap import counterfactual_pair, swap_pair


def items(construction: str, n: int = 60):
    return scene_items(
        n,
        seed=11,
        num_candidates=3,
        image_size=96,
        kinds=("color", "size"),
        objects=(1, 1),
        split="held_out",
        construction=construction,
    )


@pytest.mark.parametrize("construction", ["nested", "independent"])
def test_swap_makes_the_intended_candidate_correct(construction: str) -> None:
    for item in items(construction):
        pair = swap_pair(item)
        qa = scene_qa(item.meta)
        best, runner_up, worst = item.order
        # By the facts: the runner-up's statements are all true of the swapped scene, the
        # formerly correct answer's are not; the texts did not change.
        assert pair.swapped.candidates == item.candidates and pair.swapped.question == item.question
        assert pair.swapped.order[0] == runner_up and pair.swapped.order[1] == best
        assert pair.shown[1] == pair.stated[runner_up] != pair.shown[0] == pair.stated[best]
        # By the pixels: the one object has the stated colour (size) in the new image only.
        (blob,) = measure(pair.swapped.image)
        (old,) = measure(item.image)
        measured = blob.color if pair.kind == "color" else measured_size(blob, 96)
        before = old.color if pair.kind == "color" else measured_size(old, 96)
        assert (before, measured) == pair.shown
        assert blob.cell == old.cell and blob.shape == old.shape  # nothing else moved
        assert pair.swapped.meta["truth"] == pair.shown[1]
        assert not perception_problems(qa, item.candidates[best]) and reasoning_problems(qa, item.candidates[worst])
        assert is_correct(qa, item.candidates[best]) and not is_correct(qa, item.candidates[runner_up])


def test_swap_covers_both_kinds() -> None:
    kinds = {swap_pair(it).kind for it in items("independent", 10)}
    assert kinds == {"color", "size"}


def test_top_choice_reads_the_verdict_through_the_shown_order() -> None:
    item = items("independent", 1)[0]
    prompt = render_batch(item, None, shown=(2, 0, 1))
    assert top_choice("x\n</think>\n<answer>B > A > C</answer>", prompt) == 0
    assert top_choice("x\n</think>\n<answer>C > A > B</answer>", prompt) == 1
    assert top_choice("no verdict", prompt) is None


def test_a_counterfactual_pair_is_the_item_and_its_swap() -> None:
    item = items("independent", 1)[0]
    original, swapped = counterfactual_pair(item)
    assert original is item and swapped == swap_pair(item).swapped
    assert swapped.candidates == item.candidates and swapped.order[:2] == item.order[1::-1]
