"""What a run teaches (task.kind), chosen once where the layout is: the prompts, the rows they
come from, and how responses are rewarded. The loop, learner, sync and layouts are the same.

- `JudgeTask` (the paper): PPJD tuples rendered as judging prompts (candidates in the stream's
  balanced orders; counterfactual pairs; the shuffled-target control), rewarded format x ranking
  by the reward workers.
- `PolicyTask`: (image, question[, answer]) rows rendered as questions, each answer rewarded by
  reward.source: `rule` (the reward workers: the final answer against the reference, on scenes
  the stated facts against the scene), `judge` (the judge reward workers rank each group's answers,
  `pjray.rollout.judge_worker`: one generate per worker a step) or `mix`; the format check
  multiplies each. Per step: judge calls, their share of the step, unreadable verdicts, position
  consistency, and, where rows have references, the judge's agreement with the rule (Kendall tau
  within each group).
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from pathlib import Path
from typing import Any, Protocol

from pjray.config import Config
from pjray.data.hf import DatasetItems
from pjray.data.prompts import render_batch, render_question
from pjray.data.questions import training_questions
from pjray.data.sampler import shown_order
from pjray.data.sources import Rows, write_rejects
from pjray.models.loading import opens_think
from pjray.placement import Placement, RoleResources, WorkerPool, split_evenly
from pjray.ppjd.swap import counterfactual_pair
from pjray.reward.answer import shown_answer
from pjray.reward.judging import kendall_tau
from pjray.reward.ranking import shuffled_target
from pjray.reward.workers import RewardWorker
from pjray.rl.items import training_items, usable_rows
from pjray.rl.timer import Timer
from pjray.rollout.judge_worker import JudgeRewardWorker
from pjray.types import AnswerGroup, Completion, GroupVerdict, JudgePrompt, Question, RewardResult, TrainInputs


class Task(Protocol):
    pools: dict[str, WorkerPool]  # the scoring roles' pools, by role, once `start` has run

    def roles(self) -> dict[str, RoleResources]:
        """The roles this task places beyond the layout's (placed after them)."""

    def rows(self, inputs: TrainInputs) -> Any:
        """The training rows, read before Ray starts."""

    def usable(self, data: Any, processor: Any, rejects: Path) -> Any:
        """`data` without the rows the engines cannot take, each listed in `rejects`."""

    def start(self, placement: Placement, inputs: TrainInputs) -> list:
        """Launch the scoring pools; returns their `ready` refs."""

    def prompts(self, index: int, item: Any) -> list[JudgePrompt]:
        """The prompts of one group, from the `index`-th row sampled."""

    def score(
        self, prompts: list[JudgePrompt], texts: list[str], completions: list[Completion], timer: Timer
    ) -> list[RewardResult]:
        """One reward per completion (`texts`: the prompts' chat texts)."""

    def metrics(self, seconds: dict[str, float]) -> dict[str, float]:
        """The task's metrics of the step since the last call (`seconds`: the step's wall time per phase)."""


def reward_pool(cfg: Config, placement: Placement) -> WorkerPool:
    """The rule and ranking reward workers (CPU), their start not waited for."""
    return WorkerPool(
        placement,
        "reward",
        RewardWorker,
        lambda i: (cfg.reward, cfg.rollout.max_new_tokens),
        max_retries=cfg.trainer.max_step_retries,
        wait=False,
    )


class JudgeTask:
    """Train a judge: PPJD tuples, format x ranking."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.pools: dict[str, WorkerPool] = {}

    def roles(self) -> dict[str, RoleResources]:
        return {}

    def rows(self, inputs: TrainInputs) -> Rows | DatasetItems:
        return training_items(self.cfg, inputs.items)

    def usable(self, data: Any, processor: Any, rejects: Path) -> Any:
        # A stream lists its bad rows as it reads them (StreamSampler).
        return usable_rows(data, processor, self.cfg, rejects) if isinstance(data, Rows) else data

    def start(self, placement: Placement, inputs: TrainInputs) -> list:
        self.pools = {"reward": reward_pool(self.cfg, placement)}
        return self.pools["reward"].ready()

    def prompts(self, index: int, item: Any) -> list[JudgePrompt]:
        """The tuple (with data.counterfactual_pairs, also on its swapped image, the same letters)
        in the stream's balanced order; with reward.shuffle_target the target shuffled per
        prompt (the control)."""
        cfg = self.cfg
        shown = shown_order(index, len(item.candidates), cfg.trainer.seed)
        out = []
        for it in counterfactual_pair(item) if cfg.data.counterfactual_pairs else (item,):
            prompt = render_batch(it, None, style=cfg.reward.style, shown=shown)
            if cfg.reward.shuffle_target:
                prompt = dataclasses.replace(
                    prompt, target=shuffled_target(prompt.target, f"{cfg.trainer.seed}:{index}:{it.id}")
                )
            # data.images=false: a text-only judge (validated against the model in config).
            out.append(prompt if cfg.data.images else dataclasses.replace(prompt, image=None))
        return out

    def score(
        self, prompts: list[JudgePrompt], texts: list[str], completions: list[Completion], timer: Timer
    ) -> list[RewardResult]:
        """format x ranking per completion, over the reward workers in even chunks."""
        targets = [prompts[c.prompt_index].target for c in completions]
        # Whether a response must open <think> itself is read from its prompt's text: a chat
        # template may open the block whatever model.think_prefix says.
        prefilled = [opens_think(texts[c.prompt_index]) for c in completions]
        pool = self.pools["reward"]
        chunks = split_evenly(range(len(completions)), len(pool))
        answers = pool.call(
            "score_timed",
            [
                ([completions[i] for i in chunk], [targets[i] for i in chunk], [prefilled[i] for i in chunk])
                for chunk in chunks
            ],
        )
        return [r for chunk_results in timer.unwrap("reward", answers) for r in chunk_results]

    def metrics(self, seconds: dict[str, float]) -> dict[str, float]:
        return {}


class PolicyTask:
    """Train a policy: questions about images, answers rewarded by a rule, a judge, or both."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.pools: dict[str, WorkerPool] = {}
        self.rows_by_id: dict[str, Question] = {}
        self.uses_judge = cfg.reward.source in ("judge", "mix")
        self.judged = 0  # groups sent to the judge so far: keys their call designs
        self.sums: dict[str, list[float]] = defaultdict(list)

    def roles(self) -> dict[str, RoleResources]:
        if not self.uses_judge:
            return {}
        j = self.cfg.reward.judge
        return {
            "judge": RoleResources(
                j.num_workers,
                j.num_cpus_per_worker,
                j.num_gpus_per_worker,
                share_with="rollout" if j.colocate else None,
                resources=dict(j.resources),
            )
        }

    def rows(self, inputs: TrainInputs) -> Rows[Question]:
        rows = training_questions(self.cfg.data)
        self.rows_by_id = {q.id: q for q in rows.rows}
        return rows

    def usable(self, data: Rows[Question], processor: Any, rejects: Path) -> Rows[Question]:
        write_rejects(data.rejects, rejects)
        return data

    def start(self, placement: Placement, inputs: TrainInputs) -> list:
        cfg = self.cfg
        self.pools = {"reward": reward_pool(cfg, placement)}
        if self.uses_judge:
            threads = placement.threads("judge", 0)
            self.pools["judge"] = WorkerPool(
                placement,
                "judge",
                JudgeRewardWorker,
                lambda i: (cfg.reward.judge, inputs.judge, cfg.model, i, threads[i]),
                max_retries=cfg.trainer.max_step_retries,
                wait=False,
            )
        return [ref for pool in self.pools.values() for ref in pool.ready()]

    def prompts(self, index: int, item: Question) -> list[JudgePrompt]:
        image = item.image if self.cfg.data.images else None
        return [
            render_question(
                item.question,
                image,
                item_id=item.id,
                reference=item.reference or "",
                style=self.cfg.task.answer_style,
            )
        ]

    def score(
        self, prompts: list[JudgePrompt], texts: list[str], completions: list[Completion], timer: Timer
    ) -> list[RewardResult]:
        """The rule's results (format, and correctness where a reference exists) from the reward
        workers, then with a judge the group's judge rewards in their place or mixed in."""
        rows = [self.rows_by_id[prompts[c.prompt_index].item_id] for c in completions]
        pool = self.pools["reward"]
        chunks = split_evenly(range(len(completions)), len(pool))
        answers = pool.call(
            "score_answers_timed", [([completions[i] for i in c], [rows[i] for i in c]) for c in chunks]
        )
        rule = [r for chunk in timer.unwrap("reward", answers) for r in chunk]
        self.sums["reward/rule_mean"].append(sum(r.ranking for r in rule) / max(1, len(rule)))
        if not self.uses_judge:
            return rule
        with timer("judge"):
            judged = self.judge(prompts, completions, timer)
        w = self.cfg.reward.judge_weight if self.cfg.reward.source == "mix" else 1.0
        out = []
        for r, j in zip(rule, judged):
            content = (1 - w) * r.ranking + w * j
            penalty = r.total - r.format * r.ranking  # the overlong penalty the rule's total holds
            out.append(dataclasses.replace(r, total=r.format * content + penalty, ranking=content))
        self.record_agreement(prompts, completions, rule, judged)
        return out

    def judge(self, prompts: list[JudgePrompt], completions: list[Completion], timer: Timer) -> list[float]:
        """Each completion's judge reward: its group's answers ranked by the judge workers, the
        step's groups split evenly over them, one call (one generate) each."""
        by_prompt: dict[int, list[Completion]] = defaultdict(list)
        for c in completions:
            by_prompt[c.prompt_index].append(c)
        groups = []
        for index in sorted(by_prompt):
            prompt = prompts[index]
            self.judged += 1
            groups.append(
                AnswerGroup(
                    key=f"{self.cfg.trainer.seed}/{self.judged}/{prompt.item_id}",
                    question=prompt.user,
                    image=prompt.image,
                    answers=tuple(shown_answer(c.text) for c in by_prompt[index]),
                )
            )
        pool = self.pools["judge"]
        chunks = split_evenly(groups, len(pool))
        seed = self.cfg.trainer.seed * 1_000_003 + self.judged
        verdicts: list[GroupVerdict] = [
            v for chunk in timer.unwrap("reward", pool.call("judge_timed", [(c, seed) for c in chunks])) for v in chunk
        ]
        calls = sum(v.calls for v in verdicts)
        judged = sum(v.subsets_judged for v in verdicts)
        self.sums["judge/calls"].append(float(calls))
        self.sums["judge/unreadable"].append(sum(v.unreadable for v in verdicts) / max(1, calls))
        if judged:
            self.sums["judge/position_consistency"].append(sum(v.subsets_consistent for v in verdicts) / judged)
        per_group = [list(v.rewards) for v in verdicts]
        if self.cfg.reward.judge.shuffle_rewards:
            for g, rewards in zip(groups, per_group):
                random.Random(f"shuffle/{g.key}").shuffle(rewards)
        rewards = [r for group_rewards in per_group for r in group_rewards]
        self.sums["reward/judge_mean"].append(sum(rewards) / max(1, len(rewards)))
        return rewards

    def record_agreement(
        self, prompts: list[JudgePrompt], completions: list[Completion], rule: list[RewardResult], judged: list[float]
    ) -> None:
        """judge/oracle_agreement: Kendall's tau between the judge's and the rule's rewards within
        each group whose rows have a reference and whose rewards are not all equal."""
        groups: dict[int, list[int]] = defaultdict(list)
        for i, c in enumerate(completions):
            if prompts[c.prompt_index].target:
                groups[c.prompt_index].append(i)
        taus = [kendall_tau([judged[i] for i in g], [rule[i].ranking for i in g]) for g in groups.values()]
        taus = [t for t in taus if t is not None]
        if taus:
            self.sums["judge/oracle_agreement"].append(sum(taus) / len(taus))

    def metrics(self, seconds: dict[str, float]) -> dict[str, float]:
        out = {}
        for key, values in self.sums.items():
            out[key] = sum(values) if key == "judge/calls" else sum(values) / len(values)
        if self.uses_judge and seconds.get("step"):
            out["judge/time_share"] = seconds.get("judge", 0.0) / seconds["step"]
        self.sums.clear()
        return out


def choose_task(cfg: Config) -> Task:
    """The task `cfg` describes (task.kind)."""
    return PolicyTask(cfg) if cfg.task.kind == "policy" else JudgeTask(cfg)
