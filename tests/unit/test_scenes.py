"""Synthetic scenes: the rendered pixels agree with the facts the answers state."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.pixels import measure, measured_size, pixels

from pjray.data.scenes import (
    COLORS,
    KINDS,
    PALETTE,
    SHAPES,
    generate_scene,
    qa_from_ref,
    render,
    sample_qa,
    scene_questions,
    scene_ref,
)


def cell_name(cell: tuple[int, int]) -> str:
    row, col = ("top", "center", "bottom")[cell[0]], ("left", "center", "right")[cell[1]]
    return "center" if cell == (1, 1) else f"{row} {col}"


def answer_from_pixels(qa) -> str:
    """The true answer to a scene question, computed from the PNG only (plus the question's spec)."""
    png = render(qa.scene)
    size = qa.scene.width
    by_cell = {b.cell: b for b in measure(png)}
    spec = qa.spec
    if qa.kind in ("color", "size"):
        blob = next(b for cell, b in by_cell.items() if cell_name(cell) == spec.param("location"))
        return blob.color if qa.kind == "color" else measured_size(blob, size)
    blobs = list(by_cell.values())
    if qa.kind == "count":
        attribute, value = spec.param("attribute"), spec.param("value")
        seen = {"color": lambda b: b.color, "shape": lambda b: b.shape, "size": lambda b: measured_size(b, size)}
        return str(sum(seen[attribute](b) == value for b in blobs))
    if qa.kind == "existence":
        hit = any(b.color == spec.param("color") and b.shape == spec.param("shape") for b in blobs)
        return "yes" if hit else "no"
    name_a, name_b = spec.param("name_a"), spec.param("name_b")
    a = next(b for b in blobs if f"{b.color} {b.shape}" == name_a)
    b = next(b for b in blobs if f"{b.color} {b.shape}" == name_b)
    if spec.param("axis") == "horizontal":
        return "left" if a.cx < b.cx else "right"
    return "above" if a.cy < b.cy else "below"


def check_scene_pixels(seed: int, image_size: int) -> None:
    scene = generate_scene(seed, image_size)
    png = render(scene)
    img = pixels(png)
    # Only the background and palette colours occur: no anti-aliased edge pixels.
    packed = np.unique((img.astype(np.int64) * [1 << 16, 1 << 8, 1]).sum(-1))
    allowed = {(r << 16) + (g << 8) + b for r, g, b in (scene.background, *PALETTE.values())}
    assert set(packed.tolist()) <= allowed
    blobs = measure(png)
    assert len(blobs) == len(scene.objects)  # one region per object: nothing touches
    for name in COLORS:
        assert sum(b.color == name for b in blobs) == sum(o.color == name for o in scene.objects)
    by_cell = {b.cell: b for b in blobs}
    for o in scene.objects:
        assert tuple(img[o.y, o.x]) == PALETTE[o.color]
        blob = by_cell[(o.row, o.col)]  # the centroid lies in the object's own grid cell
        assert (blob.color, blob.shape) == (o.color, o.shape)
        assert abs(blob.width - (2 * o.radius + 1)) <= 1
        assert measured_size(blob, image_size) == o.size
    # Relations asked about (different columns/rows) are clear from centroids.
    for a in scene.objects:
        for b in scene.objects:
            if a.col < b.col:
                assert by_cell[(b.row, b.col)].cx - by_cell[(a.row, a.col)].cx > image_size / 8
            if a.row < b.row:
                assert by_cell[(b.row, b.col)].cy - by_cell[(a.row, a.col)].cy > image_size / 8


@pytest.mark.parametrize("image_size", [64, 128, 200])
def test_pixels_match_scene_facts(image_size):
    for seed in range(25):
        check_scene_pixels(seed, image_size)


def test_answers_are_right_per_pixels():
    for seed in range(40):
        scene = generate_scene(seed)
        qas = scene_questions(scene, random.Random(seed))
        assert [qa.kind for qa in qas] == list(KINDS)
        for qa in qas:
            assert qa.final == answer_from_pixels(qa), (seed, qa.question, qa.answer)
            assert qa.answer.endswith(f"\nFinal Answer: {qa.final}")
            assert qa.answer.startswith(" ".join(qa.steps))


def test_facts_agree_with_scene_objects():
    for seed in range(20):
        for qa in scene_questions(generate_scene(seed), random.Random(seed)):
            assert qa.facts
            for fact in qa.facts:
                assert getattr(qa.scene.objects[fact.obj], fact.attribute) == fact.value
                assert fact.value in qa.answer


def test_spatial_questions_only_ask_clear_relations():
    for seed in range(60):
        qa = sample_qa(seed, kind="spatial")
        a, b = (qa.scene.objects[i] for i in qa.spec.subjects)
        axis = qa.spec.param("axis")
        assert (a.col != b.col) if axis == "horizontal" else (a.row != b.row)


def test_counts_cover_more_than_one():
    counts = [int(sample_qa(seed, kind="count").final) for seed in range(60)]
    assert min(counts) >= 1 and max(counts) >= 2


def test_kinds_and_values_are_covered():
    qas = [sample_qa(seed) for seed in range(80)]
    assert {qa.kind for qa in qas} == set(KINDS)
    existence = {sample_qa(seed, kind="existence").final for seed in range(40)}
    assert existence == {"yes", "no"}
    shapes = {o.shape for seed in range(30) for o in generate_scene(seed).objects}
    assert shapes == set(SHAPES)


def test_same_seed_same_bytes_and_different_seeds_differ():
    assert render(generate_scene(7)) == render(generate_scene(7))
    assert sample_qa(7) == sample_qa(7)
    assert scene_questions(generate_scene(7), random.Random(1)) == scene_questions(generate_scene(7), random.Random(1))
    pngs = {render(generate_scene(seed)) for seed in range(30)}
    assert len(pngs) == 30


def test_invalid_arguments_fail_loudly():
    with pytest.raises(ValueError, match="image_size"):
        generate_scene(0, image_size=32)
    with pytest.raises(ValueError, match="min_objects"):
        generate_scene(0, min_objects=0)
    with pytest.raises(ValueError, match="two objects"):
        sample_qa(0, kind="spatial", min_objects=1, max_objects=1)
    with pytest.raises(ValueError, match="kind"):
        sample_qa(0, kind="texture")


def test_one_object_scenes_and_scene_references_round_trip():
    for seed in range(20):
        qa = sample_qa(seed, 96, ("color", "size", "count", "existence")[seed % 4], 1, 1)
        assert len(qa.scene.objects) == 1 and qa.scene.object_range == (1, 1)
        assert qa_from_ref(scene_ref(qa)) == qa
    default = sample_qa(3, 96, "spatial")
    ref = scene_ref(default)
    assert ref["objects"] == [2, 5]
    del ref["objects"]  # references written before object ranges: the default range
    assert qa_from_ref(ref) == default


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), image_size=st.sampled_from([64, 96, 128]))
def test_property_pixels_and_answers(seed, image_size):
    check_scene_pixels(seed, image_size)
    for qa in scene_questions(generate_scene(seed, image_size), random.Random(seed)):
        assert qa.final == answer_from_pixels(qa)
