"""Checks of a scene answer against its scene: which perception facts it states wrong, which of
its derived steps do not follow, and whether it is correct.

A scene answer (`pjray.data.scenes.compose_answer`) lists what it sees step by step, then derives
the final answer; these read it back (`stated_view`: its facts as written, not what follows from
them) and compare with the scene's true view. The PPJD job checks every perturbed answer with
them (`pjray.ppjd.perturb` makes the errors), and the text-only audit and the reward read what an
answer states.
"""

from __future__ import annotations

import re
from dataclasses import replace

from pjray.data.scenes import (
    COLORS,
    LOCATIONS,
    SHAPES,
    SIZE_FRACTION,
    SIZES,
    SceneQA,
    Seen,
    compose_answer,
    mentioned_attributes,
    object_ref,
    true_view,
)
from pjray.ppjd.perturb import final_answer, same_answer

__all__ = ["is_correct", "perception_problems", "reasoning_problems", "stated_view"]


_LOC = "|".join(sorted(LOCATIONS, key=len, reverse=True))
_COLOR, _SHAPE, _SIZE = "|".join(COLORS), "|".join(SHAPES), "|".join(SIZES)
_FRACTION_SIZE = {f: s for s, f in SIZE_FRACTION.items()}
_LISTED = re.compile(rf"At the ({_LOC}) there is a ({_SIZE}) ({_COLOR}) ({_SHAPE})\.")


def _split(text: str) -> tuple[list[str], str | None]:
    body = re.split(r"\n\s*final\s+answer", text, flags=re.IGNORECASE)[0]
    return [s for s in re.split(r"(?<=\.)\s+", body.strip()) if s], final_answer(text)


def _stated_view(qa: SceneQA, steps: list[str]) -> tuple[tuple[Seen, ...], list[int]]:
    """The view the fact steps state, and which steps are facts. Raises ValueError if unreadable."""
    view = list(true_view(qa.scene))
    kind, subjects = qa.kind, qa.spec.subjects

    def read(index: int, pattern: str) -> tuple[str, ...]:
        m = re.fullmatch(pattern, steps[index])
        if m is None:
            raise ValueError(f"step {index} is not a recognised statement: {steps[index]!r}")
        return m.groups()

    if kind == "color":
        size, shape = read(1, rf"It is a ({_SIZE}) ({_SHAPE})\.")
        (color,) = read(2, rf"Its fill is a flat ({_COLOR})\.")
        view[subjects[0]] = replace(view[subjects[0]], size=size, shape=shape, color=color)
        return tuple(view), [1, 2]
    if kind == "size":
        shape, color = read(1, rf"It is a ({_SHAPE}) colored ({_COLOR})\.")
        (fraction,) = read(2, r"Its width is about (\d+/\d+) of the image width\.")
        if fraction not in _FRACTION_SIZE:
            raise ValueError(f"step 2 states an unknown width {fraction}")
        size = _FRACTION_SIZE[fraction]
        view[subjects[0]] = replace(view[subjects[0]], shape=shape, color=color, size=size)
        return tuple(view), [1, 2]
    if kind == "spatial":
        for index, i in enumerate(subjects):
            size, loc = read(index, rf"The .+ is a ({_SIZE}) shape at the ({_LOC})\.")
            view[i] = replace(view[i], size=size, location=loc)
        return tuple(view), [0, 1]
    for index, i in enumerate(subjects, start=1):
        loc, size, color, shape = read(index, _LISTED.pattern)
        view[i] = Seen(shape, color, size, loc)
    return tuple(view), list(range(1, len(subjects) + 1))


def reasoning_problems(qa: SceneQA, text: str) -> list[str]:
    """Where an answer to `qa` (in the scene answer format) contradicts itself; [] if coherent.

    Reads the facts the answer states, recomposes the derived steps and the final from them,
    and reports every step or final that does not follow. Says nothing about the image.
    """
    steps, final = _split(text)
    if len(steps) != len(qa.steps):
        return [f"expected {len(qa.steps)} steps, found {len(steps)}"]
    try:
        view, fact_steps = _stated_view(qa, steps)
    except ValueError as e:
        return [str(e)]
    expected, expected_final = compose_answer(qa.spec, view)
    problems = [
        f"step {i} does not follow: {steps[i]!r} (expected {expected[i]!r})"
        for i in range(len(steps))
        if i not in fact_steps and steps[i] != expected[i]
    ]
    if not same_answer(final, expected_final):
        problems.append(f"final {final!r} does not follow from the stated facts (expected {expected_final!r})")
    return problems


def perception_problems(qa: SceneQA, text: str) -> list[str]:
    """Facts an answer to `qa` states that the image contradicts; [] if all are true."""
    steps, _ = _split(text)
    try:
        view, _ = _stated_view(qa, steps)
    except (ValueError, IndexError) as e:
        return [f"unreadable answer: {e}"]
    truth = true_view(qa.scene)
    return [
        f"{object_ref(qa.scene.objects[i])}: {attribute} stated {getattr(view[i], attribute)!r}, "
        f"true {getattr(truth[i], attribute)!r}"
        for i in qa.spec.subjects
        for attribute in mentioned_attributes(qa.kind)
        if getattr(view[i], attribute) != getattr(truth[i], attribute)
    ]


def is_correct(qa: SceneQA, text: str) -> bool:
    """Whether the response's final answer matches the scene's true answer."""
    return same_answer(final_answer(text), qa.final)


def stated_view(qa: SceneQA, text: str) -> tuple[Seen, ...] | None:
    """The view an answer to `qa` (in the scene answer format) states: its perception facts as
    written, not what follows from them; None if the answer cannot be read."""
    steps, _ = _split(text)
    if len(steps) != len(qa.steps):
        return None
    try:
        return _stated_view(qa, steps)[0]
    except (ValueError, IndexError):
        return None
