"""A policy on held-out scenes: what it answers about colour and size, item by item.

The questions are drawn from the held-out content split (`pjray.data.scenes.in_split`: scenes no
training row of the base judge, the base policy or a default run can hold), balanced over
question kind x object colour; each is answered `samples` times at temperature 1. Per answer:
its format (a final answer, not cut); `right`: its final answer is the reference and it states
no wrong colour for the object; `correct`: the rule with the full oracle (the final and every
stated fact: colour, shape, size, location); whether it hallucinates a colour (states a colour
for the object that is not its own, in the reasoning or, on a colour question, in the final);
and which part of the colours the object's is (taught / untaught by the shipped judge).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from pjray.data.prompts import render_question
from pjray.data.scenes import COLORS, SceneQA, render, scene_ref, split_qas
from pjray.ppjd.perturb import normalize_answer
from pjray.ppjd.scene_checks import stated_view
from pjray.reward.answer import answer_reward

# The colours whose checks the shipped base judge was never taught (pjray.models.base_judge).
UNTAUGHT = ("orange", "purple")
HELD_OUT_SEED = 9_000_000  # scene seeds of the held-out questions start here


def held_out_questions(per_cell: int, kinds: Sequence[str], image_size: int = 96, seed: int = 0) -> list[SceneQA]:
    """`per_cell` one-object questions of each kind x object colour, from held-out scenes."""
    want = {(k, c): per_cell for k in kinds for c in COLORS}
    pool = split_qas(
        per_cell * len(want) * 6,
        lambda j: HELD_OUT_SEED + seed * 1_000_003 + j,
        "held_out",
        image_size,
        list(kinds),
        (1, 1),
    )
    out = []
    for qa in pool:
        cell = (qa.kind, qa.scene.objects[0].color)
        if want.get(cell, 0) > 0:
            want[cell] -= 1
            out.append(qa)
    short = {cell: n for cell, n in want.items() if n}
    if short:
        raise ValueError(f"held-out pool too small for {short}")
    return out


def hallucinated(qa: SceneQA, text: str, final: str | None) -> bool:
    """Whether the answer states a colour for the object that is not its own."""
    truth = qa.scene.objects[qa.spec.subjects[0]].color
    view = stated_view(qa, text)
    if view is not None and view[qa.spec.subjects[0]].color != truth:
        return True
    said = normalize_answer(final) if final else ""
    return qa.kind == "color" and said in COLORS and said != truth


def answer_verdicts(
    engine: Any, qas: Sequence[SceneQA], samples: int, seed: int, style: str = "reasoned"
) -> list[dict]:
    """One row per question and sample, answered by `engine` (a `RolloutEngine`) in one call."""
    prompts = [render_question(qa.question, render(qa.scene), item_id=str(i), style=style) for i, qa in enumerate(qas)]
    rows = []
    for c in engine.generate(prompts, samples, seed):
        qa = qas[c.prompt_index]
        r = answer_reward(c.text, qa.final, scene_ref(qa), truncated=c.finish_reason == "length")
        color = qa.scene.objects[qa.spec.subjects[0]].color
        wrong_color = hallucinated(qa, c.text, r.pred)
        rows.append(
            {
                "item": c.prompt_index,
                "sample": c.sample_index,
                "kind": qa.kind,
                "color": color,
                "part": "untaught" if color in UNTAUGHT else "taught",
                "right": bool(
                    r.format and r.pred is not None and normalize_answer(r.pred) == normalize_answer(qa.final)
                )
                and not wrong_color,
                "correct": bool(r.ranking and r.format),
                "format": bool(r.format),
                "hallucinated": wrong_color,
                "final": r.pred,
                "text": c.text,
            }
        )
    return rows


def summarize(rows: Sequence[dict]) -> dict[str, float]:
    """Rates over the rows: right and correct overall, per part, per kind and per kind x colour;
    format; hallucination."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        for key in ("all", row["part"], row["kind"], f"{row['kind']}/{row['color']}"):
            groups[key].append(row)
    out = {
        f"{what}/{key}": sum(r[what] for r in rs) / len(rs)
        for what in ("right", "correct")
        for key, rs in sorted(groups.items())
    }
    out["format"] = sum(r["format"] for r in rows) / len(rows)
    out["hallucinated"] = sum(r["hallucinated"] for r in rows) / len(rows)
    return out
