"""The rule reward of a policy's answer to a question about an image (pure functions).

A policy answers in the style pjray's judges read: reasoning, then a "Final Answer: ..." line
(the PPJD candidates' style, `pjray.data.scenes.answer_text`); an `<answer>...</answer>` block
(the VQA probe's style) is read too. total = format x correct: format is 1 when a final answer
can be read from a response that was not cut at the token limit; correct is 1 when the final
answer equals the reference (case, articles, punctuation and number words aside) and, on a
scene row, no perception fact the answer states about the question's objects contradicts the
scene (the oracle: a right final reached by misreading the image is wrong).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pjray.data.scenes import qa_from_ref, true_view
from pjray.ppjd.perturb import final_answer, normalize_answer
from pjray.ppjd.scene_checks import stated_view
from pjray.types import RewardResult

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_TAG = re.compile(r"</?think>")


def answer_of(text: str) -> str | None:
    """The final answer of a response: its last "Final Answer:" line (or `\\boxed{}`), else its
    last `<answer>` block; None when it has neither."""
    final = final_answer(text)
    if final is not None:
        return final
    blocks = [b.strip() for b in _ANSWER_BLOCK.findall(text) if b.strip()]
    return blocks[-1] if blocks else None


def shown_answer(text: str) -> str:
    """A response as a judge is shown it, in the style judges read: its reasoning without the
    `<think>` tags, then a "Final Answer:" line (written from its last `<answer>` block where it
    has no such line)."""
    plain = _THINK_TAG.sub("", text).strip()
    if final_answer(plain) is not None:
        return plain
    answer = answer_of(plain)
    if answer is None:
        return plain
    reasoning = _ANSWER_BLOCK.sub("", plain).strip()
    return f"{reasoning}\nFinal Answer: {answer}".strip()


def wrong_facts(text: str, scene: Mapping[str, Any]) -> list[str]:
    """The perception facts (attribute = value) an answer states about its question's objects
    that the scene contradicts; [] when the answer states none it can be read for."""
    qa = qa_from_ref(scene)
    view = stated_view(qa, text)
    if view is None:
        return []
    truth = true_view(qa.scene)
    return [
        f"{attr}={getattr(view[i], attr)} (the scene's: {getattr(truth[i], attr)})"
        for i in qa.spec.subjects
        for attr in ("color", "shape", "size", "location")
        if getattr(view[i], attr) != getattr(truth[i], attr)
    ]


def answer_reward(
    text: str, reference: str | None, scene: Mapping[str, Any] | None = None, truncated: bool = False
) -> RewardResult:
    """format x correct of one answer (module docstring); `ranking` holds `correct`, `pred` the
    final answer read, `reason` what was wrong. Without a reference only the format is scored
    (correct 0): a rule reward needs one."""
    final = answer_of(text)
    problems = ["cut at the token limit"] if truncated else []
    if final is None:
        problems.append("no final answer")
    fmt = 1.0 if final is not None and not truncated else 0.0
    correct = 0.0
    if final is not None and reference is not None:
        right = normalize_answer(final) == normalize_answer(reference)
        wrong = wrong_facts(text, scene) if scene is not None else []
        if not right:
            problems.append(f"final {final!r}, reference {reference!r}")
        if wrong:
            problems.append("states " + ", ".join(wrong))
        correct = float(right and not wrong)
    return RewardResult(total=fmt * correct, format=fmt, ranking=correct, pred=final, reason="; ".join(problems))
