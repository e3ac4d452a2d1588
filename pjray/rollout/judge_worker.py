"""`JudgeRewardWorker`: a frozen judge on an engine of its own (HF or vLLM) that ranks a policy's
answers, group by group, into rewards (`pjray.reward.judging`).

Every call of a step goes to the engine as one batch: `judge` renders the judge prompts of all
the groups it is given (each group's call design: subsets of its distinct answers under every
rotation of their letters), generates them with one `generate`, reads each verdict and turns each group's
verdicts into its rewards. An unreadable verdict is counted; its answers earn nothing from it,
and an answer left with no readable verdict gets its group's mean.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from pjray.config import JudgeRewardConfig, LoraConfig, ModelConfig, RolloutConfig
from pjray.data.prompts import render_batch, render_pair, render_score
from pjray.memory import peak_memory_mib
from pjray.models.loading import load_processor, opens_think, render_chat
from pjray.reward.judging import (
    calls,
    distinct_answers,
    group_rewards,
    position_consistency,
    subsets,
    verdict_points,
)
from pjray.reward.parse import parse_judgment, parse_pair, parse_score
from pjray.rollout.engine import RolloutEngine
from pjray.rollout.worker import build_engine
from pjray.types import AnswerGroup, GroupVerdict, JudgeItem, JudgePrompt, Timed

log = logging.getLogger(__name__)


def judge_model_config(judge: JudgeRewardConfig, model: ModelConfig, path: str) -> ModelConfig:
    """The judge's model settings: the run's image budget and dtype, no adapters, the judge's
    own think prefix."""
    return dataclasses.replace(
        model, path=path, lora=LoraConfig(), think_prefix=judge.think_prefix, gradient_checkpointing=False
    )


def judge_rollout_config(judge: JudgeRewardConfig) -> RolloutConfig:
    """The judge engine's sampling and placement settings, as a rollout engine reads them."""
    return RolloutConfig(
        backend=judge.engine,
        num_workers=judge.num_workers,
        num_cpus_per_worker=judge.num_cpus_per_worker,
        num_gpus_per_worker=judge.num_gpus_per_worker,
        max_new_tokens=judge.max_new_tokens,
        temperature=judge.temperature,
        device="cuda" if judge.num_gpus_per_worker > 0 else "cpu",
        tensor_parallel_size=judge.tensor_parallel_size,
        gpu_memory_utilization=judge.gpu_memory_utilization,
        max_model_len=judge.max_model_len,
    )


def call_prompt(protocol: str, style: str, group: AnswerGroup, call: tuple[int, ...]) -> JudgePrompt:
    """The judge prompt of one call: the group's question and image, and its answers `call`
    under letters A, B, ..."""
    answers = [group.answers[a] for a in call]
    if protocol == "score":
        return render_score(group.question, group.image, answers[0], item_id=group.key)
    if protocol == "pair":
        return render_pair(group.question, group.image, answers[0], answers[1], item_id=group.key, style=style)
    item = JudgeItem(
        id=group.key,
        image=group.image or b"",
        question=group.question,
        candidates=tuple(answers),
        order=tuple(range(len(answers))),
        source="policy",
    )
    prompt = render_batch(item, None, style=style, shuffle=False)
    return dataclasses.replace(prompt, image=group.image)


def read_verdict(protocol: str, style: str, k: int, text: str, think_prefilled: bool) -> str | int | None:
    """The verdict of a judge response (`pjray.reward.judging.verdict_points` reads it), None
    when none can be read."""
    if protocol == "score":
        scores = parse_score(text, think_prefilled=think_prefilled).scores
        return scores[0] if scores else None
    if protocol == "pair":
        return parse_pair(text, style=style, think_prefilled=think_prefilled).ranking
    return parse_judgment(text, k, style=style, think_prefilled=think_prefilled).ranking


class JudgeRewardWorker:
    """One judge replica. A plain class: the driver launches it with `ray.remote`, tests build it
    directly (with any engine: `engine=`).

    Args:
        cfg: reward.judge.
        model_path: the judge (an HF directory or hub id).
        model_cfg: the run's model settings (image budget, dtype; `judge_model_config`).
        worker_index: its index in the pool (seeds its engine's samples).
        num_threads: torch intra-op threads (0: leave torch's own).
        engine: an engine to use instead of building one (tests: a scripted judge).
    """

    def __init__(
        self,
        cfg: JudgeRewardConfig,
        model_path: str,
        model_cfg: ModelConfig,
        worker_index: int = 0,
        num_threads: int = 0,
        engine: RolloutEngine | None = None,
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.cfg, self.worker_index = cfg, worker_index
        self.model_cfg = judge_model_config(cfg, model_cfg, model_path)
        rollout_cfg = judge_rollout_config(cfg)
        device = "cuda" if cfg.num_gpus_per_worker > 0 and torch.cuda.is_available() else "cpu"
        self.engine = engine if engine is not None else build_engine(model_path, self.model_cfg, rollout_cfg, device)
        self.processor = load_processor(model_path, self.model_cfg.image_budget)
        self.generate_calls = 0  # engine generate calls so far (one a `judge` call)

    def judge(self, groups: list[AnswerGroup], seed: int) -> list[GroupVerdict]:
        """Each group's rewards, from one generate over every call of every group. A group is
        judged by its distinct answers (`distinct_answers`), in subsets of at most that many; a
        group of one distinct answer needs no ranking call (its answers earn UNREAD_REWARD
        alike)."""
        cfg = self.cfg
        plans = []
        for g in groups:
            distinct, index = distinct_answers(g.answers)
            k = min(cfg.subset_size, len(distinct))
            shown = calls(subsets(len(distinct), k, cfg.rounds, g.key)) if k > 1 or cfg.protocol == "score" else []
            plans.append((dataclasses.replace(g, answers=tuple(distinct)), index, k, shown))
        prompts = [call_prompt(cfg.protocol, cfg.style, g, c) for g, _, _, shown in plans for c in shown]
        texts: list[str] = []
        prefilled = False
        if prompts:
            completions = self.engine.generate(prompts, 1, seed)
            self.generate_calls += 1
            texts = [c.text for c in sorted(completions, key=lambda c: c.prompt_index)]
            # Whether the chat opened <think> for the judge: the template's doing, alike for every call.
            prefilled = opens_think(render_chat(self.processor, prompts[0], think_prefix=self.model_cfg.think_prefix))
        out, start = [], 0
        for g, index, k, shown in plans:
            points = [
                verdict_points(cfg.protocol, read_verdict(cfg.protocol, cfg.style, k, text, prefilled), k)
                for text in texts[start : start + len(shown)]
            ]
            start += len(shown)
            consistent, judged = position_consistency(shown, points)
            distinct = group_rewards(cfg.protocol, cfg.aggregate, len(g.answers), shown, points)
            out.append(
                GroupVerdict(
                    rewards=tuple(distinct[i] for i in index),
                    calls=len(shown),
                    unreadable=sum(p is None for p in points),
                    subsets_judged=judged,
                    subsets_consistent=consistent,
                )
            )
        return out

    def judge_timed(self, groups: list[AnswerGroup], seed: int) -> Timed[list[GroupVerdict]]:
        """`judge`, with the seconds it took in this worker."""
        return Timed.measure(self.judge, groups, seed)

    def engine_calls(self) -> int:
        """How many times `judge` has called the engine's generate."""
        return self.generate_calls

    def ready(self) -> bool:
        return True

    def peak_memory(self) -> dict[str, float]:
        """This process's peak host and GPU memory in MiB (`pjray.memory`)."""
        return peak_memory_mib()
