"""`learner.*`: the DeepSpeed ranks that train the policy (ZeRO, offload, micro-batches)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pjray.config.fields import ConfigError, check_resources, opt

# The DeepSpeed batch keys pjray sets from learner.micro_batch_size and the step's batch.
_BATCH_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}


@dataclass(frozen=True)
class LearnerConfig:
    num_ranks: int = opt(1, gt=0)
    num_cpus_per_rank: float = opt(0.5, ge=0)
    num_gpus_per_rank: float = opt(0.0, ge=0)
    # Custom Ray resources each rank's bundle asks for (see rollout.resources).
    resources: dict[str, float] = field(default_factory=dict)
    # torch intra-op threads per rank; 0: the node's CPUs over its ranks (see rollout.num_threads)
    num_threads: int = opt(0, ge=0)
    # 3: parameters partitioned too, from the load on (no rank ever holds the whole model)
    zero_stage: int = opt(2, choices=(0, 1, 2, 3))
    # the CPU default's 2.2M-parameter base judge (3e-4 broke its checks, 1e-4 lowered the taught
    # ones with the prefilter; benchmarks/results/README.md); GPU recipes ~1e-6
    lr: float = opt(5e-5, ge=0)
    weight_decay: float = opt(0.0, ge=0)
    warmup_steps: int = opt(0, ge=0)
    lr_schedule: str = opt("constant", choices=("constant", "cosine"))
    min_lr_ratio: float = opt(0.0, ge=0)  # cosine floor as a fraction of lr
    grad_clip: float = opt(1.0, ge=0)
    micro_batch_size: int = opt(16, gt=0)  # sequences per forward/backward on one rank
    # > 0: cut each rank's sequences into micro-batches of at most this many forwarded tokens
    # (prompt, image and response; packed: their sum, else rows x the longest), balanced, as many
    # on every rank (`pjray.rl.microbatch`), in place of micro_batch_size sequences each. One
    # sequence longer than the budget runs alone.
    micro_batch_tokens: int = opt(0, ge=0)
    # Forward a micro-batch's sequences end to end without padding, each attending only to
    # itself, where no prompt is shared: the same log-probs and gradients as padded rows. With
    # model.attn_implementation=flash_attention_2 (variable-length kernels) it saves the padding's
    # compute; under sdpa or eager attention goes through an [N, N] block mask over the packed N
    # tokens, more work than padded rows when many are packed (benchmarks/bench_packing.py).
    packing: bool = False
    # Forward a prompt that several sequences of a micro-batch share (a GRPO group's samples)
    # once, its keys and values reused by each response: same log-probs, a fraction of the compute.
    shared_prefix: bool = True
    # Response positions projected through the output embedding at once for log-probs and
    # entropies: one [chunk, vocab] block of logits at a time (recomputed in backward), never
    # [tokens, vocab]. Lower it for long responses on a large vocabulary.
    logit_chunk_tokens: int = opt(1024, gt=0)
    # DeepSpeed ZeRO-Offload to CPU memory, for a judge whose training state does not fit its
    # GPUs: the optimizer states (zero_stage >= 1), or with `all` the parameters too (zero_stage
    # 3). The optimizer is then DeepSpeed's CPU Adam (a C++ op compiled on first use). GPU ranks only.
    offload: str = opt("none", choices=("none", "optimizer", "all"))
    # Colocated GPUs: move the optimizer's states (fp32 master weights, Adam moments, gradient
    # buffers; ~16 bytes a trainable parameter / num_ranks under ZeRO) to pinned CPU memory while
    # the engines generate, and back before the update or a checkpoint (DeepSpeed's
    # offload_states; the bf16 weights stay). Under ZeRO-3 the optimizer is DeepSpeed's FusedAdam
    # (a CUDA op it builds on first use), the only one whose states ZeRO-3 moves.
    offload_during_generation: bool = False
    # The KL term's reference model partitioned over the ranks as a ZeRO-3 inference engine (its
    # layers gathered as its forward reaches them) where the policy is not ZeRO-3 (under ZeRO-3
    # it always is): 2 bytes a parameter / num_ranks on each GPU instead of a full bf16 copy.
    shard_reference: bool = False
    # Merged last into the policy's DeepSpeed config (e.g. {zero_optimization:
    # {reduce_bucket_size: 5e8}}); the batch sizes are pjray's (learner.micro_batch_size and the
    # step's accumulation) and cannot be set here.
    ds_config: dict[str, Any] = field(default_factory=dict)
    bf16: bool = False
    master_port: int = 0  # 0: pick a free port

    def check(self) -> None:
        """ZeRO-Offload and its stages, the DeepSpeed keys pjray owns, the ranks' resources."""
        if self.offload != "none" and self.num_gpus_per_rank == 0:
            raise ConfigError(
                f"learner.offload={self.offload}: the ranks run on CPU (learner.num_gpus_per_rank=0), "
                "where their state is in CPU memory already"
            )
        if self.offload == "optimizer" and self.zero_stage == 0:
            raise ConfigError("learner.offload=optimizer: ZeRO-Offload needs learner.zero_stage >= 1")
        if self.offload == "all" and self.zero_stage != 3:
            raise ConfigError(
                f"learner.offload=all: offloading parameters needs learner.zero_stage=3, not {self.zero_stage}"
            )
        if self.offload_during_generation and self.offload != "none":
            raise ConfigError(
                f"learner.offload_during_generation: the states live in CPU memory already (learner.offload={self.offload})"
            )
        owned = sorted(set(self.ds_config) & _BATCH_KEYS)
        if owned:
            raise ConfigError(f"learner.ds_config: {owned} are set from learner.micro_batch_size and the step's batch")
        check_resources("learner", self.resources)
