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
from collections.abc import Sequence
from typing import Any

from pjray.data.prompts import render_batch, render_probe
from pjray.data.scenes import SceneQA, scene_split
from pjray.eval.looking import (
    LookingItem,
    LookingVerdict,
    balanced_letters,
    blank_change,
    ceiling_test,
    held_out_tuples,
    judge_looking,
    looking_items,
    looking_report,
)
from pjray.models.base_judge import (
    TOKENIZER_SCENES,
    TOKENIZER_SEED,
    BaseJudgeRecipe,
    disposition,
    judge_scenes,
    ranking_target,
)
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
            probes.append((attribute, render_probe(probe.question, item.image, item_id=item.id), probe.answer))
        probes.append((f"question:{qa.kind}", render_probe(qa.question, item.image, item_id=item.id), qa.final))
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


# The held-out check's tuples (pjray.eval.looking): a scene seed and a letters seed no committed
# result used, and 60 tuples a kind (a multiple of 3!, so the letters are balanced).
LOOKING_SEED, LETTERS_SEED = -20261205, 8105
HELD_OUT_PER_KIND = 60


def held_out_looking_items(recipe: BaseJudgeRecipe, per_kind: int, exclude: Sequence[JudgeItem] = ()) -> list[LookingItem]:
    """The looking protocol's held-out tuples of the base judge's scenes (`recipe`), letters
    balanced, asserted by content (every image: original, swapped, blank) to share nothing with
    the base judge's training items nor those in `exclude` (a GRPO run's)."""
    items = held_out_tuples(per_kind, LOOKING_SEED, recipe.image_size, recipe.objects, recipe.kinds)
    looking = looking_items(items, LETTERS_SEED)
    balanced_letters(looking)
    shown = [x for it in looking for x in (it.pair.original, it.pair.swapped, it.blank)]
    assert_held_out(shown, [*training_items(recipe), *exclude])
    return looking


def judge_on(path: str, items: Sequence[LookingItem], forced: bool) -> tuple[dict[str, Any], list[LookingVerdict]]:
    """The judge at `path`, greedy, on `items`: `ranking_summary` of its responses on the
    original images and `looking_report` of its verdicts (with `forced`, also with the image
    disposition forced), and the verdicts."""
    engine = _engine(path, top_k=1)
    verdicts, texts = judge_looking(lambda ps: [c.text for c in engine.generate(ps, 1, seed=0)], items, forced)
    originals = [it.pair.original for it in items]
    ranking = ranking_summary(originals, [it.prompts()[0] for it in items], texts, 1)
    return {"ranking": ranking, "looks": looking_report(verdicts)}, verdicts


def held_out_check(base: str, trained: str, exclude: Sequence[JudgeItem], recipe: BaseJudgeRecipe = BaseJudgeRecipe()) -> dict[str, Any]:
    """The looking protocol (`pjray.eval.looking`) for the base judge at `base` and the judge
    trained from it at `trained`, on the same held-out tuples, held out by content from the base
    judge's training items (its `recipe`) and the run's (`exclude`); the base judge also with its image
    disposition forced (the ceiling of its built-in switch). The end of `pjray train` from the
    base judge runs it: the difference is what the run learned, without the sampling noise of
    its reward curve. Returns the summary, the paired blank-control change against the forced base
    judge and the paired test of image-following against its forced ceiling per kind, and under
    "verdicts" one row per judge and item."""
    items = held_out_looking_items(recipe, HELD_OUT_PER_KIND, exclude)
    out: dict[str, Any] = {"tuples": len(items), "per_kind": HELD_OUT_PER_KIND, "construction": "independent", "verdicts": []}
    verdicts: dict[str, list[LookingVerdict]] = {}
    for name, path, forced in (("base", base, True), ("trained", trained, False)):
        out[name], verdicts[name] = judge_on(path, items, forced)
        out["verdicts"] += [{"judge": name, **v.row()} for v in verdicts[name]]
    out["blank_change"] = blank_change(verdicts["base"], verdicts["trained"])
    out["ceiling_test"] = ceiling_test(verdicts["base"], verdicts["trained"])
    return out


def _engine(path: str, temperature: float = 1.0, top_k: int = 0) -> Any:
    """An HF engine on the judge at `path` (top_k=1: greedy)."""
    from pjray.config import ModelConfig, RolloutConfig
    from pjray.rollout.hf_engine import HFEngine

    rollout = RolloutConfig(max_new_tokens=48, temperature=temperature, top_k=top_k)
    return HFEngine(path, ModelConfig(), rollout, max_batch_prompts=32)


def _think(text: str) -> str:
    return text.split("</think>")[0].strip()


def _mean(values: Any) -> float:
    values = list(values)
    return round(sum(map(float, values)) / max(1, len(values)), 3)


