"""Counterfactual images for scene items: does a judge's verdict follow the image?

Every fact of a synthetic scene is known, so the same scene can be re-rendered with the asked
attribute changed so that a perturbed candidate's stated fact becomes the true one, the
candidate texts unchanged (`swap_pair`). That candidate becomes the best; the formerly correct
one becomes a fluent perception error. A judge that ranks from the text alone cannot change its
top choice with the image. `pjray.eval.looking` measures it: image-following on independent
tuples, against its nulls, beside a blank control.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pjray.data.scenes import _CELL_GAP, Scene, SceneQA, make_qa, render, size_radius
from pjray.ppjd.scene_checks import stated_view
from pjray.ppjd.shortcuts import scene_qa
from pjray.types import JudgeItem

SWAP_KINDS: tuple[str, ...] = ("color", "size")  # one asked attribute of one object


def recoloured_scene(scene: Scene, obj: int, attribute: str, value: str) -> Scene:
    """`scene` with object `obj`'s colour or size set to `value`; a resized object keeps its
    cell (its centre moves the least that keeps it inside the cell's margins)."""
    o = scene.objects[obj]
    if attribute == "color":
        new = replace(o, color=value)
    elif attribute == "size":
        r = size_radius(value, scene.width)
        cell = scene.width / 3

        def clamp(centre: int, index: int) -> int:
            lo = math.ceil(index * cell + _CELL_GAP + r)
            hi = math.floor((index + 1) * cell - _CELL_GAP - r)
            return min(max(centre, lo), hi)

        new = replace(o, size=value, radius=r, x=clamp(o.x, o.col), y=clamp(o.y, o.row))
    else:
        raise ValueError(f"cannot re-render attribute {attribute!r}; supported: color, size")
    return replace(scene, objects=tuple(new if i == obj else x for i, x in enumerate(scene.objects)))


@dataclass(frozen=True)
class SwapPair:
    """A scene item and its counterfactual: the same question and candidate texts, the scene
    re-rendered so that the level-1 candidate (perception error, reasoning intact) is right."""

    original: JudgeItem
    swapped: JudgeItem
    kind: str
    shown: tuple[str, str]  # the asked attribute's true value in the original and the swapped image
    stated: tuple[str | None, ...]  # per candidate, the value of the asked attribute it states


def swap_pair(item: JudgeItem) -> SwapPair:
    """The counterfactual of a one-subject colour or size scene item (`SWAP_KINDS`)."""
    qa = scene_qa(item.meta)
    if qa is None or qa.kind not in SWAP_KINDS:
        raise ValueError(f"item {item.id!r}: image swap needs a scene item with a {SWAP_KINDS} question")
    subject, attribute = qa.spec.subjects[0], qa.kind
    stated = tuple(_stated(qa, text, subject, attribute) for text in item.candidates)
    best, runner_up = item.order[0], item.order[1]
    value = stated[runner_up]
    if value is None or value == stated[best]:
        raise ValueError(f"item {item.id!r}: its second candidate states no other {attribute}")
    swapped_qa = make_qa(recoloured_scene(qa.scene, subject, attribute, value), qa.spec)
    if item.candidates[runner_up] != swapped_qa.answer:
        raise AssertionError(
            f"item {item.id!r}: the swapped image does not make candidate {runner_up} the correct answer"
        )
    meta = {**item.meta, "truth": swapped_qa.final, "swap": {"obj": subject, "attribute": attribute, "value": value}}
    swapped = replace(
        item, id=f"{item.id}:swap", image=render(swapped_qa.scene), order=(runner_up, best, *item.order[2:]), meta=meta
    )
    return SwapPair(item, swapped, qa.kind, (qa.final, swapped_qa.final), stated)


def _stated(qa: SceneQA, text: str, subject: int, attribute: str) -> str | None:
    view = stated_view(qa, text)
    return None if view is None else getattr(view[subject], attribute)


def counterfactual_pair(item: JudgeItem) -> tuple[JudgeItem, JudgeItem]:
    """`item` and its swapped counterfactual (`swap_pair`): a GRPO group of
    `data.counterfactual_pairs` judges both, so a verdict that ignores the image is right on at
    most one of them."""
    return item, swap_pair(item).swapped
