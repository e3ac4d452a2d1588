"""The image-contrast bonus and the shuffled-target control: pure functions, and a scripted
collector that generates on contrast images and adds the bonus to the trained responses."""

from __future__ import annotations

import dataclasses
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from pjray.config import ConfigError, load
from pjray.data.scenes import render
from pjray.ppjd.perturb import scene_items
from pjray.ppjd.shortcuts import scene_qa
from pjray.reward.contrast import contrast_bonus, with_contrast
from pjray.reward.ranking import shuffled_target
from pjray.rl.collect import Batch, Collector, blank_image, rollout_metrics
from pjray.rl.task import JudgeTask
from pjray.rl.timer import Timer
from pjray.types import Completion, RewardResult, Timed


def scored(pred: str | None, total: float = 0.0) -> RewardResult:
    return RewardResult(total, 1.0 if pred else 0.0, total, pred, "")


def test_the_bonus_pays_a_right_verdict_by_how_often_the_contrast_image_changes_it():
    contrast = [scored("BAC"), scored("ABC"), scored(None), scored("BCA")]  # tops B, A, none, B
    bonus = contrast_bonus([scored("ABC"), scored("BAC"), scored("ACB"), scored(None)], contrast, "ABC", 0.5)
    # A right (A first): the contrast verdicts differ 3 times in 4 (B, none, B).
    # B first is wrong: nothing. A first with the rest wrong: still the verdict's top is right.
    assert bonus == [0.5 * 3 / 4, 0.0, 0.5 * 3 / 4, 0.0]
    # A judge whose verdict the text decides says the same without the image: no bonus.
    assert contrast_bonus([scored("ABC")] * 3, [scored("ABC")] * 2, "ABC", 1.0) == [0.0] * 3
    with pytest.raises(ValueError, match="no contrast"):
        contrast_bonus([scored("ABC")], [], "ABC", 1.0)


def test_with_contrast_adds_each_prompts_bonus_to_its_responses():
    results = [scored("ABC", 1.0), scored("BAC", 0.3), scored("BAC", 1.0), scored("BAC", 1.0)]
    contrast = [scored("BAC"), scored("CAB"), scored("ABC"), scored("BAC")]
    out, bonuses = with_contrast(results, contrast, ["ABC", "BAC"], 1.0)
    assert bonuses == [1.0, 0.0, 0.5, 0.5]
    assert [r.total for r in out] == [2.0, 0.3, 1.5, 1.5] and [r.ranking for r in out] == [1.0, 0.3, 1.0, 1.0]
    with pytest.raises(ValueError, match="contrast responses"):
        with_contrast(results, contrast[:3], ["ABC", "BAC"], 1.0)


def test_a_shuffled_target_is_a_fixed_draw_per_key_that_ignores_the_target():
    assert shuffled_target("ABC", "k1") == shuffled_target("ABC", "k1")
    assert sorted(shuffled_target("BCA", "k1")) == ["A", "B", "C"]
    draws = Counter(shuffled_target("ABC", f"k{i}") for i in range(600))
    assert len(draws) == 6 and min(draws.values()) > 60  # every ranking, about equally often
    # The same key gives the same position permutation, whatever the target.
    assert [shuffled_target(t, "k2") for t in ("ABC", "CBA")][0] == shuffled_target("ABC", "k2")


def test_image_contrast_needs_images_and_an_image_to_contrast_with():
    ok = load(None, ["algo.contrast_responses=2"])
    assert ok.algo.contrast_responses == 2 and ok.algo.contrast_image == "other"
    for overrides, why in (
        (["algo.contrast_responses=2", "trainer.prompts_per_step=1"], "prompts_per_step >= 2"),
        (["algo.contrast_responses=2", "data.counterfactual_pairs=true"], "counterfactual_pairs"),
        (
            ["algo.contrast_responses=2", "algo.contrast_image=blank", "data.source=parquet", "data.path=x.parquet"],
            "data.source=scenes",
        ),
    ):
        with pytest.raises(ConfigError, match=why):
            load(None, overrides)


class Sampler:
    """Takes the items in order."""

    def __init__(self, items):
        self.items, self.state, self.at = items, None, 0

    def take(self, n):
        out = [(self.at + i, self.items[(self.at + i) % len(self.items)]) for i in range(n)]
        self.at += n
        return out


class ContrastCollector(Collector):
    """Generation and reward scripted: on its own image a response ranks the target; on any other
    image, the target reversed."""

    def __init__(self, cfg, items):
        super().__init__(cfg, Sampler(items), processor=None, rollout=None, task=JudgeTask(cfg))
        self.images = {it.id: it.image for it in items}
        self.calls: list[tuple[list[bytes | None], int]] = []

    def chat_texts(self, prompts):
        return ["t"] * len(prompts)

    def submit_batch(self, step):
        r = self.sample_prompts(self.cfg.trainer.prompts_per_step)
        done = [
            self._answer(r.prompts, self.responses_per_prompt),
            self._answer(r.contrast, self.cfg.algo.contrast_responses),
        ]
        return Batch(step, None, r, *(SimpleNamespace(result=lambda c=c: Timed(c, 0.0)) for c in done))

    def _answer(self, prompts, n):
        self.calls.append(([p.image for p in prompts], n))
        return [Completion(i, s, (1,), (0.0,), "x", "stop") for i in range(len(prompts)) for s in range(n)]

    def score(self, prompts, texts, completions, timer):
        out = []
        for c in completions:
            p = prompts[c.prompt_index]
            own = p.image == self.images[p.item_id.removesuffix(":contrast")]
            pred = p.target if own else p.target[::-1]
            out.append(RewardResult(1.0 if pred == p.target else 0.0, 1.0, 1.0 if pred == p.target else 0.0, pred, ""))
        return out


@pytest.fixture(scope="module")
def scene_items_():
    return scene_items(8, 3, 3, 96, ("color", "size"), (1, 1))


@pytest.mark.parametrize("image", ["other", "blank"])
def test_the_collector_scores_contrast_responses_and_trains_on_the_real_ones(scene_items_, image):
    cfg = load(
        None,
        [
            "trainer.prompts_per_step=4",
            "algo.group_size=4",
            "algo.contrast_responses=2",
            f"algo.contrast_image={image}",
            "algo.image_contrast=0.5",
        ],
    )
    collector = ContrastCollector(cfg, scene_items_)
    rollouts = collector.collect(1, Timer())
    (real, n_real), (contrast, n_contrast) = collector.calls
    assert (n_real, n_contrast) == (4, 2) and len(real) == len(contrast) == 4
    if image == "other":
        assert contrast == real[1:] + real[:1]  # each prompt on the next one's image
    else:
        assert contrast == [blank_image(it) for it in scene_items_[:4]]
    # Trained: the 16 real responses, every one right, each with the full bonus (the contrast
    # verdicts all differ from it); the contrast responses are not among them.
    assert len(rollouts.completions) == len(rollouts.rewards) == 16
    assert [r.total for r in rollouts.rewards] == [1.5] * 16
    assert rollout_metrics(rollouts, torch.zeros(16), 4)["reward/contrast_bonus_mean"] == 0.5


def test_the_shuffled_control_trains_on_targets_drawn_per_prompt(scene_items_):
    cfg = load(None, ["trainer.prompts_per_step=8", "reward.shuffle_target=true"])
    plain_cfg = load(None, ["trainer.prompts_per_step=8"])
    plain = Collector(plain_cfg, Sampler(scene_items_), None, None, JudgeTask(plain_cfg))
    plain.chat_texts = lambda ps: ["t"] * len(ps)
    shuffled = Collector(cfg, Sampler(scene_items_), None, None, JudgeTask(cfg))
    shuffled.chat_texts = plain.chat_texts
    a, b = plain.sample_prompts(8).prompts, shuffled.sample_prompts(8).prompts
    assert [p.user for p in a] == [p.user for p in b]  # the same prompts ...
    assert [p.target for p in a] != [p.target for p in b]  # ... and other targets
    assert all(sorted(p.target) == ["A", "B", "C"] for p in b)


def test_a_blank_image_is_the_scene_without_its_object(scene_items_):
    item = scene_items_[0]
    qa = scene_qa(item.meta)
    assert blank_image(item) == render(dataclasses.replace(qa.scene, objects=())) != item.image
    with pytest.raises(ValueError, match="scene item"):
        blank_image(dataclasses.replace(item, meta={}))
