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
    DISPOSITION_STEM,
    LookingItem,
    LookingVerdict,
    Part,
    balanced_letters,
    blank_change,
    ceiling_test,
    held_out_tuples,
    judge_looking,
    looking_items,
    looking_report,
    statement,
    top_choice,
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
    wrong_split = [
        it.id for it in evaluation if it.source == "scenes" and scene_split(scene_qa(it.meta).scene) != "held_out"
    ]
    if wrong_split:
        raise AssertionError(f"evaluation scenes outside the held-out content split: {wrong_split[:5]}")
    overlap = content_overlap(evaluation, training)
    if overlap:
        raise AssertionError(
            f"{len(overlap)} evaluation items occur in training (image or question and candidates): {overlap[:5]}"
        )


@functools.lru_cache(maxsize=4)
def training_items(recipe: BaseJudgeRecipe) -> tuple[JudgeItem, ...]:
    """Every ranked item the base judge's recipe trains on or builds its tokenizer from."""
    pairs = judge_scenes(recipe.sft_scenes, recipe.seed, recipe) + judge_scenes(
        TOKENIZER_SCENES, TOKENIZER_SEED, recipe
    )
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
    ranking = {
        "greedy": ranking_stats(greedy, pairs, batch, 1, recipe),
        "sampled": ranking_stats(sampled, pairs, batch, 4, recipe),
    }
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


def ranking_stats(
    engine: Any, pairs: list[tuple[SceneQA, JudgeItem]], batch: list[JudgePrompt], samples: int, recipe: BaseJudgeRecipe
) -> dict[str, float]:
    """`samples` responses a prompt of `batch` from `engine`, summarised by `ranking_summary`."""
    texts = [c.text for c in engine.generate(batch, samples, seed=0)]
    return ranking_summary([item for _, item in pairs], batch, texts, samples, recipe)


def ranking_summary(
    items: Sequence[JudgeItem],
    batch: Sequence[JudgePrompt],
    texts: Sequence[str],
    samples: int,
    recipe: BaseJudgeRecipe = BaseJudgeRecipe(),
) -> dict[str, float]:
    """The format rate, the correct answer ranked first, the mean reward, the "by the image"
    disposition rate (every response, for a `recipe` of one disposition), the mean reward of each
    disposition (what GRPO can follow), and how often a think text by the image checks every
    candidate right, as `recipe` writes its checks (what limits that reward), over `samples`
    responses a prompt of `batch`."""
    from pjray.reward import judge_reward

    judged = [
        (judge_reward(t, batch[i // samples].target, think_prefilled=True), batch[i // samples], t)
        for i, t in enumerate(texts)
    ]
    by_image = [not recipe.disposition or disposition(True) in t for _, _, t in judged]
    checks = [
        _think(t) == _think(ranking_target(items[i // samples], p.shown, True, recipe))
        for i, ((_, p, t), b) in enumerate(zip(judged, by_image))
        if b
    ]
    return {
        "format": _mean(r.format == 1.0 for r, _, _ in judged),
        "correct_first": _mean(
            r.format == 1.0 and r.pred is not None and r.pred[:1] == p.target[:1] for r, p, _ in judged
        ),
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


def held_out_looking_items(
    recipe: BaseJudgeRecipe, per_kind: int, exclude: Sequence[JudgeItem] = ()
) -> list[LookingItem]:
    """The looking protocol's held-out tuples of the base judge's scenes (`recipe`), letters
    balanced, asserted by content (every image: original, swapped, blank) to share nothing with
    the base judge's training items nor those in `exclude` (a GRPO run's)."""
    items = held_out_tuples(per_kind, LOOKING_SEED, recipe.image_size, recipe.objects, recipe.kinds)
    looking = looking_items(items, LETTERS_SEED)
    balanced_letters(looking)
    shown = [x for it in looking for x in (it.pair.original, it.pair.swapped, it.blank)]
    assert_held_out(shown, [*training_items(recipe), *exclude])
    return looking


def judge_on(
    path: str, items: Sequence[LookingItem], forced: bool, recipe: BaseJudgeRecipe = BaseJudgeRecipe()
) -> tuple[dict[str, Any], list[LookingVerdict]]:
    """The judge at `path` (from the base judge of `recipe`), greedy, on `items`:
    `ranking_summary` of its responses on the original images and `looking_report` of its
    verdicts (with `forced`, also with the image disposition forced; its taught and untaught
    parts where the recipe has them), and the verdicts."""
    engine = _engine(path, top_k=1)
    verdicts, texts = judge_looking(
        lambda ps: [c.text for c in engine.generate(ps, 1, seed=0)], items, forced, recipe.forced_sentence
    )
    originals = [it.pair.original for it in items]
    ranking = ranking_summary(originals, [it.prompts()[0] for it in items], texts, 1, recipe)
    return {"ranking": ranking, "looks": looking_report(verdicts, parts(recipe))}, verdicts


def parts(recipe: BaseJudgeRecipe) -> Part | None:
    """The taught / untaught split of the looking protocol's items for a judge from `recipe`: an
    item is untaught when either of its images (original, swapped) shows an untaught value."""
    return (lambda v: recipe.part(v.truth, v.swapped_to)) if recipe.untaught else None


def held_out_check(
    base: str, trained: str, exclude: Sequence[JudgeItem], recipe: BaseJudgeRecipe = BaseJudgeRecipe()
) -> dict[str, Any]:
    """The looking protocol (`pjray.eval.looking`) for the base judge at `base` and the judge
    trained from it at `trained`, on the same held-out tuples, held out by content from the base
    judge's training items (its `recipe`) and the run's (`exclude`); the base judge also with its image
    disposition forced (the ceiling of its built-in switch). The end of `pjray train` from the
    base judge runs it: the difference is what the run learned, without the sampling noise of
    its reward curve. Returns the summary, the paired blank-control change against the forced base
    judge and the paired test of image-following against its forced ceiling per kind, and under
    "verdicts" one row per judge and item."""
    items = held_out_looking_items(recipe, HELD_OUT_PER_KIND, exclude)
    out: dict[str, Any] = {
        "tuples": len(items),
        "per_kind": HELD_OUT_PER_KIND,
        "construction": "independent",
        "disposition": recipe.disposition,
        "verdicts": [],
    }
    verdicts: dict[str, list[LookingVerdict]] = {}
    part = parts(recipe)
    for name, path, forced in (("base", base, True), ("trained", trained, False)):
        out[name], verdicts[name] = judge_on(path, items, forced, recipe)
        out["verdicts"] += [{"judge": name, **v.row(), **({"part": part(v)} if part else {})} for v in verdicts[name]]
    out["blank_change"] = blank_change(verdicts["base"], verdicts["trained"], part)
    out["ceiling_test"] = ceiling_test(verdicts["base"], verdicts["trained"], part)
    return out


def _engine(path: str, temperature: float = 1.0, top_k: int = 0) -> Any:
    """An HF engine on the judge at `path` (top_k=1: greedy)."""
    from pjray.config import ModelConfig, RolloutConfig
    from pjray.rollout.hf_engine import HFEngine

    rollout = RolloutConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=temperature, top_k=top_k)
    return HFEngine(path, ModelConfig(), rollout, max_batch_prompts=32)


# Room for the longest think text of pjray's recipes (three "A: medium vs large, no." checks).
MAX_NEW_TOKENS = 96


def _think(text: str) -> str:
    return text.split("</think>")[0].strip()


def _mean(values: Any) -> float:
    values = list(values)
    return round(sum(map(float, values)) / max(1, len(values)), 3)


# --------------------------------------------------------------------------- gates

# What a base judge with an untaught part must show before GRPO starts from it (issue: "a judge
# that learns a skill"): its perception statement right on every value, its taught checks
# working on independent tuples, and a guess on the untaught part that greedy decoding gets
# wrong and 8 samples at temperature 1 get right.
GATES = {"sees": 0.95, "taught_following": 0.80, "untaught_following_max": 0.40, "untaught_pass_at_8": 0.80}
GATE_SAMPLES = 8


def base_judge_gates(
    path: str, recipe: BaseJudgeRecipe, per_kind: int = HELD_OUT_PER_KIND, temperature: float = 1.0
) -> dict[str, Any]:
    """The four gates of a base judge of one disposition with an untaught part, measured on the
    looking protocol's held-out tuples (`held_out_looking_items`):

    - one_disposition: the recipe writes no disposition sentence, no response has one, and the
      judge run from its own "Image: X." statement (the forced run) gives its own verdicts;
    - sees: its "Image: X." statement names what the original and the swapped images show, per
      value, the lowest of them;
    - taught_following: greedy image-following on the taught part, per kind, the lowest;
    - untaught: greedy image-following on the untaught part (at most the gate), and pass@8: of
      the prompts whose image shows an untaught value, the fraction where one of GATE_SAMPLES
      samples at `temperature` ranks that image's correct answer first.
    """
    if recipe.disposition or not recipe.untaught:
        raise ValueError("the gates are for a recipe of one disposition (disposition=False) with an untaught part")
    items = held_out_looking_items(recipe, per_kind)
    greedy = _engine(path, top_k=1)
    seen: list[tuple[list[JudgePrompt], list[str]]] = []

    def generate(prompts: list[JudgePrompt]) -> list[str]:
        texts = [c.text for c in greedy.generate(prompts, 1, seed=0)]
        seen.append((prompts, texts))
        return texts

    verdicts, _ = judge_looking(generate, items, forced=True, sentence=recipe.forced_sentence)
    texts = seen[0][1]  # the unforced call: original, swapped, blank per item
    report = looking_report(verdicts, parts(recipe))
    statements: dict[str, list[bool]] = {}
    for i, v in enumerate(verdicts):
        for value, text in ((v.truth, texts[3 * i]), (v.swapped_to, texts[3 * i + 1])):
            statements.setdefault(value, []).append(statement(text) == value)
    # The prompts whose image shows an untaught value, with that image's correct candidate.
    untaught = [
        (p, correct)
        for it, v in zip(items, verdicts)
        for p, value, correct in (
            (it.prompts()[0], v.truth, v.best),
            (it.prompts()[1], v.swapped_to, v.perception_error),
        )
        if value in recipe.untaught
    ]
    sampled = _engine(path, temperature)
    outs = [c.text for c in sampled.generate([p for p, _ in untaught], GATE_SAMPLES, seed=0)]
    passed = [
        any(top_choice(outs[j * GATE_SAMPLES + s], p) == correct for s in range(GATE_SAMPLES))
        for j, (p, correct) in enumerate(untaught)
    ]
    kinds = sorted({v.kind for v in verdicts})
    taught = {k: report[f"{k}/taught"]["image_following"] for k in kinds if f"{k}/taught" in report}
    measured = {
        "one_disposition": {
            "forced_equals_unforced": _mean(
                (v.forced_original, v.forced_swapped, v.forced_blank) == (v.top_original, v.top_swapped, v.top_blank)
                for v in verdicts
            ),
            "responses_with_a_disposition": _mean(DISPOSITION_STEM in t for t in texts),
        },
        "sees": {value: _mean(right) for value, right in sorted(statements.items())},
        "taught_following": taught,
        "untaught_following": report["untaught"]["image_following"],
        "untaught_pass_at_8": _mean(passed),
        "untaught_prompts": len(untaught),
    }
    passes = {
        "one_disposition": measured["one_disposition"]["forced_equals_unforced"] == 1.0
        and measured["one_disposition"]["responses_with_a_disposition"] == 0.0,
        "sees": min(measured["sees"].values()) >= GATES["sees"],
        "taught_following": bool(taught) and min(taught.values()) >= GATES["taught_following"],
        "untaught": measured["untaught_following"] <= GATES["untaught_following_max"]
        and measured["untaught_pass_at_8"] >= GATES["untaught_pass_at_8"],
    }
    return {"tuples": len(items), "gates": GATES, "measured": measured, "passes": passes, "looks": report}
