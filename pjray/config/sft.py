"""`sft.*`: supervised fine-tuning of a judge (`pjray sft`, the warm start for GRPO)."""

from __future__ import annotations

from dataclasses import dataclass

from pjray.config.fields import ConfigError, opt


@dataclass(frozen=True)
class SFTConfig:
    """`pjray sft`: supervised fine-tuning of a judge on chat examples (the warm start for GRPO).

    Runs on the GRPO learner (DeepSpeed ranks in a Ray placement group, `learner.*`: ranks, ZeRO
    stage, micro-batch, bf16) with its own data, length and learning rate below; writes
    `trainer.run_dir` like `pjray train` (metrics.jsonl, checkpoints, hf_model)."""

    # base_judge: the scene mixture of the base judge recipe (pjray.models.base_judge) |
    # jsonl | parquet: chat examples with system, user, response and an optional image
    source: str = opt("base_judge", choices=("base_judge", "jsonl", "parquet"))
    path: str = ""  # jsonl/parquet file of chat examples
    num_scenes: int = opt(6000, gt=0)  # base_judge: scenes in the mixture (4 examples each)
    steps: int = opt(700, gt=0)
    batch_size: int = opt(16, gt=0)  # examples per optimizer step over all ranks
    lr: float = opt(2e-3, gt=0)
    warmup_steps: int = 30
    lr_schedule: str = opt("cosine", choices=("constant", "cosine"))
    save_every: int = 0  # 0: only at the end

    def check(self) -> None:
        if self.source in ("jsonl", "parquet") and not self.path:
            raise ConfigError(f"sft.path: required when sft.source={self.source}")
        if self.source == "base_judge" and self.path:
            raise ConfigError("sft.path: only read when sft.source is jsonl or parquet")
