"""`reward.*`: how a response is scored: a judge's by format x ranking (or a custom function); a
policy's answer by a rule, a judge (`reward.judge.*`), or both."""

from __future__ import annotations

from dataclasses import dataclass, field

from pjray.config.fields import ConfigError, check_resources, opt


@dataclass(frozen=True)
class JudgeRewardConfig:
    """A frozen judge that ranks a policy's answers (task.kind=policy, reward.source judge or mix):
    its engines run in judge reward workers of their own (pjray.rollout.judge_worker)."""

    # The judge: an HF directory, a hub id, or "shipped" (the base judge pjray ships,
    # pjray/assets/base_judge); a pjray export is a run's <run_dir>/hf_model.
    model: str = "shipped"
    engine: str = opt("hf", choices=("hf", "vllm"))
    # ranking (the paper's batch ranking of K answers) | pair (two answers, both orders) | score
    # (each answer alone): how a group's answers become rewards (pjray.reward.judging).
    protocol: str = opt("ranking", choices=("ranking", "pair", "score"))
    style: str = opt("ranking", choices=("ranking", "scores"))  # the judge's answer style
    num_candidates: int = opt(3, ge=2, le=10)  # K of the ranking protocol: the shipped judge ranks 3
    # Random partitions of a group into K-subsets (each subset judged under all K rotations of
    # its letters); score: times each answer is scored.
    rounds: int = opt(1, gt=0)
    # ranking: borda (mean normalised rank) | plackett_luce (a fit's strengths); pair is
    # always Bradley-Terry.
    aggregate: str = opt("borda", choices=("borda", "plackett_luce"))
    # A control: each group's judge rewards permuted within the group (drawn per group), so the
    # reward keeps the judge's distribution and pays for nothing the answers say.
    shuffle_rewards: bool = False
    # Judge prompts a training step may send (0: no cap); a design that needs more fails at load.
    max_calls_per_step: int = opt(0, ge=0)
    think_prefix: bool = True  # the judge's responses start inside <think> (model.think_prefix)
    max_new_tokens: int = opt(64, gt=0)
    temperature: float = opt(1.0, gt=0)
    num_workers: int = opt(1, gt=0)
    num_cpus_per_worker: float = opt(1.0, ge=0)
    num_gpus_per_worker: float = opt(0.0, ge=0)
    resources: dict[str, float] = field(default_factory=dict)
    # Judge worker i shares rollout worker i's bundle (GPU): a 7B judge beside a 7B policy's
    # engine on one node (both with vLLM: their gpu_memory_utilization sum below 1).
    colocate: bool = False
    tensor_parallel_size: int = opt(1, gt=0)
    gpu_memory_utilization: float = opt(0.3, gt=0, le=1)
    max_model_len: int = opt(4096, gt=0)

    def check(self) -> None:
        check_resources("reward.judge", self.resources)
        if self.engine == "hf" and self.tensor_parallel_size != 1:
            raise ConfigError("reward.judge.tensor_parallel_size: only the vllm engine shards the model")
        if self.protocol == "score" and self.style != "ranking":
            raise ConfigError("reward.judge.style: the score protocol has one style (leave it at ranking)")
        if self.protocol != "ranking" and self.aggregate != "borda":
            raise ConfigError(
                f"reward.judge.aggregate={self.aggregate}: only the ranking protocol fits Plackett-Luce "
                "(pair is Bradley-Terry, score a mean)"
            )

    @property
    def subset_size(self) -> int:
        """Answers a judge call shows: K, 2 or 1 by protocol."""
        return {"ranking": self.num_candidates, "pair": 2, "score": 1}[self.protocol]

    def calls_per_group(self, group_size: int) -> int:
        """Judge prompts one group of `group_size` answers needs (pjray.reward.judging)."""
        k = self.subset_size
        return self.rounds * -(-group_size // k) * k  # rounds x ceil(G / K) subsets x K rotations


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
    # task.kind=policy: how an answer is rewarded. rule: against its reference (scenes: also its
    # stated facts against the scene); judge: by reward.judge; mix: (1 - judge_weight) x rule +
    # judge_weight x judge. The format check (a final answer, not cut) multiplies each.
    source: str = opt("rule", choices=("rule", "judge", "mix"))
    judge_weight: float = opt(0.5, ge=0, le=1)
    judge: JudgeRewardConfig = field(default_factory=JudgeRewardConfig)

    def check(self) -> None:
        self.judge.check()
        if self.function and ":" not in self.function:
            raise ConfigError(f"reward.function={self.function!r}: expected module:function")
