"""What a judge does on held-out scenes: the base judge's build report and the check at the end
of a run from the base judge, on scenes held out from every training set by content.

Held out by content, not by seed: the evaluation scenes are of the held-out content split
(`pjray.data.scenes.SPLITS`: (shape, cell) combinations no training scene holds), and
`assert_held_out` checks, on the items themselves, that no evaluation image and no question
with its candidates occurs in the training items it is given.
"""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import replace
from collections.abc import Sequence
from typing import Any

from pjray.data.prompts import LETTERS, render_batch
from pjray.data.scenes import SceneQA, scene_split
from pjray.eval.bias import probe_prompt
from pjray.models.base_judge import (
    TOKENIZER_SCENES,
    TOKENIZER_SEED,
    BaseJudgeRecipe,
    disposition,
    judge_scenes,
    ranking_target,
)
from pjray.eval.blind import grey_image
from pjray.eval.swap import SwapVerdict, follows, swap_pair
from pjray.ppjd.perturb import Change, probe_for
from pjray.ppjd.shortcuts import scene_qa
from pjray.types import JudgeItem, JudgePrompt


def content_keys(item: JudgeItem) -> tuple[str, str]:
    """(a hash of the image bytes, a hash of the question with the candidate texts as a set)."""
    image = hashlib.sha1(item.image or b"").hexdigest()
    text = hashlib.sha1("\x00".join([item.question, *sorted(item.candidates)]).encode()).hexdigest()
    return image, text


def content_overlap(evaluation: Sequence[JudgeItem], training: Sequence[JudgeItem]) -> list[str]:
    """The ids of evaluation items whose image, or question with candidates, occurs in `training`."""
    images, texts = set(), set()
    for item in training:
        image, text = content_keys(item)
        images.add(image)
        texts.add(text)
    return [it.id for it in evaluation if content_keys(it)[0] in images or content_keys(it)[1] in texts]


def assert_held_out(evaluation: Sequence[JudgeItem], training: Sequence[JudgeItem]) -> None:
    """Fail unless every evaluation scene is of the held-out content split and no evaluation
    item shares its image, or its question with candidates, with a training item."""
    wrong_split = [it.id for it in evaluation if it.source == "scenes" and scene_split(scene_qa(it.meta).scene) != "held_out"]
    if wrong_split:
        raise AssertionError(f"evaluation scenes outside the held-out content split: {wrong_split[:5]}")
    overlap = content_overlap(evaluation, training)
    if overlap:
        raise AssertionError(f"{len(overlap)} evaluation items occur in training (image or question and candidates): {overlap[:5]}")


@functools.lru_cache(maxsize=4)
def training_items(recipe: BaseJudgeRecipe) -> tuple[JudgeItem, ...]:
    """Every ranked item the base judge's recipe trains on or builds its tokenizer from."""
    pairs = judge_scenes(recipe.sft_scenes, recipe.seed, recipe) + judge_scenes(TOKENIZER_SCENES, TOKENIZER_SEED, recipe)
    return tuple(item for _, item in pairs)


# The report's scenes (a judge_scenes seed): of the held-out content split, and a seed no
# committed result used before the split (those used -2).
HELD_OUT_SEED = -20261203
PROBE_ATTRIBUTES = ("color", "shape", "size", "location")


def held_out_report(path: str, recipe: BaseJudgeRecipe, temperature: float, n: int) -> dict[str, Any]:
    """What the built judge does on `n` held-out scenes (asserted disjoint from its training
    scenes): greedy probe accuracy per probed attribute and per judging question kind, and on
    batch-ranking prompts the format rate (greedy, and sampled at `temperature`, 4 samples a
    prompt), the correct answer ranked first, the "by the image" disposition rate, the mean
    reward of each disposition, and how often a think text by the image checks every candidate
    right."""
    from pjray.eval.bias import probe_correct, read_probe_answer

    pairs, batch = held_out_batch(recipe, n)
    greedy = _engine(path, top_k=1)

    probes = []  # (group, prompt, truth): every attribute of the object, and the scene question
    for qa, item in pairs:
        o = qa.scene.objects[0]
        for attribute in PROBE_ATTRIBUTES:
            value = o.location if attribute == "location" else getattr(o, attribute)
            probe = probe_for(qa, Change(0, attribute, value, value))
            probes.append((attribute, probe_prompt(item.id, item.image, probe.question), probe.answer))
        probes.append((f"question:{qa.kind}", probe_prompt(item.id, item.image, qa.question), qa.final))
    texts = [c.text for c in greedy.generate([p for _, p, _ in probes], 1, seed=0)]
    right: dict[str, list[bool]] = {}
    for (group, _, truth), text in zip(probes, texts):
        answer = read_probe_answer(text)
        right.setdefault(group, []).append(answer is not None and probe_correct(answer, truth))

    sampled = _engine(path, temperature)
    ranking = {"greedy": ranking_stats(greedy, pairs, batch, 1), "sampled": ranking_stats(sampled, pairs, batch, 4)}
    ranking["sampled"]["temperature"] = temperature
    return {
        "held_out_scenes": n,
        "probe_accuracy": {group: _mean(v) for group, v in right.items()},
        "batch_ranking": ranking,
    }


def held_out_batch(
    recipe: BaseJudgeRecipe, n: int, exclude: Sequence[JudgeItem] = ()
) -> tuple[list[tuple[SceneQA, JudgeItem]], list[JudgePrompt]]:
    """The report's `n` held-out scenes and their batch-ranking prompts: scenes of the held-out
    content split, asserted by content (`assert_held_out`) to share no image and no question
    with candidates with the base judge's training items or the items in `exclude` (a GRPO
    run's)."""
    pairs = judge_scenes(n, HELD_OUT_SEED, recipe, split="held_out")
    assert_held_out([item for _, item in pairs], [*training_items(recipe), *exclude])
    rng = random.Random(f"pjray.base_judge.report:{recipe.seed}")
    return pairs, [render_batch(item, rng) for _, item in pairs]


def ranking_stats(engine: Any, pairs: list[tuple[SceneQA, JudgeItem]], batch: list[JudgePrompt], samples: int) -> dict[str, float]:
    """`samples` responses a prompt of `batch` from `engine`, summarised by `ranking_summary`."""
    texts = [c.text for c in engine.generate(batch, samples, seed=0)]
    return ranking_summary([item for _, item in pairs], batch, texts, samples)


def ranking_summary(items: Sequence[JudgeItem], batch: Sequence[JudgePrompt], texts: Sequence[str], samples: int) -> dict[str, float]:
    """The format rate, the correct answer ranked first, the mean reward, the "by the image"
    disposition rate, the mean reward of each disposition (what GRPO can follow), and how often
    a think text by the image checks every candidate right (what limits that reward), over
    `samples` responses a prompt of `batch`."""
    from pjray.reward import judge_reward

    judged = [(judge_reward(t, batch[i // samples].target, think_prefilled=True), batch[i // samples], t)
              for i, t in enumerate(texts)]  # fmt: skip
    by_image = [disposition(True) in t for _, _, t in judged]
    checks = [_think(t) == _think(ranking_target(items[i // samples], p.shown, True))
              for i, ((_, p, t), b) in enumerate(zip(judged, by_image)) if b]  # fmt: skip
    return {
        "format": _mean(r.format == 1.0 for r, _, _ in judged),
        "correct_first": _mean(r.format == 1.0 and r.pred is not None and r.pred[:1] == p.target[:1] for r, p, _ in judged),
        "reward": _mean(r.total for r, _, _ in judged),
        "by_the_image": _mean(by_image),
        "reward_by_the_image": _mean(r.total for (r, _, _), b in zip(judged, by_image) if b),
        "reward_by_the_text": _mean(r.total for (r, _, _), b in zip(judged, by_image) if not b),
        "checks_right_by_the_image": _mean(checks),
    }


def top_choice(text: str, prompt: JudgePrompt) -> int | None:
    """The candidate index a batch-ranking response puts first; None if it has no readable verdict."""
    from pjray.reward import judge_reward

    r = judge_reward(text, prompt.target, think_prefilled=True)
    if r.format != 1.0 or not r.pred:
        return None
    return prompt.shown[LETTERS.index(r.pred[0])]


def looking_stats(engine: Any, items: Sequence[JudgeItem], batch: Sequence[JudgePrompt], texts: Sequence[str]) -> dict[str, dict[str, float]]:
    """Does the judge's verdict follow the image? Greedy answers of `engine` on each item's
    counterfactual (`pjray.eval.swap.swap_pair`: the same texts, the scene re-rendered so that
    the perception-error candidate is right) and on its blind copy (a grey image), with the
    letters of `batch`, beside `texts` (its answers on the original prompts). Per question kind
    and pooled: `follows`'s rates and correct-first with the grey image."""
    verdicts, blind_right = looking_verdicts(engine, items, batch, texts)
    out: dict[str, dict[str, float]] = {}
    for kind in ["pooled", *sorted({v.pair.kind for v in verdicts})]:
        keep = [i for i, v in enumerate(verdicts) if kind in ("pooled", v.pair.kind)]
        out[kind] = {
            "items": len(keep),
            **follows([verdicts[i] for i in keep]),
            "blind_correct_first": _mean(blind_right[i] for i in keep),
        }
    return out


def looking_verdicts(
    engine: Any, items: Sequence[JudgeItem], batch: Sequence[JudgePrompt], texts: Sequence[str]
) -> tuple[list[SwapVerdict], list[bool]]:
    """Per item, what `looking_stats` summarises: the judge's top choices on the original and the
    swapped image (`SwapVerdict`), and whether it ranks the correct answer first with a grey
    image (for per-item statistics, e.g. a bootstrap over items)."""
    pairs = [swap_pair(item) for item in items]
    swapped = [render_batch(p.swapped, None, shown=prompt.shown) for p, prompt in zip(pairs, batch)]
    blind = [render_batch(replace(item, image=grey_image(item.image)), None, shown=prompt.shown) for item, prompt in zip(items, batch)]
    answers = [c.text for c in engine.generate([*swapped, *blind], 1, seed=0)]
    swapped_texts, blind_texts = answers[: len(items)], answers[len(items) :]
    verdicts = [SwapVerdict(p, (top_choice(t, b), top_choice(s, sp)))
                for p, t, b, s, sp in zip(pairs, texts, batch, swapped_texts, swapped)]  # fmt: skip
    blind_right = [top_choice(t, b) == item.order[0] for t, b, item in zip(blind_texts, blind, items)]
    return verdicts, blind_right


def held_out_ranking(path: str, items: Sequence[JudgeItem], batch: Sequence[JudgePrompt]) -> dict[str, Any]:
    """`ranking_summary` and `looking_stats` of the judge at `path`, greedy, on held-out items
    and their prompts (`held_out_batch`)."""
    engine = _engine(path, top_k=1)
    texts = [c.text for c in engine.generate(batch, 1, seed=0)]
    return {**ranking_summary(items, batch, texts, 1), "looks": looking_stats(engine, items, batch, texts)}


HELD_OUT_SCENES = 128  # the held-out check at the end of a run from the base judge: 64 per question kind


def held_out_check(base: str, trained: str, exclude: Sequence[JudgeItem]) -> dict[str, Any]:
    """`held_out_ranking` of the base judge at `base` and the judge trained from it at `trained`
    on the same prompts of held-out scenes, held out by content from the base judge's training
    items and the run's (`exclude`). The end of `pjray train` from the base judge runs it: the
    difference is what the run learned, without the sampling noise of its reward curve."""
    pairs, batch = held_out_batch(BaseJudgeRecipe(), HELD_OUT_SCENES, exclude)
    items = [item for _, item in pairs]
    judges = {"base": base, "trained": trained}
    return {"held_out_scenes": HELD_OUT_SCENES, **{name: held_out_ranking(path, items, batch) for name, path in judges.items()}}


def _engine(path: str, temperature: float = 1.0, top_k: int = 0) -> Any:
    """An HF engine on the judge at `path` (top_k=1: greedy)."""
    from pjray.config import ModelConfig, RolloutConfig
    from pjray.rl.rollout import HFEngine

    rollout = RolloutConfig(max_new_tokens=48, temperature=temperature, top_k=top_k)
    return HFEngine(path, ModelConfig(), rollout, max_batch_prompts=32)


def _think(text: str) -> str:
    return text.split("</think>")[0].strip()


def _mean(values: Any) -> float:
    values = list(values)
    return round(sum(map(float, values)) / max(1, len(values)), 3)


