"""`reward.*`: how a response is scored (the judge reward, or a custom function)."""

from __future__ import annotations

from dataclasses import dataclass

from pjray.config.fields import ConfigError, opt


@dataclass(frozen=True)
class RewardConfig:
    # "module:function" of a custom `(response_text, target) -> float` reward used instead of
    # the judge reward (verl's custom_reward_function); empty: format x ranking.
    function: str = ""
    # levenshtein (the paper) | kendall (the released code: a right first place still pays when
    # the other two swap)
    metric: str = opt("kendall", choices=("levenshtein", "kendall"))
    # ranking (letters best -> worst) | scores (one 1-10 score each)
    style: str = opt("ranking", choices=("ranking", "scores"))
    num_workers: int = opt(1, gt=0)
    num_cpus_per_worker: float = opt(0.25, ge=0)
    # false: a response cut by rollout.max_new_tokens gets no format credit (judge reward 0), so
    # a verdict followed by filler up to the limit is never reinforced. true: read it as it is.
    score_truncated: bool = False
    # DAPO's soft overlong penalty, added to every reward: 0 up to rollout.max_new_tokens -
    # overlong_buffer response tokens, then falling linearly to -overlong_penalty at the limit.
    overlong_buffer: int = opt(0, ge=0)  # 0 disables
    overlong_penalty: float = opt(1.0, ge=0)
    # A control: each training prompt's ranking target replaced by a permutation of its letters
    # drawn per prompt (pjray.reward.ranking.shuffled_target), so the reward pays for nothing the
    # image or the texts show. Evaluation targets are untouched.
    shuffle_target: bool = False

    def check(self) -> None:
        if self.function and ":" not in self.function:
            raise ConfigError(f"reward.function={self.function!r}: expected module:function")
