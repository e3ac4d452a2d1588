"""RewardWorker: a CPU actor that scores responses with the pure reward functions: a judge's
verdicts (`score`), a policy's answers by the rule (`score_answers`)."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from pjray.config import RewardConfig
from pjray.memory import peak_memory_mib
from pjray.reward import judge_reward
from pjray.reward.answer import answer_reward
from pjray.types import Completion, Question, RewardResult, Timed


def load_function(spec: str) -> Callable[[str, str], float]:
    """Import "module:function"; errors name the spec."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward.function={spec!r}: {err}") from None
    if not callable(fn):
        raise ValueError(f"reward.function={spec!r}: not callable")
    return fn


def overlong_penalty(num_tokens: int, max_tokens: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment, scaled by `factor` (<= 0; 0 when `buffer` is 0).

    0 up to `max_tokens - buffer` tokens, then falling linearly to -factor at `max_tokens`
    (and -factor beyond), so responses that run into the limit lose reward gradually.
    """
    if buffer <= 0:
        return 0.0
    expected = max_tokens - buffer
    if num_tokens <= expected:
        return 0.0
    return -factor * min(1.0, (num_tokens - expected) / buffer)


class RewardWorker:
    """Scores completions against their prompt's target. Plain class: `ray.remote` is applied
    where the pool is launched, so tests can build it directly.

    Args:
        cfg: the reward section.
        max_new_tokens: the rollout's response limit (the overlong penalty's L_max).
    """

    def __init__(self, cfg: RewardConfig, max_new_tokens: int):
        self.cfg = cfg
        self.max_new_tokens = max_new_tokens
        self.custom = load_function(cfg.function) if cfg.function else None

    def score(
        self, completions: list[Completion], targets: list[str], think_prefilled: list[bool]
    ) -> list[RewardResult]:
        """`targets[i]` is the verdict `completions[i]` should give (its prompt's target);
        `think_prefilled[i]` says whether its prompt already opened `<think>` (`opens_think`).

        A response cut by the token limit (finish reason "length") gets no format credit unless
        reward.score_truncated: its verdict may be followed by text it never finished. A custom
        reward function gets the text as it is. The overlong penalty applies to both.
        """
        if not len(completions) == len(targets) == len(think_prefilled):
            raise ValueError(
                f"{len(completions)} completions, {len(targets)} targets, {len(think_prefilled)} think_prefilled"
            )
        results = []
        for completion, target, prefilled in zip(completions, targets, think_prefilled):
            if completion.finish_reason not in ("stop", "length"):
                raise ValueError(f"finish_reason {completion.finish_reason!r}: expected stop or length")
            if self.custom is not None:
                value = float(self.custom(completion.text, target))
                result = RewardResult(total=value, format=1.0, ranking=value, pred=None, reason="")
            else:
                result = judge_reward(
                    completion.text,
                    target,
                    metric=self.cfg.metric,
                    style=self.cfg.style,
                    think_prefilled=prefilled,
                    truncated=completion.finish_reason == "length" and not self.cfg.score_truncated,
                )
            results.append(self.penalised(result, completion))
        return results

    def penalised(self, result: RewardResult, completion: Completion) -> RewardResult:
        """`result` with the overlong penalty of `completion` added to its total."""
        penalty = overlong_penalty(
            len(completion.token_ids), self.max_new_tokens, self.cfg.overlong_buffer, self.cfg.overlong_penalty
        )
        return dataclasses.replace(result, total=result.total + penalty) if penalty else result

    def score_answers(self, completions: list[Completion], rows: list[Question]) -> list[RewardResult]:
        """A policy's answers by the rule (`pjray.reward.answer.answer_reward`): `rows[i]` is the
        question `completions[i]` answers. A response cut at the token limit gets no format
        credit unless reward.score_truncated; the overlong penalty applies."""
        if len(completions) != len(rows):
            raise ValueError(f"{len(completions)} completions, {len(rows)} rows")
        return [
            self.penalised(
                answer_reward(
                    c.text,
                    row.reference,
                    row.scene,
                    truncated=c.finish_reason == "length" and not self.cfg.score_truncated,
                ),
                c,
            )
            for c, row in zip(completions, rows)
        ]

    def score_answers_timed(self, completions: list[Completion], rows: list[Question]) -> Timed[list[RewardResult]]:
        """`score_answers`, with the seconds it took in this worker."""
        return Timed.measure(self.score_answers, completions, rows)

    def score_timed(
        self, completions: list[Completion], targets: list[str], think_prefilled: list[bool]
    ) -> Timed[list[RewardResult]]:
        """`score`, with the seconds it took in this worker."""
        return Timed.measure(self.score, completions, targets, think_prefilled)

    def ready(self) -> bool:
        return True

    def peak_memory(self) -> dict[str, float]:
        """This process's peak host and GPU memory in MiB (`pjray.memory`)."""
        return peak_memory_mib()
