"""Held out by content: evaluation scenes hold (shape, cell) combinations that no training scene
holds, and the check on the items catches a set built without the split."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pjray.data.scenes import SHAPES, generate_scene, held_out_object, in_split, scene_split
from pjray.eval.held_out import HELD_OUT_SEED, assert_held_out, content_overlap, training_items
from pjray.models.base_judge import BaseJudgeRecipe, judge_scenes
from pjray.ppjd.perturb import scene_items

SMALL = BaseJudgeRecipe(sft_scenes=400)


def test_the_held_out_combinations_are_a_latin_square() -> None:
    cells = [(r, c) for r in range(3) for c in range(3)]
    held = {(r, c, s) for r, c in cells for s in SHAPES if held_out_object(_obj(s, r, c))}
    assert len(held) == 9 and {(r, c) for r, c, _ in held} == set(cells)  # one shape per cell
    assert all(sum(s == shape for _, _, s in held) == 3 for shape in SHAPES)  # each shape in 3 cells


def _obj(shape: str, row: int, col: int):
    o = generate_scene(0, 96, 1, 1).objects[0]
    return replace(o, shape=shape, row=row, col=col)


def test_training_and_evaluation_scenes_lie_in_their_splits() -> None:
    train = [qa.scene for qa, _ in judge_scenes(300, 0, SMALL)]
    held = [qa.scene for qa, _ in judge_scenes(300, HELD_OUT_SEED, SMALL, split="held_out")]
    assert all(not held_out_object(o) for s in train for o in s.objects)
    assert all(scene_split(s) == "held_out" for s in held)
    assert {qa.kind for qa, _ in judge_scenes(4, 0, SMALL)} == set(SMALL.kinds)
    # Multi-object scenes: training scenes hold no held-out object at all.
    for it in scene_items(40, seed=3, image_size=96, kinds=("count",), objects=(2, 5), split="train"):
        assert in_split(generate_scene(it.meta["scene_seed"], 96, 2, 5), "train")


def test_evaluation_items_share_no_content_with_training() -> None:
    evaluation = [it for _, it in judge_scenes(200, HELD_OUT_SEED, SMALL, split="held_out")]
    assert_held_out(evaluation, training_items(SMALL))
    grpo = scene_items(
        256, seed=0, num_candidates=3, image_size=96, kinds=("color", "size"), objects=(1, 1), split="train"
    )
    assert_held_out(evaluation, grpo)


def test_a_set_built_without_the_split_is_caught() -> None:
    # One-object scenes have a few hundred set-ups: scenes of all content, even of another seed,
    # repeat training images, and about a third hold a held-out combination.
    unsplit = [it for _, it in judge_scenes(200, HELD_OUT_SEED, SMALL, split="all")]
    with pytest.raises(AssertionError, match="outside the held-out content split"):
        assert_held_out(unsplit, training_items(SMALL))
    held = [it for it in unsplit if scene_split(generate_scene(it.meta["scene_seed"], 96, 1, 1)) == "held_out"]
    train_like = [it for it in unsplit if it not in held]
    assert content_overlap(train_like, training_items(SMALL))  # identical images or texts occur
    with pytest.raises(AssertionError, match="occur in training"):
        assert_held_out(held[:3], [*training_items(SMALL), held[1]])
