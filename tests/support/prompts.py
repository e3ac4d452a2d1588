"""Judge prompts the tests share."""

from __future__ import annotations

from pjray.types import JudgePrompt


def batch_prompt(item_id: str, system: str, user: str, image: bytes | None) -> JudgePrompt:
    """A batch-ranking prompt of three candidates shown in order, target "ABC"."""
    return JudgePrompt(
        item_id=item_id,
        system=system,
        user=user,
        image=image,
        protocol="batch",
        style="ranking",
        num_candidates=3,
        shown=(0, 1, 2),
        target="ABC",
    )
