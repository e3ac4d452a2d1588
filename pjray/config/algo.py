"""`algo.*`: GRPO's advantages and loss, rollout correction, zero-std filters, image contrast."""

from __future__ import annotations

from dataclasses import dataclass

from pjray.config.fields import ConfigError, opt


@dataclass(frozen=True)
class AlgoConfig:
    group_size: int = opt(8, ge=2, why="GRPO needs at least 2 responses per prompt")  # n responses per prompt
    norm_adv_by_std: bool = True  # False: Dr.GRPO (mean only)
    adv_eps: float = opt(1e-6, ge=0)
    clip_low: float = opt(0.2, ge=0)
    clip_high: float = opt(0.2, ge=0)
    dual_clip: float = 3.0  # 0 disables; else > 1
    kl_coef: float = opt(0.01, ge=0)  # k3 ("low_var_kl") in the loss; 0 disables and drops the reference model
    loss_agg: str = opt("token-mean", choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
    # grpo: a ratio per token (PPO clip, dual clip). gspo: one length-normalised ratio a sequence,
    # clipped per sequence (GSPO, arXiv 2507.18071; it needs loss_agg=seq-mean-token-mean, and the
    # paper's clip ranges are ~3e-4 / 4e-4 where GRPO's are 0.2).
    policy_loss: str = opt("grpo", choices=("grpo", "gspo"))
    # Rollout correction, for samples of an engine that is not the learner (rollout workers: HF
    # or vLLM, split or colocated): importance weights old policy / engine, per token or per
    # sequence, multiply the policy loss; truncated at rollout_is_upper (TIS), or with
    # rollout_is_lower set, 0 outside [lower, upper] (IcePop). none: no correction. auto: token
    # (TIS) wherever rollout workers sample, none for the hybrid engine, which samples with the
    # learner's own weights (resolved by `validate`: the loaded config and config.json say which).
    rollout_is: str = opt("auto", choices=("auto", "none", "token", "sequence"))
    rollout_is_upper: float = opt(2.0, gt=0)
    rollout_is_lower: float | None = None
    # Drop groups whose rewards all equal (zero advantage) and refill with fresh prompts.
    filter_zero_std: bool = False
    max_refill_rounds: int = opt(2, ge=0)
    # Before step 1, sample each training item's group once with the initial policy and leave out
    # the items whose responses all earn one reward (prefiltered_items.jsonl in the run dir):
    # the offline twin of filter_zero_std, so the steps and the reward curve are spent on what
    # the judge does not yet do. Costs one pass of generation over the training set.
    prefilter_zero_std: bool = True
    # Image contrast (pjray.reward.contrast), for any data with images: each group's prompt is
    # also sampled contrast_responses times on another image (other: the image of another prompt
    # of the step; blank: the scene without its object, scene data only). Those responses are
    # scored, not trained on. A trained response earns image_contrast x the fraction of them
    # whose top choice differs from its own, when its own top choice is the target's: credit
    # for a right verdict the prompt's text alone does not give. 0 responses: off.
    contrast_responses: int = opt(0, ge=0)
    contrast_image: str = opt("other", choices=("other", "blank"))
    image_contrast: float = opt(0.5, ge=0)
    # Optimizer steps per training step: the batch is split into this many mini-batches, each
    # seen `ppo_epochs` times. 1 and 1 is on-policy GRPO (old logprobs = current, no extra pass).
    ppo_mini_batches: int = opt(1, gt=0)
    ppo_epochs: int = opt(1, gt=0)

    def check(self) -> None:
        """dual_clip (its one check: 0 or > 1, which a range cannot say), GSPO's aggregation, the
        IcePop band. Runs after `validate` resolved rollout_is=auto."""
        if self.dual_clip != 0 and not self.dual_clip > 1:
            raise ConfigError(f"algo.dual_clip={self.dual_clip}: must be > 1 (or 0 to disable)")
        if self.policy_loss == "gspo" and self.loss_agg != "seq-mean-token-mean":
            raise ConfigError(
                f"algo.policy_loss=gspo: GSPO averages its sequences' losses; set algo.loss_agg=seq-mean-token-mean "
                f"(not {self.loss_agg})"
            )
        lower = self.rollout_is_lower
        if self.rollout_is != "none" and lower is not None and not 0 <= lower < self.rollout_is_upper:
            raise ConfigError(
                f"algo.rollout_is_lower={lower}: must be in [0, algo.rollout_is_upper={self.rollout_is_upper})"
            )
