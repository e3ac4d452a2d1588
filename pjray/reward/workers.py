"""RewardWorker: a CPU actor that scores judge responses with the pure reward functions."""

from __future__ import annotations

import importlib
from typing import Callable

from pjray.config import RewardConfig
from pjray.reward import judge_reward
from pjray.types import Completion, RewardResult, Timed


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


def length_penalty(num_tokens: int, cfg: RewardConfig) -> float:
    """Linear penalty per token beyond `length_penalty_from` (0 when disabled)."""
    return cfg.length_penalty * max(0, num_tokens - cfg.length_penalty_from)


class RewardWorker:
    """Scores completions against their prompt's target. Plain class: `ray.remote` is applied
    where the pool is launched, so tests can build it directly."""

    def __init__(self, cfg: RewardConfig, think_prefilled: bool):
        self.cfg = cfg
        # The rollout prompt may end in "<think>\n", so responses lack the opening tag.
        self.think_prefilled = think_prefilled
        self.custom = load_function(cfg.function) if cfg.function else None

    def score(self, completions: list[Completion], targets: list[str]) -> list[RewardResult]:
        """`targets[i]` is the verdict `completions[i]` should give (its prompt's target)."""
        if len(completions) != len(targets):
            raise ValueError(f"{len(completions)} completions but {len(targets)} targets")
        results = []
        for completion, target in zip(completions, targets):
            if self.custom is not None:
                value = float(self.custom(completion.text, target))
                result = RewardResult(total=value, format=1.0, ranking=value, pred=None, reason="")
            else:
                result = judge_reward(
                    completion.text,
                    target,
                    metric=self.cfg.metric,
                    style=self.cfg.style,
                    think_prefilled=self.think_prefilled,
                )
            penalty = length_penalty(len(completion.token_ids), self.cfg)
            if penalty:
                result = RewardResult(
                    total=result.total - penalty,
                    format=result.format,
                    ranking=result.ranking,
                    pred=result.pred,
                    reason=result.reason,
                )
            results.append(result)
        return results

    def score_timed(self, completions: list[Completion], targets: list[str]) -> Timed[list[RewardResult]]:
        """`score`, with the seconds it took in this worker."""
        return Timed.measure(self.score, completions, targets)

    def ready(self) -> bool:
        return True
