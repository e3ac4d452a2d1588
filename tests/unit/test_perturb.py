"""Perceptual / reasoning perturbations of scene answers and the ranked PPJD items built from them."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pjray.data.scenes import (
    COLORS,
    KINDS,
    SHAPES,
    SIZE_FRACTION,
    SIZES,
    compose_answer,
    sample_qa,
    true_view,
)
from pjray.ppjd.perturb import (
    MAX_CANDIDATES,
    final_answer,
    normalize_answer,
    perceptual_perturb,
    ranked_item,
    ranked_levels,
    reasoning_perturb,
    scene_items,
    unperturbed,
)
from pjray.ppjd.scene_checks import is_correct, perception_problems, reasoning_problems

# Words a perception error may change: attribute values, directions, counts and verdicts.
ATTRIBUTE_WORDS = (
    set(COLORS)
    | set(SHAPES)
    | set(SIZES)
    | set(SIZE_FRACTION.values())
    | {"left", "right", "top", "bottom", "center", "higher", "lower", "above", "below", "yes", "no"}
)
QAS = [sample_qa(seed, kind=kind) for seed in range(20) for kind in KINDS]


def tokens(text: str) -> list[str]:
    return re.findall(r"\d+/\d+|\w+", text)


def truth(qa) -> str:
    """The true answer recomputed from the scene objects (not from the answer text)."""
    objs, spec = qa.scene.objects, qa.spec
    if qa.kind in ("color", "size"):
        (o,) = [o for o in objs if o.location == spec.param("location")]
        return o.color if qa.kind == "color" else o.size
    if qa.kind == "count":
        return str(sum(getattr(o, spec.param("attribute")) == spec.param("value") for o in objs))
    if qa.kind == "existence":
        query = (spec.param("color"), spec.param("shape"))
        return "yes" if any((o.color, o.shape) == query for o in objs) else "no"
    a, b = (objs[i] for i in spec.subjects)
    if spec.param("axis") == "horizontal":
        return "left" if a.x < b.x else "right"
    return "above" if a.y < b.y else "below"


def steps_of(text: str) -> list[str]:
    body = text.split("\nFinal Answer:")[0]
    return re.split(r"(?<=\.)\s+", body)


def test_chosen_answers_are_right_and_coherent():
    for qa in QAS:
        assert qa.final == truth(qa)
        assert is_correct(qa, qa.answer)
        assert reasoning_problems(qa, qa.answer) == []
        assert perception_problems(qa, qa.answer) == []


def test_perception_only_is_wrong_fluent_and_coherent():
    for n, qa in enumerate(QAS):
        p = perceptual_perturb(qa, random.Random(n))
        final = final_answer(p.text)
        assert final is not None and normalize_answer(final) != normalize_answer(truth(qa)), p.text
        assert not is_correct(qa, p.text)
        # Same steps, only attribute words and numbers differ, position by position.
        assert len(p.steps) == len(qa.steps) == len(steps_of(p.text))
        a, b = tokens(qa.answer), tokens(p.text)
        assert len(a) == len(b), (qa.answer, p.text)
        changed = [(x, y) for x, y in zip(a, b) if x != y]
        assert changed
        for x, y in changed:
            assert (x in ATTRIBUTE_WORDS or x.isdigit()) and (y in ATTRIBUTE_WORDS or y.isdigit()), (x, y)
        # The text contradicts the image but not itself: the reasoning still holds.
        assert reasoning_problems(qa, p.text) == []
        assert perception_problems(qa, p.text)
        assert not p.breaks and len(p.errors) == 1


def test_changes_and_probes_describe_the_perturbation():
    for n, qa in enumerate(QAS):
        p = perceptual_perturb(qa, random.Random(n))
        assert p.changes and len(p.probes) == len(p.changes)
        for change, probe in zip(p.changes, p.probes):
            obj = qa.scene.objects[change.obj]
            assert getattr(obj, change.attribute) == change.original != change.perturbed
            assert getattr(p.view[change.obj], change.attribute) == change.perturbed
            assert change.perturbed in p.text
            assert probe.answer == change.original and probe.question.endswith("?")
        # Every stated fact that differs from the scene is recorded as a change.
        assert len(perception_problems(qa, p.text)) == len(p.changes)


def test_reasoning_perturbation_is_wrong_and_incoherent():
    for n, qa in enumerate(QAS):
        rng = random.Random(n)
        p = perceptual_perturb(qa, rng)
        pr = reasoning_perturb(p, rng)
        assert normalize_answer(final_answer(pr.text)) != normalize_answer(truth(qa)), pr.text
        assert pr.errors == p.errors and pr.view == p.view  # perception errors kept
        problems = reasoning_problems(qa, pr.text)
        assert problems, pr.text
        (brk,) = pr.breaks
        assert any(msg.startswith(f"step {brk.step} ") for msg in problems)
        assert pr.steps[brk.step] != p.steps[brk.step]
        assert len(pr.steps) == len(qa.steps)


def test_reasoning_only_items_keep_perception_and_break_more_steps_per_level():
    for qa in QAS:
        if qa.kind in ("count", "existence"):
            continue  # one reasoning-error site: K = 2 at most
        item = ranked_item(qa, 3, perception=False)
        levels = item.meta["levels"]
        assert [lv["perception_errors"] for lv in levels] == [0, 0, 0]
        assert [lv["reasoning_errors"] for lv in levels] == [0, 1, 2]
        assert item.candidates[levels[0]["candidate"]] == qa.answer
        for lv in levels[1:]:
            assert reasoning_problems(qa, item.candidates[lv["candidate"]]), item.candidates[lv["candidate"]]
    count = next(qa for qa in QAS if qa.kind == "count")
    with pytest.raises(ValueError, match="reasoning-error sites"):
        ranked_item(count, 3, perception=False)


def test_reasoning_perturb_needs_a_perception_error():
    with pytest.raises(ValueError, match="perception"):
        reasoning_perturb(unperturbed(QAS[0]), random.Random(0))


def test_ranked_item_k3_order():
    for qa in QAS:
        item = ranked_item(qa)
        assert sorted(item.order) == [0, 1, 2] and len(item.candidates) == 3
        best, p_only, p_r = (item.candidates[i] for i in item.order)
        assert best == qa.answer
        assert not is_correct(qa, p_only) and not is_correct(qa, p_r)
        assert reasoning_problems(qa, p_only) == [] and perception_problems(qa, p_only)
        assert reasoning_problems(qa, p_r) and perception_problems(qa, p_r)
        levels = item.meta["levels"]
        assert [lv["candidate"] for lv in levels] == list(item.order)
        counts = [(lv["perception_errors"], lv["reasoning_errors"]) for lv in levels]
        assert counts == [(0, 0), (1, 0), (1, 1)]
        assert item.source == "scenes" and item.question == qa.question
        assert json.loads(json.dumps(item.meta)) == item.meta


@pytest.mark.parametrize("k", [2, 4, 5, 6])
def test_ranked_item_more_levels(k):
    for qa in QAS:
        item = ranked_item(qa, num_candidates=k)
        assert sorted(item.order) == list(range(k)) and len(set(item.candidates)) == k
        levels = item.meta["levels"]
        errors = [lv["perception_errors"] + lv["reasoning_errors"] for lv in levels]
        assert errors == list(range(k))  # strictly ordered by error count
        for lv in levels[1:]:
            text = item.candidates[lv["candidate"]]
            assert not is_correct(qa, text) and normalize_answer(lv["final"]) != normalize_answer(truth(qa))
            assert len(perception_problems(qa, text)) == sum(len(g) for g in lv["changes"])
            assert bool(reasoning_problems(qa, text)) == (lv["reasoning_errors"] > 0)


def test_levels_are_nested():
    for qa in QAS:
        levels = ranked_levels(qa, MAX_CANDIDATES, random.Random(0))
        for worse, better in zip(levels[1:], levels):
            assert set(better.changes) <= set(worse.changes)
            assert {b.slot for b in better.breaks} <= {b.slot for b in worse.breaks}
            assert worse.error_count == better.error_count + 1


def test_too_many_levels_fails_loudly():
    size = next(qa for qa in QAS if qa.kind == "size")
    with pytest.raises(ValueError, match="num_candidates=7"):
        ranked_item(size, num_candidates=MAX_CANDIDATES + 1)
    with pytest.raises(ValueError, match="num_candidates"):
        ranked_item(size, num_candidates=1)


def test_candidates_are_shuffled():
    orders = {ranked_item(qa).order for qa in QAS}
    assert len(orders) >= 4


def test_scene_items_deterministic_and_balanced():
    a = scene_items(10, seed=3)
    assert a == scene_items(10, seed=3)
    assert [x.image for x in a] == [x.image for x in scene_items(10, seed=3)]
    b = scene_items(10, seed=4)
    assert {x.id for x in a}.isdisjoint({x.id for x in b})
    assert len({x.id for x in a}) == 10
    assert [x.meta["kind"] for x in a] == list(KINDS) * 2
    assert all(len(x.candidates) == 4 for x in scene_items(5, seed=1, num_candidates=4))
    assert scene_items(3, seed=0, image_size=64)[0].meta["image_size"] == 64


def test_final_answer_extraction():
    assert final_answer("so.\nFinal Answer: 3") == "3"
    assert final_answer("Final Answer: red.\nmore\nFinal Answer: Blue.") == "Blue"
    assert final_answer("**Final Answer:** yes") == "yes"
    assert final_answer(r"thus $\boxed{\frac{1}{2}}$") == r"\frac{1}{2}"
    assert final_answer(r"\boxed{4} then Final Answer: 5") == "4"  # a box wins over the line
    assert final_answer(r"\boxed{4 and Final Answer: 5") == "5"  # an unclosed box does not count
    assert final_answer("no verdict here") is None
    assert final_answer("Final Answer:   ") is None


def test_normalize_answer():
    assert normalize_answer("Two.") == "2"
    assert normalize_answer("The Red") == "red"
    assert normalize_answer("  an orange!") == "orange"
    assert normalize_answer("3.5") == "3.5"
    assert normalize_answer("1/4") == "1/4"
    assert normalize_answer("Top-Left") == "top left"
    assert normalize_answer("Yes") == normalize_answer("yes.")


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(KINDS),
    k=st.integers(2, MAX_CANDIDATES),
    image_size=st.sampled_from([64, 128]),
)
def test_property_ranked_items(seed, kind, k, image_size):
    qa = sample_qa(seed, image_size, kind)
    item = ranked_item(qa, num_candidates=k)
    assert item == ranked_item(qa, num_candidates=k)
    assert item.candidates[item.order[0]] == qa.answer
    for position, index in enumerate(item.order[1:], start=1):
        text = item.candidates[index]
        assert not is_correct(qa, text)
        assert len(steps_of(text)) == len(qa.steps)
        assert bool(reasoning_problems(qa, text)) == (position >= 2)


def test_compose_rejects_unknown_override():
    qa = next(qa for qa in QAS if qa.kind == "count")
    with pytest.raises(ValueError, match="conclusion_color"):
        compose_answer(qa.spec, true_view(qa.scene), {"conclusion_color": "red"})
