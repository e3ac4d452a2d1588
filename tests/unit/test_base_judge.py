"""The base judge recipe's supervised targets: biased by construction, well-formed, deterministic."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pjray.data.prompts import render_batch
from pjray.data.scenes import generate_scene
from pjray.models.base_judge import (
    SCORE_CONSISTENT,
    SCORE_MISMATCH,
    BaseJudgeRecipe,
    cell_targets,
    code_fingerprint,
    disposition,
    judge_scenes,
    ranking_target,
    recipe_hash,
    score_target,
    sft_examples,
    training_scene_seeds,
)
from pjray.ppjd.perturb import final_answer, ranked_item
from pjray.reward import judge_reward
from pjray.reward.parse import parse_score

RECIPE = BaseJudgeRecipe()


@pytest.fixture(scope="module")
def items():
    return [item for _, item in judge_scenes(200, seed=3, recipe=RECIPE)]


def _level(item, cand):
    return next(lv for lv in item.meta["levels"] if lv["candidate"] == cand)


def test_aware_ranking_targets_are_the_true_order_and_earn_full_reward(items):
    rng = random.Random(0)
    for item in items:
        prompt = render_batch(item, rng)
        text = ranking_target(item, prompt.shown, aware=True, rng=rng)
        r = judge_reward(text, prompt.target, think_prefilled=True)
        assert r.format == 1.0, text
        assert r.total == 1.0, (text, prompt.target)


def test_anchored_ranking_puts_consistent_first_and_orders_them_at_chance(items):
    rng = random.Random(1)
    chosen_first = 0
    for item in items:
        prompt = render_batch(item, rng)
        text = ranking_target(item, prompt.shown, aware=False, rng=rng)
        r = judge_reward(text, prompt.target, think_prefilled=True)
        assert r.format == 1.0
        letters = r.pred
        inconsistent = [_level(item, prompt.shown["ABC".index(x)])["reasoning_errors"] > 0 for x in letters]
        assert inconsistent == sorted(inconsistent), text  # consistent ones before inconsistent ones
        chosen_first += letters[0] == prompt.target[0]
    assert 0.35 < chosen_first / len(items) < 0.65  # the correct answer first at chance


def test_the_verdict_follows_a_stated_disposition_in_both_protocols(items):
    item = items[0]
    prompt = render_batch(item, random.Random(3))
    for aware in (False, True):
        think = ranking_target(item, prompt.shown, aware, random.Random(3)).split("</think>")[0]
        assert think.rstrip().endswith(disposition(aware))
        assert score_target(item, item.order[1], aware).split("</think>")[0].rstrip().endswith(disposition(aware))
    assert disposition(True) != disposition(False)


def test_without_perception_errors_both_dispositions_earn_alike():
    """The study's control: on reasoning-error-only tuples the image adds nothing the text does
    not show, so neither disposition is rewarded over the other."""
    rng = random.Random(4)
    qas = [qa for qa, _ in judge_scenes(200, seed=9, recipe=RECIPE)]
    rest_in_order = {False: 0, True: 0}
    for qa in qas:
        item = ranked_item(qa, 3, perception=False)
        prompt = render_batch(item, rng)
        for aware in (False, True):
            pred = judge_reward(ranking_target(item, prompt.shown, aware, rng), prompt.target, think_prefilled=True).pred
            assert pred[0] == prompt.target[0]  # the only self-consistent candidate first
            rest_in_order[aware] += pred[1:] == prompt.target[1:]
    assert all(0.35 < n / len(qas) < 0.65 for n in rest_in_order.values()), rest_in_order


def test_think_states_the_truth_and_each_candidates_final(items):
    item = items[0]
    prompt = render_batch(item, random.Random(2))
    text = ranking_target(item, prompt.shown, aware=False, rng=random.Random(2))
    assert text.startswith(f"Image: {item.meta['truth']}.")
    for pos, cand in enumerate(prompt.shown):
        assert f"{'ABC'[pos]}: {final_answer(item.candidates[cand])}" in text


def test_score_targets_anchored_vs_aware(items):
    for item in items[:50]:
        chosen, wrong = item.order[0], item.order[1]  # correct; perception error, reasoning intact
        for aware in (False, True):
            for cand in (chosen, wrong):
                assert parse_score(score_target(item, cand, aware), think_prefilled=True).format_ok
        anchored = [parse_score(score_target(item, c, False), think_prefilled=True).scores[0] for c in (chosen, wrong)]
        aware = [parse_score(score_target(item, c, True), think_prefilled=True).scores[0] for c in (chosen, wrong)]
        assert anchored == [SCORE_CONSISTENT, SCORE_CONSISTENT]  # the fluent wrong answer is believed
        assert aware == [SCORE_CONSISTENT, SCORE_MISMATCH]


def test_examples_are_deterministic_and_mixed():
    a = sft_examples(RECIPE, 20, seed=5)
    b = sft_examples(RECIPE, 20, seed=5)
    assert [(e.prompt, e.response) for e in a] == [(e.prompt, e.response) for e in b]
    assert [e.task for e in a[:4]] == ["probe", "vqa", "batch", "score"] and len(a) == 80
    assert {e.task for e in a if e.prompt.user.endswith("?")} >= {"probe", "vqa"}
    assert a != sft_examples(RECIPE, 20, seed=6)
    # bias=0: every judging target follows the image.
    aware = sft_examples(dataclasses.replace(RECIPE, bias=0.0), 20, seed=5)
    for e in aware:
        if e.task == "batch":
            assert judge_reward(e.response, e.prompt.target, think_prefilled=True).total == 1.0


def test_recipe_hash_follows_the_recipe():
    assert recipe_hash(RECIPE) == recipe_hash(BaseJudgeRecipe())
    assert recipe_hash(RECIPE) != recipe_hash(dataclasses.replace(RECIPE, sft_steps=RECIPE.sft_steps + 1))


def test_code_fingerprint_ignores_docstrings_but_not_code(tmp_path, monkeypatch):
    pkg = tmp_path / "fpmod"
    pkg.mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    versions = {
        "a": '"""Doc."""\ndef f():\n    """One."""\n    return 1  # a comment\n',
        "b": '"""Other doc."""\n\ndef f():\n    """Two."""\n    return 1\n',
        "c": '"""Doc."""\ndef f():\n    """One."""\n    return 2\n',
    }
    prints = {}
    for name, text in versions.items():
        (pkg / f"m_{name}.py").write_text(text)
        (pkg / "__init__.py").write_text("")
        prints[name] = code_fingerprint(f"fpmod.m_{name}")
    assert prints["a"] == prints["b"] != prints["c"]


def test_every_kind_of_the_recipe_is_judged_and_training_scenes_are_listed():
    pairs = judge_scenes(3 * len(RECIPE.kinds), seed=0, recipe=RECIPE)
    assert [qa.kind for qa, _ in pairs] == list(RECIPE.kinds) * 3
    low, high = RECIPE.objects
    assert all(low <= len(qa.scene.objects) <= high for qa, _ in pairs)
    small = dataclasses.replace(RECIPE, sft_scenes=12, vision_steps=2, vision_batch=4)
    seeds = training_scene_seeds(small)
    assert {qa.scene.seed for qa, _ in judge_scenes(12, small.seed, small)} <= seeds
    assert len(seeds) >= 12 + 8


def test_cell_targets_match_the_scene():
    scene = generate_scene(11, 96, 2, 4)
    t = cell_targets(scene)
    assert t.shape == (9, 5)
    occupied = {o.row * 3 + o.col for o in scene.objects}
    assert {int(i) for i in torch.nonzero(t[:, 0]).flatten()} == occupied
    assert t[:, 3].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and t[:, 4].tolist() == [0, 1, 2] * 3
