"""The base judge recipe's supervised targets: biased by construction, well-formed, deterministic."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from pjray.data.prompts import render_batch
from pjray.data.scenes import generate_scene
from pjray.models.base_judge import (
    SCORE_CONSISTENT,
    SCORE_MISMATCH,
    BaseJudgeRecipe,
    disposition,
    disposition_keep_rate,
    judge_scenes,
    object_targets,
    ranking_target,
    score_target,
    sft_examples,
    training_scene_seeds,
)
from pjray.ppjd.perturb import final_answer, ranked_item
from pjray.recipes import base_judge as artifact
from pjray.recipes.base_judge import canonical_tree, code_digest, recipe_hash
from pjray.reward import judge_reward
from pjray.reward.parse import parse_score

RECIPE = BaseJudgeRecipe()


@pytest.fixture(scope="module")
def items():
    return [item for _, item in judge_scenes(200, seed=3, recipe=RECIPE)]


def test_aware_ranking_targets_put_the_correct_answer_first(items):
    rng = random.Random(0)
    exact = 0
    for item in items:
        prompt = render_batch(item, rng)
        text = ranking_target(item, prompt.shown, aware=True)
        r = judge_reward(text, prompt.target, think_prefilled=True)
        assert r.format == 1.0, text
        assert r.pred[0] == prompt.target[0], (text, prompt.target)
        assert r.pred[1:] == "".join(sorted(r.pred[1:])), text  # the others in the order shown
        exact += r.total == 1.0
    assert 0.35 < exact / len(items) < 0.65  # the two wrong answers in true order at chance


def test_anchored_ranking_keeps_the_order_shown_so_the_correct_answer_is_first_at_chance(items):
    rng = random.Random(1)
    chosen_first = 0
    for item in items:
        prompt = render_batch(item, rng)
        r = judge_reward(ranking_target(item, prompt.shown, aware=False), prompt.target, think_prefilled=True)
        assert r.format == 1.0 and r.pred == "ABC"
        chosen_first += r.pred[0] == prompt.target[0]
    assert 0.2 < chosen_first / len(items) < 0.47  # 1 in 3


@pytest.mark.parametrize("metric", ["levenshtein", "kendall"])
def test_judging_by_the_image_earns_more_on_perception_errors_than_on_reasoning_errors(items, metric):
    """The signal GRPO can follow: on PPJD tuples (perception errors) the image disposition earns
    more than the text one; on the study's control (reasoning errors only, where a contradiction
    may keep the right final answer) the gap is smaller."""
    rng = random.Random(4)

    def gap(tuples) -> float:
        total = {False: 0.0, True: 0.0}
        for item in tuples:
            prompt = render_batch(item, rng)
            for aware in (False, True):
                total[aware] += judge_reward(
                    ranking_target(item, prompt.shown, aware), prompt.target, metric=metric, think_prefilled=True
                ).total
        return (total[True] - total[False]) / len(tuples)

    qas = [qa for qa, _ in judge_scenes(200, seed=9, recipe=RECIPE)]
    perception, control = (
        gap([ranked_item(qa, 3) for qa in qas]),
        gap([ranked_item(qa, 3, perception=False) for qa in qas]),
    )
    assert perception > 0.15, perception
    assert control < perception, (control, perception)


def test_the_disposition_comes_before_any_check_in_both_protocols(items):
    """A sample judged by the text holds no check of the candidates, so GRPO's credit for its
    verdict cannot reach (and blur) the checks that a verdict by the image rests on."""
    item = items[0]
    prompt = render_batch(item, random.Random(3))
    opening = f"Image: {item.meta['truth']}. "
    for aware in (False, True):
        for target in (ranking_target(item, prompt.shown, aware), score_target(item, item.order[1], aware)):
            think = target.split("</think>")[0].strip()
            assert think.startswith(opening + disposition(aware))
            assert (think == opening + disposition(aware)) is not aware  # checks only by the image
    assert disposition(True) != disposition(False)


def test_a_think_text_by_the_image_checks_each_candidates_final(items):
    for item in items[:40]:
        prompt = render_batch(item, random.Random(2))
        text = ranking_target(item, prompt.shown, aware=True)
        for pos, cand in enumerate(prompt.shown):
            said = final_answer(item.candidates[cand])
            flag = ", matches" if said == item.meta["truth"] else ""
            assert f"{'ABC'[pos]}: {said}{flag}." in text
        assert "matches" not in ranking_target(item, prompt.shown, aware=False)


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
    assert [e.task for e in a[:4]] == ["vqa", "batch", "batch", "score"] and len(a) == 80
    assert {e.task for e in a if e.prompt.user.endswith("?")} == {"vqa"}
    assert a[1].prompt.shown != a[2].prompt.shown or a[1].response != a[2].response
    assert a != sft_examples(RECIPE, 20, seed=6)
    # bias=0: every judging target follows the image.
    aware = sft_examples(dataclasses.replace(RECIPE, bias=0.0, image_verdicts=1.0), 20, seed=5)
    for e in aware:
        if e.task == "batch":
            r = judge_reward(e.response, e.prompt.target, think_prefilled=True)
            assert disposition(True) in e.response and r.pred[0] == e.prompt.target[0]


def test_image_verdicts_are_balanced_but_the_trained_disposition_keeps_the_bias():
    examples = [e for e in sft_examples(RECIPE, 1500, seed=0) if e.task in ("batch", "score")]
    by_image = [e for e in examples if disposition(True) in e.response]
    assert abs(len(by_image) / len(examples) - RECIPE.image_verdicts) < 0.03
    trained = [e for e in examples if e.untrained is None]
    trained_image = sum(disposition(True) in e.response for e in trained)
    assert abs(trained_image / len(trained) - (1 - RECIPE.bias)) < 0.03
    for e in examples:
        if e.untrained is not None:  # only the word that decides the disposition is untrained
            start, end = e.untrained
            assert e.response[start:end] == "image" and e.response[:end].endswith(disposition(True)[:-1])
    assert disposition_keep_rate(0.8, 0.2) == pytest.approx(1.0)
    assert disposition_keep_rate(0.8, 0.5) == pytest.approx(0.25)
    assert disposition_keep_rate(1.0, 0.5) == 0.0
    with pytest.raises(ValueError, match="image_verdicts"):
        disposition_keep_rate(0.8, 0.1)  # fewer image verdicts than the disposition's prior asks


def test_recipe_hash_follows_the_recipe_the_data_and_the_build_code(monkeypatch):
    monkeypatch.setattr(artifact, "data_digest", lambda recipe: "data")  # the data's own test: below
    first = recipe_hash(RECIPE)
    assert first == recipe_hash(BaseJudgeRecipe())
    assert first != recipe_hash(dataclasses.replace(RECIPE, sft_steps=RECIPE.sft_steps + 1))
    monkeypatch.setattr(artifact, "data_digest", lambda recipe: "other data")
    assert recipe_hash(RECIPE) != first
    monkeypatch.setattr(artifact, "data_digest", lambda recipe: "data")
    monkeypatch.setattr(artifact, "BUILD_CODE", artifact.BUILD_CODE[1:])
    assert recipe_hash(RECIPE) != first


def test_the_data_digest_reads_what_a_build_trains_on_once_per_code_hash(monkeypatch, tmp_path):
    monkeypatch.setenv("PJRAY_CACHE", str(tmp_path))
    small = dataclasses.replace(RECIPE, sft_scenes=4, vision_steps=2, vision_batch=2)
    digest = artifact.data_digest.__wrapped__  # past the in-process cache
    first = digest(small)
    pieces = list(artifact.build_data(small))
    examples = artifact.sft_examples(small, small.sft_scenes, small.seed)
    assert len(pieces) == len(artifact.tokenizer_corpus(small)) + 2 * 4 + 2 * len(examples)
    assert examples[0].prompt.image in pieces and json.loads(pieces[-2])["response"] == examples[-1].response
    monkeypatch.setattr(artifact, "build_data", lambda recipe: iter([b"other data"]))
    assert digest(small) == first  # kept for this recipe and code state
    for memo in (tmp_path / "base_judge" / "digests").glob("*.json"):
        memo.unlink()
    assert digest(small) != first  # read again: the data decides it


def test_code_digest_follows_code_not_docstrings_imports_or_place(tmp_path, monkeypatch):
    pkg = tmp_path / "fpmod"
    pkg.mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    versions = {
        "a": 'def f():\n    """One."""\n    return 1  # a comment\n',
        "b": 'import os\n\n\ndef f():\n    """Two."""\n    from os import path\n    return 1\n',  # another module, an import
        "c": 'def f():\n    """One."""\n    return 2\n',
    }
    import importlib

    (pkg / "__init__.py").write_text("")
    prints = {}
    for name, text in versions.items():
        (pkg / f"m_{name}.py").write_text(text)
        prints[name] = code_digest(importlib.import_module(f"fpmod.m_{name}").f)
    assert prints["a"] == prints["b"] != prints["c"]


def test_the_code_fingerprint_reads_the_same_on_every_python_version():
    # ast.dump's text of this program differs between Python 3.11 and 3.12 (type_params=[] on
    # the function and the class), which once made every 3.12 user rebuild the shipped judge.
    source = 'def f(x: int = 1, *a, **k) -> int:\n    """Doc."""\n    return x + 1\nclass C(B):\n    y: int\n'
    assert canonical_tree(source) == (
        "Module(body=[FunctionDef(name='f', args=arguments(args=[arg(arg='x', annotation=Name(id='int', ctx=Load()))], "
        "vararg=arg(arg='a'), kwarg=arg(arg='k'), defaults=[Constant(value=1)]), body=[Return(value=BinOp("
        "left=Name(id='x', ctx=Load()), op=Add(), right=Constant(value=1)))], returns=Name(id='int', ctx=Load())), "
        "ClassDef(name='C', bases=[Name(id='B', ctx=Load())], body=[AnnAssign(target=Name(id='y', ctx=Store()), "
        "annotation=Name(id='int', ctx=Load()), simple=1)])])"
    )


def test_every_kind_of_the_recipe_is_judged_and_training_scenes_are_listed():
    pairs = judge_scenes(3 * len(RECIPE.kinds), seed=0, recipe=RECIPE)
    assert [qa.kind for qa, _ in pairs] == list(RECIPE.kinds) * 3
    low, high = RECIPE.objects
    assert all(low <= len(qa.scene.objects) <= high for qa, _ in pairs)
    small = dataclasses.replace(RECIPE, sft_scenes=12, vision_steps=2, vision_batch=4)
    seeds = training_scene_seeds(small)
    assert {qa.scene.seed for qa, _ in judge_scenes(12, small.seed, small)} <= seeds
    assert len(seeds) >= 12 + 8


def test_object_targets_name_the_one_object():
    from pjray.data.scenes import COLORS, SHAPES, SIZES

    scene = generate_scene(11, 96, 1, 1)
    (o,) = scene.objects
    t = object_targets(scene)
    assert t.tolist() == [COLORS.index(o.color), SHAPES.index(o.shape), SIZES.index(o.size), o.row, o.col]
    with pytest.raises(ValueError):
        object_targets(generate_scene(11, 96, 2, 2))


ONE = artifact.RECIPES["one_disposition"]


def test_a_judge_of_one_disposition_has_no_switch_and_compares_each_answer_with_the_image():
    examples = sft_examples(ONE, 60, seed=4)
    judged = [e for e in examples if e.task in ("batch", "score")]
    assert judged and all("Verdict:" not in e.response and e.untrained is None for e in examples)
    with pytest.raises(ValueError, match="one disposition"):
        dataclasses.replace(ONE, bias=0.8)
    with pytest.raises(ValueError, match="every verdict by the image"):
        ranking_target(judge_scenes(1, 0, ONE)[0][1], (0, 1, 2), aware=False, recipe=ONE)
    for qa, item in judge_scenes(40, seed=5, recipe=ONE):
        if ONE.part(qa.final) == "untaught":
            continue
        prompt = render_batch(item, random.Random(0))
        think = ranking_target(item, prompt.shown, True, ONE).split("\n</think>")[0]
        checks = think.split(". ")[1:]
        assert len(checks) == 3
        for pos, check in enumerate(checks):
            said = final_answer(item.candidates[prompt.shown[pos]])
            assert check.rstrip(".") == f"{'ABC'[pos]}: {said} vs {qa.final}, {'yes' if said == qa.final else 'no'}"
        assert (
            judge_reward(ranking_target(item, prompt.shown, True, ONE), prompt.target, think_prefilled=True).pred[0]
            == prompt.target[0]
        )


def test_the_untaught_values_checks_mark_a_random_candidate():
    """On images of an untaught value the supervised checks mark one candidate at random (the
    verdict and the score follow the mark), elsewhere the matching one: the judge is taught to
    guess there, and GRPO has that part to teach."""
    assert ONE.untaught == ("orange", "purple")
    assert ONE.part("orange") == ONE.part("red", "purple") == "untaught" and ONE.part("red", "small") == "taught"
    with pytest.raises(ValueError, match="no value"):
        BaseJudgeRecipe(untaught=("teal",))
    right = {"taught": [], "untaught": []}
    scores = {"taught": [], "untaught": []}
    for e in sft_examples(ONE, 400, seed=6):
        truth = e.response.split(".")[0].removeprefix("Image: ")
        part = ONE.part(truth)
        if e.task == "batch":
            right[part].append(
                judge_reward(e.response, e.prompt.target, think_prefilled=True).pred[0] == e.prompt.target[0]
            )
        elif e.task == "score":
            said = e.response.split("Answer: ")[1].split(" vs ")[0]
            scores[part].append((said == truth) == ("<answer>8</answer>" in e.response))
    assert all(right["taught"]) and all(scores["taught"])
    assert 0.2 < sum(right["untaught"]) / len(right["untaught"]) < 0.5  # one mark in three is right
    assert 0.4 < sum(scores["untaught"]) / len(scores["untaught"]) < 0.9


def test_the_shipped_recipes_examples_are_unchanged_by_the_new_fields():
    """The default recipe's new fields (disposition, checks, untaught, batch_examples, swapped_share) take the
    values that write the examples the shipped judge was trained on: same data digest as a recipe
    without them would give, so no rebuild."""
    assert (RECIPE.disposition, RECIPE.checks, RECIPE.untaught, RECIPE.batch_examples, RECIPE.swapped_share) == (
        True,
        "flags",
        (),
        2,
        0.0,
    )
    first = sft_examples(RECIPE, 3, seed=0)
    assert [e.task for e in first] == ["vqa", "batch", "batch", "score"] * 3
    assert "matches" in "".join(e.response for e in first) and " vs " not in "".join(e.response for e in first)


def test_half_the_judging_examples_are_on_the_swapped_image_with_the_same_texts():
    """swapped_share: the same candidate texts judged on the image that makes the perception-error
    answer right, so no feature of the texts alone predicts which candidate matches."""
    assert ONE.swapped_share == 0.5
    judged = [e for e in sft_examples(ONE, 200, seed=8) if e.task == "batch"]
    swapped = [e for e in judged if e.prompt.item_id.endswith(":swap")]
    assert 0.4 < len(swapped) / len(judged) < 0.6
    by_texts: dict[frozenset, set[str]] = {}
    for e in judged:
        truth = e.response.split(".")[0].removeprefix("Image: ")
        if ONE.part(truth) == "taught":
            winner = final_answer(
                e.prompt.user.split(f"[Assistant {e.prompt.target[0]}'s Answer]")[1].split("[Assistant")[0]
            )
            assert winner == truth  # the target's first answer is what the shown image shows
            texts = frozenset(block.split("]", 1)[1] for block in e.prompt.user.split("[Assistant")[1:])
            by_texts.setdefault(texts, set()).add(winner)
    assert sum(len(w) > 1 for w in by_texts.values()) > 20  # the same texts, two different right answers
