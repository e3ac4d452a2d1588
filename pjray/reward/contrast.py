"""The image-contrast bonus: credit for a verdict the image decides.

A GRPO group's prompt is also sampled on a contrast image (another item's image, or the scene
without its object), the same question and candidates under the same letters. What the judge
ranks first there it would rank first without this image. A response on the real image earns

    bonus = weight x [its top choice is the target's] x (fraction of the contrast responses
            whose top choice differs from its own)

so a right verdict earns the bonus only insofar as the judge, without this image, says something
else: a verdict the text alone decides earns nothing. A contrast response with no readable
verdict counts as differing. No swapped image is needed, so it works on any data with images.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pjray.types import RewardResult


def top_letter(result: RewardResult) -> str | None:
    """The letter a scored response ranks first; None without a readable verdict."""
    return result.pred[0] if result.format == 1.0 and result.pred else None


def contrast_bonus(
    real: Sequence[RewardResult], contrast: Sequence[RewardResult], target: str, weight: float
) -> list[float]:
    """The bonus of each response of one prompt (`real`, on its image) against the responses to
    the same prompt on the contrast image (`contrast`); see the module docstring."""
    if not contrast:
        raise ValueError("contrast_bonus: no contrast responses")
    tops = [top_letter(r) for r in contrast]
    out = []
    for r in real:
        mine = top_letter(r)
        if mine is None or mine != target[0]:
            out.append(0.0)
            continue
        out.append(weight * sum(t != mine for t in tops) / len(tops))
    return out


def with_contrast(
    results: Sequence[RewardResult], contrast: Sequence[RewardResult], targets: Sequence[str], weight: float
) -> tuple[list[RewardResult], list[float]]:
    """`results` (len(targets) prompts' responses, prompt by prompt, as many each) with each
    prompt's `contrast_bonus` (from its share of `contrast`, laid out the same way) added to
    their totals, and the bonuses."""
    n, c = len(results) // len(targets), len(contrast) // len(targets)
    if n * len(targets) != len(results) or c * len(targets) != len(contrast):
        raise ValueError(f"{len(results)} responses and {len(contrast)} contrast responses for {len(targets)} prompts")
    bonuses = [
        b
        for i, t in enumerate(targets)
        for b in contrast_bonus(results[i * n : (i + 1) * n], contrast[i * c : (i + 1) * c], t, weight)
    ]
    return [dataclasses.replace(r, total=r.total + b) for r, b in zip(results, bonuses)], bonuses
