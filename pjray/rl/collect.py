"""A step's scored groups: items sampled and rendered by the task (`pjray.rl.task`), responses
generated (ahead of training with `trainer.max_staleness`), scored as the task scores them (with `algo.contrast_responses`, also
on a contrast image, for the image-contrast bonus), and, with `algo.filter_zero_std`, groups
without reward variance dropped and refilled (DAPO's dynamic sampling)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections import deque
from collections.abc import Collection
from typing import Any

import torch

from pjray.config import Config
from pjray.data.scenes import render
from pjray.models.loading import render_chat
from pjray.ppjd.shortcuts import scene_qa
from pjray.reward.contrast import with_contrast
from pjray.rl.grpo import zero_std_groups
from pjray.rl.timer import Timer
from pjray.rollout.worker import PendingGeneration, generate_with_pool, submit_generation
from pjray.types import Completion, JudgeItem, JudgePrompt, RewardResult

log = logging.getLogger(__name__)

# A refill round asks for at most this many times the groups still needed.
MAX_REFILL_FACTOR = 4
# Generation seeds of algo.prefilter_zero_std's pass start here, apart from the steps' (step x 1000).
PREFILTER_SEED = 1_000_000_000


def refill_size(need: int, kept: int, seen: int) -> int:
    """How many prompts a round of `collect` generates to fill `need` more groups, when `kept` of
    the `seen` groups so far had reward variance: `need` at first, then `need` over the fraction
    kept so far (at most MAX_REFILL_FACTOR x `need`), so that one refill round usually fills the
    step instead of several rounds each adding a few groups."""
    if seen == 0:
        return need
    if kept == 0:
        return need * MAX_REFILL_FACTOR
    return min(need * MAX_REFILL_FACTOR, math.ceil(need * seen / kept))


@dataclasses.dataclass
class Rollouts:
    """Scored responses of the groups kept for training, group by group, and the rewards of every
    response generated for the step (kept or dropped by `algo.filter_zero_std`)."""

    prompts: list[JudgePrompt]  # one a group, or two (data.counterfactual_pairs)
    texts: list[str]  # chat-rendered prompt text per prompt
    completions: list[Completion]  # group_size per group, in prompt order
    rewards: list[RewardResult]
    frac_zero_std: float
    groups_seen: int
    seen: list[RewardResult]  # every scored response of the step: the policy's reward
    bonuses: list[float] = dataclasses.field(default_factory=list)  # image-contrast bonus of each seen response

    def groups(self, group_size: int) -> int:
        return len(self.rewards) // group_size


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def rollout_metrics(rollouts: Rollouts, advantages: torch.Tensor, group_size: int) -> dict[str, float]:
    """reward/*, rollout/*, response_length/* and advantages/* of a step. reward/* are over every
    response generated for the step, what the policy earns; with algo.filter_zero_std the groups
    trained on are a biased subset (reward/kept_mean)."""
    totals = [r.total for r in rollouts.seen]
    lengths = [len(c.token_ids) for c in rollouts.completions]
    some = advantages.numel() > 0
    return {
        "reward/mean": mean(totals),
        "reward/std": float(torch.tensor(totals).std()) if len(totals) > 1 else 0.0,
        "reward/format_mean": mean([r.format for r in rollouts.seen]),
        "reward/ranking_mean": mean([r.ranking for r in rollouts.seen]),
        "reward/kept_mean": mean([r.total for r in rollouts.rewards]),
        **({"reward/contrast_bonus_mean": mean(rollouts.bonuses)} if rollouts.bonuses else {}),
        "rollout/frac_zero_std": rollouts.frac_zero_std,
        "rollout/groups_kept": float(rollouts.groups(group_size)),
        "rollout/groups_seen": float(rollouts.groups_seen),
        "response_length/mean": mean(lengths),
        "response_length/max": float(max(lengths, default=0)),
        "response_length/clip_ratio": mean([float(c.finish_reason == "length") for c in rollouts.completions]),
        "advantages/mean": float(advantages.mean()) if some else 0.0,
        "advantages/max": float(advantages.max()) if some else 0.0,
        "advantages/min": float(advantages.min()) if some else 0.0,
    }


@dataclasses.dataclass
class Round:
    """Prompts of a round of generation with their chat texts, and with algo.contrast_responses
    the same prompts on their contrast images (`Collector.contrast_prompts`)."""

    prompts: list[JudgePrompt]
    texts: list[str]
    contrast: list[JudgePrompt] = dataclasses.field(default_factory=list)
    contrast_texts: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Batch:
    """A step's first round of prompts, its generation started (`Collector.submit_batch`), and the
    sampler's state before it took its items: with batches in flight, a checkpoint records the
    state before the first of them, so a resumed run takes those items again."""

    step: int
    sampler_state: Any
    round: Round
    generation: PendingGeneration
    contrast: PendingGeneration | None = None


class Collector:
    """Draws items from `sampler`, has `task` (a `pjray.rl.task.Task`) render them, generates on
    the `rollout` pool, and has `task` score the responses."""

    def __init__(self, cfg: Config, sampler: Any, processor: Any, rollout: Any, task: Any) -> None:
        self.cfg = cfg
        self.sampler, self.processor, self.rollout, self.task = sampler, processor, rollout, task
        # Batches whose generation has started, oldest first: the current step's and, with
        # trainer.max_staleness = k, those of up to k steps ahead.
        self.in_flight: deque[Batch] = deque()
        self.last_image: bytes | None = None  # a contrast image for a round of one prompt

    @property
    def prompts_per_group(self) -> int:
        """Prompts a GRPO group holds: one, or with data.counterfactual_pairs the tuple on its
        image and on its swapped image, each with half the group's responses."""
        return 2 if self.cfg.data.counterfactual_pairs else 1

    @property
    def responses_per_prompt(self) -> int:
        return self.cfg.algo.group_size // self.prompts_per_group

    def collect(self, step: int, timer: Timer) -> Rollouts:
        """Step `step`'s groups: its batch, and with filtering refill rounds until
        trainer.prompts_per_step groups have reward variance (or the rounds run out)."""
        cfg = self.cfg
        n, want, shown = cfg.algo.group_size, cfg.trainer.prompts_per_step, self.prompts_per_group
        rounds = 1 + (cfg.algo.max_refill_rounds if cfg.algo.filter_zero_std else 0)
        kept = Rollouts([], [], [], [], 0.0, 0, [])
        zero_groups = 0
        for round_index in range(rounds):
            need = refill_size(want - kept.groups(n), kept.groups(n), kept.groups_seen)
            with timer("gen"):
                if round_index == 0:
                    batch = self.next_batch(step)
                    r = batch.round
                    completions = timer.unwrap("gen", [batch.generation.result()])[0]
                    contrast = timer.unwrap("gen", [batch.contrast.result()])[0] if batch.contrast else []
                else:
                    r, completions, contrast = self.generate(need, seed=step * 1_000 + round_index, timer=timer)
            prompts, texts = r.prompts, r.texts
            with timer("reward"):
                results, bonuses = self.score_round(r, completions, contrast, timer)
                kept.bonuses.extend(bonuses)
            with timer("adv"):
                zero = zero_std_groups(torch.tensor([r.total for r in results]), n).tolist()
            zero_groups += sum(zero)
            kept.groups_seen += len(zero)
            kept.seen.extend(results)
            for g in range(len(zero)):
                if cfg.algo.filter_zero_std and zero[g]:
                    continue
                kept.prompts.extend(prompts[g * shown : (g + 1) * shown])
                kept.texts.extend(texts[g * shown : (g + 1) * shown])
                kept.completions.extend(completions[g * n : (g + 1) * n])
                kept.rewards.extend(results[g * n : (g + 1) * n])
            if kept.groups(n) >= want:
                break
        # A refill round may overshoot; keep exactly the configured number of groups.
        del (
            kept.prompts[want * shown :],
            kept.texts[want * shown :],
            kept.completions[want * n :],
            kept.rewards[want * n :],
        )
        kept.frac_zero_std = zero_groups / kept.groups_seen
        if not kept.prompts:
            # Every group was degenerate: train on nothing this step but keep the run alive.
            log.warning("step %d: every group had zero reward variance", step)
        return kept

    def next_batch(self, step: int) -> Batch:
        """Step `step`'s batch: first the generation of every step up to `max_staleness` ahead is
        started (each samples with the weights its workers hold when it reaches them: a sync
        queued behind it waits for it), then the oldest batch, this step's, is handed out."""
        last = self.in_flight[-1].step if self.in_flight else step - 1
        for ahead in range(last + 1, min(step + self.cfg.trainer.max_staleness, self.cfg.trainer.steps) + 1):
            self.in_flight.append(self.submit_batch(ahead))
        batch = self.in_flight.popleft()
        assert batch.step == step, (batch.step, step)
        return batch

    def wait_for_generation(self) -> None:
        """Block until the batches in flight have finished generating. A weight sync waits for
        them anyway (a worker takes it after the generations queued before it); waiting here,
        before the sync starts, keeps learner rank 0 from posting a broadcast that its receivers
        reach only after k long generations (past NCCL's watchdog)."""
        for batch in self.in_flight:
            batch.generation.wait_finished()
            if batch.contrast is not None:  # algo.contrast_responses: queued on the same workers
                batch.contrast.wait_finished()

    def submit_batch(self, step: int) -> Batch:
        """Take a step's items and start generating their groups."""
        state = copy.deepcopy(self.sampler.state)
        r = self.sample_prompts(self.cfg.trainer.prompts_per_step)
        seed = step * 1_000
        generation = submit_generation(self.rollout, r.prompts, self.responses_per_prompt, seed=seed)
        contrast = (
            submit_generation(self.rollout, r.contrast, self.cfg.algo.contrast_responses, seed=seed + 500)
            if r.contrast
            else None
        )
        return Batch(step, state, r, generation, contrast)

    def trained_state(self) -> Any:
        """The sampler's state after the items of the batches trained on so far: the state before
        the oldest batch in flight, if any."""
        return self.in_flight[0].sampler_state if self.in_flight else self.sampler.state

    def generate(self, num_groups: int, seed: int, timer: Timer) -> tuple[Round, list[Completion], list[Completion]]:
        """`sample_prompts` and generate a group's responses for each (and its contrast
        responses), now."""
        r = self.sample_prompts(num_groups)
        answers = [generate_with_pool(self.rollout, r.prompts, self.responses_per_prompt, seed)]
        if r.contrast:
            answers.append(generate_with_pool(self.rollout, r.contrast, self.cfg.algo.contrast_responses, seed + 500))
        completions = timer.unwrap("gen", answers)
        return r, completions[0], completions[1] if r.contrast else []

    def sample_prompts(self, num_groups: int) -> Round:
        """Sample items and have the task render each group's prompts (`Task.prompts`), with each
        prompt's chat text as the engines and the learner render it; with
        algo.contrast_responses, also the prompts on their contrast images."""
        prompts, items = [], []
        for index, item in self.sampler.take(num_groups):
            for prompt in self.task.prompts(index, item):
                prompts.append(prompt)
                items.append(item)
        r = Round(prompts, self.chat_texts(prompts))
        if self.cfg.algo.contrast_responses:
            r.contrast = self.contrast_prompts(prompts, items)
            r.contrast_texts = self.chat_texts(r.contrast)
        return r

    def chat_texts(self, prompts: list[JudgePrompt]) -> list[str]:
        return [render_chat(self.processor, p, think_prefix=self.cfg.model.think_prefix) for p in prompts]

    def contrast_prompts(self, prompts: list[JudgePrompt], items: list[JudgeItem]) -> list[JudgePrompt]:
        """Each prompt on its contrast image (algo.contrast_image): other, the image of the next
        prompt of the round (of the previous round, for a round of one); blank, the scene
        re-rendered without its object."""
        if self.cfg.algo.contrast_image == "blank":
            images = [blank_image(it) for it in items]
        elif len(prompts) > 1:
            images = [p.image for p in prompts[1:] + prompts[:1]]
        elif self.last_image is not None:
            images = [self.last_image]
        else:
            raise ValueError("image contrast (other): a round of one prompt and no earlier image to contrast it with")
        self.last_image = prompts[-1].image
        return [
            dataclasses.replace(p, item_id=f"{p.item_id}:contrast", image=image) for p, image in zip(prompts, images)
        ]

    def judge_texts(self, prompts: list[JudgePrompt], seed: int) -> list[str]:
        """One response text per prompt from the rollout workers: the evaluation hook's generate."""
        return [c.text for c in generate_with_pool(self.rollout, prompts, 1, seed).value]

    def score_round(
        self, r: Round, completions: list[Completion], contrast: list[Completion], timer: Timer
    ) -> tuple[list[RewardResult], list[float]]:
        """The rewards of a round's responses, with algo.contrast_responses each with its
        image-contrast bonus (also returned, one a response; none without contrast)."""
        results = self.score(r.prompts, r.texts, completions, timer)
        if not contrast:
            return results, []
        contrast_results = self.score(r.contrast, r.contrast_texts, contrast, timer)
        return with_contrast(results, contrast_results, [p.target for p in r.prompts], self.cfg.algo.image_contrast)

    def score(
        self, prompts: list[JudgePrompt], texts: list[str], completions: list[Completion], timer: Timer
    ) -> list[RewardResult]:
        """Reward per completion, as the task scores them."""
        return self.task.score(prompts, texts, completions, timer)


def blank_image(item: JudgeItem) -> bytes:
    """The item's scene re-rendered without any object (same size and background)."""
    qa = scene_qa(item.meta)
    if qa is None:
        raise ValueError(f"item {item.id!r}: algo.contrast_image=blank needs a scene item")
    return render(dataclasses.replace(qa.scene, objects=()))


def zero_variance_items(collector: Collector, count: int) -> dict[str, float]:
    """algo.prefilter_zero_std's pass over the next `count` items of `collector`'s sampler (one
    over the training set, fresh: each item once): each item's group sampled by the current
    policy and scored as a training step samples and scores one (shown orders, counterfactual
    pairs, shuffled target, image contrast as configured). Returns the items whose group's
    rewards all equal, id -> that reward: groups that would give GRPO no gradient (the offline
    twin of algo.filter_zero_std, as Skywork-OR1 and Polaris drop the prompts their initial
    policy always solves)."""
    cfg = collector.cfg
    n, shown, size = cfg.algo.group_size, collector.prompts_per_group, cfg.trainer.prompts_per_step
    timer, flat = Timer(), {}
    for start in range(0, count, size):
        r, completions, contrast = collector.generate(
            min(size, count - start), seed=PREFILTER_SEED + start, timer=timer
        )
        results, _ = collector.score_round(r, completions, contrast, timer)
        zero = zero_std_groups(torch.tensor([x.total for x in results]), n).tolist()
        flat.update({r.prompts[g * shown].item_id: results[g * n].total for g, z in enumerate(zero) if z})
    return flat


def prefiltered(items: list[JudgeItem], left_out: Collection[str]) -> list[JudgeItem]:
    """The items algo.prefilter_zero_std trains on: those whose id is not `left_out` (the ids of
    `zero_variance_items`, or of a resumed run's list); all of them when `left_out` names every
    one (a judge that never earns a reward, like model.init=tiny, or always the same one: nothing
    to learn either way, so the run goes on, as algo.filter_zero_std's steps do, and
    `pjray.rl.items.prefilter` warns)."""
    kept = [item for item in items if item.id not in left_out]
    return kept or list(items)
