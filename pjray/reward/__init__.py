"""Judge rewards: parse a response, then score its verdict against the target.

`judge_reward` is the batch-ranking reward used for GRPO: total = format x ranking, where format
is 1.0 only for a well-formed response (see `parse.py`) and ranking is a similarity between the
predicted and the target ranking strings in [0, 1].
"""

from __future__ import annotations

from collections.abc import Callable

from pjray.reward.parse import parse_judgment, parse_pair, parse_score, ranking_from_scores
from pjray.reward.ranking import (
    kendall_reward,
    levenshtein_distance,
    levenshtein_reward,
    normalized_levenshtein,
    pair_reward,
    score_reward,
)
from pjray.types import RewardResult

RANKING_METRICS: dict[str, Callable[[str, str], float]] = {
    "levenshtein": levenshtein_reward,  # the paper's R_Batch
    "kendall": kendall_reward,  # the released code's reward
}


def judge_reward(
    text: str,
    target: str,
    metric: str = "levenshtein",
    style: str = "ranking",
    think_prefilled: bool = False,
    truncated: bool = False,
) -> RewardResult:
    """Batch-ranking reward of one response against `target` (letters best -> worst, e.g. "BCA").

    metric: "levenshtein" or "kendall". The ranking part is computed whenever a ranking could be
    read, even from a badly formatted response (useful for logging); `total` is 0 then.
    truncated: the response was cut by the token limit; it gets no format credit (total 0).
    """
    score_fn = RANKING_METRICS.get(metric)
    if score_fn is None:
        raise ValueError(f"unknown ranking metric {metric!r}; expected one of {sorted(RANKING_METRICS)}")
    judgment = parse_judgment(text, len(target), style=style, think_prefilled=think_prefilled)
    problems = ["cut at the token limit"] if truncated else []
    if judgment.reason:
        problems.append(judgment.reason)
    fmt = 1.0 if judgment.format_ok and not truncated else 0.0
    ranking = score_fn(judgment.ranking, target) if judgment.ranking is not None else 0.0
    return RewardResult(
        total=fmt * ranking,
        format=fmt,
        ranking=ranking,
        pred=judgment.ranking,
        reason="; ".join(problems),
    )


__all__ = [
    "RANKING_METRICS",
    "judge_reward",
    "kendall_reward",
    "levenshtein_distance",
    "levenshtein_reward",
    "normalized_levenshtein",
    "pair_reward",
    "parse_judgment",
    "parse_pair",
    "parse_score",
    "ranking_from_scores",
    "score_reward",
]
