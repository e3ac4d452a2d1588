"""The GRPO learner: one DeepSpeed data-parallel rank of the judge, run as one Ray actor.

`LearnerRank` is a plain class; the driver launches `num_ranks` of them inside a placement group
with `ray.remote(num_cpus=..., num_gpus=...)(LearnerRank)`, and tests build one directly. Every
public method is called on ALL ranks with equal-length shards: under ZeRO-3 each forward gathers
parameters collectively, so a rank that skipped a forward (or exited early) would hang the rest.

One `train_step` is one optimizer step over this rank's shard of a mini-batch. The shard is cut
into `grad_accum_steps` micro-batches; each is backpropagated without DeepSpeed's 1/GAS scaling,
because `grpo_loss` already divides by the global token (or sequence) count and multiplies by
the data-parallel size: summing micro-batches on a rank and averaging over ranks (DeepSpeed's
gradient all-reduce) gives exactly the gradient of the full-batch loss, however it was split.

Conventions shared with the driver:

* `Experience.old_logprobs is None` means on-policy: the ratio's denominator is the current
  policy's detached log-prob (ratio 1). `ref_logprobs` must be set whenever `algo.kl_coef > 0`
  (the driver fills them with `compute_logprobs(..., "ref")`).
* A padding ("dummy") experience has an empty `response_ids`: it is still forwarded (so ZeRO-3
  ranks stay in step) but has no response tokens, hence no loss, no gradient and no count.
* Every log-prob (current, old, reference) and the entropy are of the distribution the
  responses were sampled from: the logits divided by the rollout's temperature, the placeholder
  ids banned, its top-k and top-p applied (the sampled token always kept in).
* Weight sync to the rollout engines and checksums are `pjray.sync.sender.WeightSender`'s methods,
  mixed into the rank; exported weights carry the HF model's own parameter names. The HF export
  and DeepSpeed checkpoints are `pjray.rl.checkpoint.RankCheckpoints`'s, mixed in the same way.
* The batch layout and the log-prob forward are pure functions (`pjray.rl.logprobs`); the
  DeepSpeed config, optimizer and learning-rate schedule too (`pjray.rl.ds_setup`). This file
  holds the rank itself: set-up, forwards, generation, the GRPO and SFT steps.
* The hybrid engine (`rollout.backend=hybrid`): a rank built with a `rollout_cfg` also serves
  the rollout interface (`generate` / `generate_timed`), sampling with the very module it
  trains through `HFEngine.around`, so there is no second copy of the weights and no sync.
  Under ZeRO-3 the partitioned weights are gathered for generation all at once
  (`rollout.hybrid_gather=full`: `deepspeed.zero.GatheredParameters`, the fastest, peak memory
  of one full copy) or module by module as each forward needs them (`layer`: HF's
  `synced_gpus`, every rank stepping until all are done, peak memory of one layer). Either
  way every rank must be called, each with at least one prompt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from pjray.config import AlgoConfig, LearnerConfig, ModelConfig, RolloutConfig
from pjray.console import quiet_actor_warnings
from pjray.memory import peak_memory_mib
from pjray.models.loading import load_judge, placeholder_ids
from pjray.models.lora import apply_lora, base_model
from pjray.placement import split_evenly
from pjray.rl.checkpoint import RankCheckpoints
from pjray.rl.ds_ops import skip_unused_ops
from pjray.rl.ds_setup import ds_config, lr_multiplier, optimizer, ref_ds_config, vision_tower
from pjray.rl.grpo import LossSettings, grpo_loss, rollout_is_metrics, rollout_is_weights, sft_loss
from pjray.rl.logprobs import can_share_prefix, collate, forward_logprobs, forwarded_positions, take_rows
from pjray.rl.microbatch import token_budget_batches
from pjray.rollout.hf_engine import HFEngine
from pjray.sync.sender import WeightSender
from pjray.types import Completion, Experience, JudgePrompt, Timed, TrainBatch

__all__ = ["LearnerRank", "collate", "forward_logprobs", "forwarded_positions", "lr_multiplier"]


# ---------------------------------------------------------------------------------------------
# What a training step adds up
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class StepSums:
    """What the micro-batches of one optimizer step add up on a rank, reduced across ranks field
    by field (`reduced`): the maxima in `MAXED` by max, every other field by sum."""

    MAXED: ClassVar[tuple[str, ...]] = ("logprob_diff_max", "is_raw_max")

    pg_loss: float = 0.0  # each rank's share x dp_size (grpo.aggregate): averaged over ranks
    kl_loss: float = 0.0
    tokens: float = 0.0  # response tokens
    seqs: float = 0.0  # sequences with a response token
    entropy: float = 0.0  # summed over response tokens (a token mean at the end), as the next three
    pg_clipfrac: float = 0.0
    pg_clipfrac_lower: float = 0.0
    ppo_kl: float = 0.0
    logprob_diff: float = 0.0  # |old policy - rollout engine| over the tokens that have both
    logprob_diff_tokens: float = 0.0
    padding_positions: float = 0.0  # forwarded positions that were padding, of all `positions`
    positions: float = 0.0
    is_units: float = 0.0  # the rollout-correction sums of grpo.rollout_is_weights
    is_total: float = 0.0
    is_squares: float = 0.0
    is_outside: float = 0.0
    logprob_diff_max: float = 0.0
    is_raw_max: float = 0.0  # the largest raw importance weight

    def add(self, other: StepSums) -> None:
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(mine, theirs) if f.name in self.MAXED else mine + theirs)

    def reduced(self, all_reduce: Callable[[torch.Tensor, Any], None], device: Any) -> StepSums:
        """These sums over every rank: `all_reduce(tensor, op)` (torch.distributed's) on one
        float64 tensor of the summed fields and one of the maxima, read back by name."""
        names = [f.name for f in dataclasses.fields(self)]
        summed = [n for n in names if n not in self.MAXED]
        out = StepSums()
        for group, op in ((summed, torch.distributed.ReduceOp.SUM), (list(self.MAXED), torch.distributed.ReduceOp.MAX)):
            values = torch.tensor([getattr(self, n) for n in group], dtype=torch.float64, device=device)
            all_reduce(values, op)
            for n, v in zip(group, values.cpu().tolist()):
                setattr(out, n, v)
        return out

    def metrics(self, world_size: int, grad_norm: float, lr: float) -> dict[str, float]:
        """The step's metrics (`LearnerRank.train_step`) from the sums over every rank."""
        tokens = max(self.tokens, 1.0)
        is_sums = torch.tensor([self.is_units, self.is_total, self.is_squares, self.is_outside], dtype=torch.float64)
        rollout = rollout_is_metrics(is_sums, self.is_raw_max)
        if self.logprob_diff_tokens > 0:
            rollout["rollout/logprob_diff_mean"] = self.logprob_diff / self.logprob_diff_tokens
            rollout["rollout/logprob_diff_max"] = self.logprob_diff_max
        return {
            # Each rank's sum is its share times dp_size (see grpo.aggregate): average ranks.
            "actor/pg_loss": self.pg_loss / world_size,
            "actor/kl_loss": self.kl_loss / world_size,
            "actor/entropy": self.entropy / tokens,
            "actor/pg_clipfrac": self.pg_clipfrac / tokens,
            "actor/pg_clipfrac_lower": self.pg_clipfrac_lower / tokens,
            "actor/ppo_kl": self.ppo_kl / tokens,
            "actor/grad_norm": grad_norm,
            "actor/lr": lr,
            "actor/num_tokens": self.tokens,
            "actor/num_seqs": self.seqs,
            # Share of the forwarded positions that were padding (rows padded to the longest; with
            # a shared prefix, prompts to the longest prompt and responses to the longest response).
            "perf/padding_fraction": self.padding_positions / max(self.positions, 1.0),
            **rollout,
        }


# ---------------------------------------------------------------------------------------------
# The rank
# ---------------------------------------------------------------------------------------------


class LearnerRank(WeightSender, RankCheckpoints):
    """One DeepSpeed rank of the policy (and, when the KL term is on, of the reference model).

    Args:
        model_cfg, learner_cfg, algo_cfg: the run's config sections, as `pjray.config.load` resolved
            them (algo.rollout_is none, token or sequence).
        model_path: HF directory of the initial judge (every rank loads it).
        rank, world_size: this rank and the data-parallel size.
        master_addr, master_port: rendezvous of the process group (rank 0's node, a free port).
        total_steps: optimizer steps of the whole run (the cosine schedule's length).
        grad_accum_steps: micro-batches per optimizer step on each rank, normally
            prompts_per_step * group_size / (ppo_mini_batches * num_ranks * micro_batch_size);
            with `learner.micro_batch_tokens` the token budget decides the count, step by step.
        norm_len: the constant length of the "seq-mean-token-sum-norm" aggregation (the
            configured max response length); None uses the padded micro-batch length.
        temperature, top_k, top_p: the rollout's sampling (rollout.temperature, top_k, top_p);
            every log-prob and the entropy are of the distribution the engines draw from:
            logits / temperature, placeholders banned, top-k then top-p (`truncate_logits`).
        ds_config_overrides: merged last into the DeepSpeed config (e.g. ZeRO-3 bucket sizes).
        num_threads: torch intra-op threads of this rank; 0 leaves the process's setting.
        rollout_cfg: given, the rank also generates (the hybrid engine, see the module docstring).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        learner_cfg: LearnerConfig,
        algo_cfg: AlgoConfig,
        model_path: str,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        total_steps: int,
        grad_accum_steps: int,
        norm_len: int | None = None,
        ds_config_overrides: dict[str, Any] | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        num_threads: int = 0,
        rollout_cfg: RolloutConfig | None = None,
    ) -> None:
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        quiet_actor_warnings()
        self.temperature = temperature
        self.top_k, self.top_p = top_k, top_p
        self.model_cfg, self.learner_cfg, self.algo_cfg = model_cfg, learner_cfg, algo_cfg
        self.rank, self.world_size = rank, world_size
        self.grad_accum_steps = grad_accum_steps
        self.norm_len = norm_len
        use_cuda = torch.cuda.is_available()

        # Per-rank rendezvous variables are ours to set; tuning variables the user (or
        # `ray job submit --runtime-env-json`) exported win.
        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
            WORLD_SIZE=str(world_size),
            # Ray gives each rank actor its own accelerator(s), so the local index is 0.
            LOCAL_RANK="0",
        )  # fmt: skip
        if not use_cuda:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if num_threads:
            torch.set_num_threads(num_threads)
        # Imported after the environment is set: DeepSpeed picks its accelerator on import.
        import deepspeed

        self._ds = deepspeed
        if use_cuda:
            torch.cuda.set_device(0)  # before NCCL binds its communicator to a device
            self.device = torch.device("cuda", 0)
        else:
            self.device = torch.device("cpu")
        skip_unused_ops()  # nothing is JIT-compiled at start-up (see ds_ops)
        deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo", auto_mpi_discovery=False)

        self.zero3 = learner_cfg.zero_stage == 3
        config = ds_config(learner_cfg, grad_accum_steps, world_size, ds_config_overrides or {})
        budget = model_cfg.image_budget
        attention = model_cfg.attn_implementation
        model, self.processor = load_judge(
            model_path, dtype=model_cfg.dtype, device=self.device, trainable=True, attn_implementation=attention, budget=budget
        )
        # The distribution the engines sample from has no placeholder tokens; the log-probs here
        # are of that same distribution.
        self.banned = placeholder_ids(self.processor)
        # A text-only judge has no vision tower, so there is nothing for freeze_vision to freeze.
        if model_cfg.freeze_vision and self.processor.image_token_id is not None:
            visual = vision_tower(model)
            if visual is None:
                raise ValueError(f"model.freeze_vision: no vision tower found in {type(model).__name__}")
            visual.requires_grad_(False)
        if model_cfg.gradient_checkpointing:
            # Non-reentrant: reentrant checkpointing silently drops the gradients of a segment
            # whose inputs do not require grad, which freezing parts of the model can cause.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        self.lora = model_cfg.lora.rank > 0
        if self.lora:
            model = apply_lora(model, model_cfg.lora)  # only the adapters require grad now

        def schedule(step: int) -> float:
            return lr_multiplier(
                step, learner_cfg.warmup_steps, total_steps, learner_cfg.lr_schedule, learner_cfg.min_lr_ratio
            )

        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer(model, learner_cfg),
            # A callable, so the scheduler drives the optimizer DeepSpeed actually steps.
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
            config=config,
            dist_init_required=False,
        )
        self.engine.train()
        self._states_offloaded = False  # learner.offload_during_generation (`release_memory`)

        self.ref: torch.nn.Module | None = None
        if algo_cfg.kl_coef > 0 and self.lora:
            # The frozen base weights are the reference: the policy with its adapters disabled.
            self.ref = self.engine
        elif algo_cfg.kl_coef > 0:
            ref_model, _ = load_judge(
                model_path, dtype=model_cfg.dtype, device=self.device, trainable=False, attn_implementation=attention,
                budget=budget,
            )  # fmt: skip
            if self.zero3 or learner_cfg.shard_reference:
                # The reference is sharded over the ranks: a ZeRO-3 engine without optimizer.
                ref_config = ref_ds_config(config, learner_cfg, world_size)
                self.ref, _, _, _ = deepspeed.initialize(model=ref_model, config=ref_config, dist_init_required=False)
            else:
                if learner_cfg.bf16:
                    # The policy engine computes in bf16; the reference must match it at step 0.
                    ref_model.to(torch.bfloat16)
                self.ref = ref_model
            self.ref.eval()

        self.hybrid: HFEngine | None = None
        if rollout_cfg is not None:
            layerwise = self.zero3 and rollout_cfg.hybrid_gather == "layer"
            self.hybrid = HFEngine.around(
                base_model(self.engine.module), self.processor, model_cfg, rollout_cfg, self.device, synced=layerwise,
                # Layer by layer, ranks step in lockstep inside one generate call, so each
                # request is one call (a chunk count that differed across ranks would hang).
                max_batch_prompts=1 << 30 if layerwise else 8,
            )

    # -----------------------------------------------------------------------------------------
    # Forward passes
    # -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, experiences: Sequence[Experience], which: str = "policy") -> list[tuple[float, ...]]:
        """Per-response-token log-probs under the policy or the reference model, no grad.

        Runs the micro-batches `_micro_batches` cuts (as many on every rank), so ranks given shards
        of equal length stay in step under ZeRO-3.

        Returns:
            one tuple per experience, len(response_ids) floats each (empty for a dummy).
        """
        if which == "policy":
            model: torch.nn.Module = self.engine
        elif which == "ref":
            if self.ref is None:
                raise ValueError("compute_logprobs(which='ref'): algo.kl_coef is 0, so there is no reference model")
            model = self.ref
        else:
            raise ValueError(f"which must be 'policy' or 'ref', got {which!r}")
        was_training = self.engine.training
        self.engine.eval()
        # LoRA: the reference is the same module with its adapters off.
        adapters_off = self.engine.module.disable_adapter() if which == "ref" and self.lora else contextlib.nullcontext()
        try:
            with adapters_off:
                results: list[tuple[float, ...] | None] = [None] * len(experiences)
                mbs, n = self.learner_cfg.micro_batch_size, len(experiences)
                runs = [list(range(start, min(start + mbs, n))) for start in range(0, n, mbs)]
                for rows, batch in self._micro_batches(experiences, runs):
                    logp, _ = forward_logprobs(
                        model, self.processor, batch, self.device, self.temperature, self.learner_cfg.shared_prefix, self.banned,
                        chunk_tokens=self.learner_cfg.logit_chunk_tokens, packed=self.learner_cfg.packing,
                        top_k=self.top_k, top_p=self.top_p, min_chunks=self._chunks_in_step(batch),
                    )
                    logp = logp.float().cpu()
                    mask = batch.response_mask[:, 1:].bool()
                    for k, row in enumerate(rows):
                        results[row] = tuple(logp[k][mask[k]].tolist())
                return [r if r is not None else () for r in results]
        finally:
            self.engine.train(was_training)

    def compute_logprobs_timed(
        self, experiences: Sequence[Experience], which: str = "policy"
    ) -> Timed[list[tuple[float, ...]]]:
        """`compute_logprobs`, with the seconds it took on this rank (collate and forwards)."""
        return Timed.measure(self.compute_logprobs, experiences, which)

    # -----------------------------------------------------------------------------------------
    # Generation (the hybrid engine)
    # -----------------------------------------------------------------------------------------

    def generate(self, prompts: list[JudgePrompt], n: int, seed: int) -> list[Completion]:
        """`RolloutEngine.generate` with the weights this rank trains, in eval mode."""
        if self.hybrid is None:
            raise ValueError("generate: this rank was built without rollout_cfg (rollout.backend=hybrid)")
        was_training = self.engine.training
        self.engine.eval()
        try:
            with self._generation_weights():
                return self.hybrid.generate(prompts, n, seed)
        finally:
            self.engine.train(was_training)

    def generate_timed(self, prompts: list[JudgePrompt], n: int, seed: int) -> Timed[list[Completion]]:
        """`generate`, with the seconds it took on this rank."""
        return Timed.measure(self.generate, prompts, n, seed)

    def _generation_weights(self) -> contextlib.AbstractContextManager:
        """Full weights for the length of a generate call: ZeRO-3 with hybrid_gather=full
        gathers every partition (all ranks at once) and releases them after."""
        if not self.zero3 or self.hybrid is None or self.hybrid.synced:
            return contextlib.nullcontext()
        return self._ds.zero.GatheredParameters(list(self.engine.module.parameters()), modifier_rank=None)

    # -----------------------------------------------------------------------------------------
    # Training
    # -----------------------------------------------------------------------------------------

    def train_step(
        self, experiences: Sequence[Experience], global_tokens: float, global_seqs: float
    ) -> dict[str, float]:
        """One optimizer step over this rank's shard of a mini-batch.

        Args:
            experiences: this rank's shard, cut into `grad_accum_steps` micro-batches (so it
                needs at least that many; the driver sends every rank the same length).
            global_tokens: response tokens in the mini-batch over ALL ranks (dummies excluded).
            global_seqs: sequences with at least one response token, over all ranks.

        Returns:
            metrics, identical on every rank (`StepSums.metrics` of the all-reduced sums):
            actor/pg_loss and actor/kl_loss (the full mini-batch values), token means over the
            mini-batch of actor/entropy, actor/pg_clipfrac, actor/pg_clipfrac_lower,
            actor/ppo_kl; actor/grad_norm (before clipping), actor/lr (the rate this step used),
            actor/num_tokens and actor/num_seqs (mini-batch totals), perf/padding_fraction
            (padding positions over all forwarded positions). When experiences carry
            `rollout_logprobs`, also rollout/logprob_diff_mean and rollout/logprob_diff_max:
            |learner - rollout engine| per response token (the learner's weights before this
            step's update: the old policy's), over the tokens that have one; and with
            algo.rollout_is, the policy loss weighted by `rollout_is_weights` of old policy /
            engine, and rollout_is/* metrics.
        """
        self._check_step(experiences)
        self._states_on_gpu()
        lr = float(self.engine.get_lr()[0])
        sums = StepSums()
        self.engine.train()
        batches = self._micro_batches(experiences, self._even_runs(len(experiences)))
        grad_norm = self._accumulate(
            [lambda b=b: sums.add(self._micro_batch(b, float(global_tokens), float(global_seqs))) for _, b in batches]
        )
        if self.world_size > 1:
            sums = sums.reduced(lambda t, op: self._ds.comm.all_reduce(t, op=op), self.device)
        return sums.metrics(self.world_size, float(grad_norm), lr)

    def _check_step(self, experiences: Sequence[Experience]) -> None:
        if not self.learner_cfg.micro_batch_tokens and len(experiences) < self.grad_accum_steps:
            raise ValueError(
                f"train_step: {len(experiences)} experiences cannot fill {self.grad_accum_steps} micro-batches"
            )
        if self.algo_cfg.kl_coef > 0:
            missing = [i for i, e in enumerate(experiences) if e.response_ids and e.ref_logprobs is None]
            if missing:
                raise ValueError(
                    f"train_step: algo.kl_coef={self.algo_cfg.kl_coef} but experiences {missing[:5]} have no "
                    "ref_logprobs; fill them with compute_logprobs(..., 'ref') first"
                )

    def _even_runs(self, n: int) -> list[list[int]]:
        """`grad_accum_steps` runs of consecutive indices of n experiences, as even as they go."""
        return split_evenly(list(range(n)), self.grad_accum_steps)

    def _micro_batches(self, experiences: Sequence[Experience], runs: list[list[int]]) -> list[tuple[list[int], TrainBatch]]:
        """This rank's experiences cut into micro-batches: (their indices, their batch).

        The whole shard goes through the processor once (`collate`) and is cut by rows
        (`take_rows`): into the fixed `runs` of indices, or with `learner.micro_batch_tokens`
        under that token budget (`token_budget_batches`, packed or padded as the forward runs),
        and then padded with micro-batches that train nothing up to the largest count on any rank
        (ZeRO's collectives run per micro-batch)."""
        lc = self.learner_cfg
        if not experiences:
            return []
        whole = collate(self.processor, experiences)
        if lc.micro_batch_tokens:
            lengths = [int(n) for n in whole.attention_mask.sum(-1)]
            cuts = token_budget_batches(lengths, lc.micro_batch_tokens, lc.packing)
        else:
            cuts = runs
        batches = [(rows, take_rows(whole, rows)) for rows in cuts]
        wanted = self._most_over_ranks(len(batches)) if lc.micro_batch_tokens else len(batches)
        # The shortest row's forward, with nothing to train: it keeps the vision tower's
        # parameters in step under ZeRO-3 where the row has an image.
        shortest = min(range(len(experiences)), key=lambda i: int(whole.attention_mask[i].sum()))
        batches += [([], take_rows(whole, [shortest], trained=False))] * (wanted - len(batches))
        return batches

    def _chunks_in_step(self, batch: TrainBatch) -> int:
        """How many chunks every rank's output projection runs for this micro-batch: under
        ZeRO-3 with several ranks the most any rank needs (each projection gathers the head's
        weight, a collective), else 0 (as many as its own tokens need)."""
        if not self.zero3 or self.world_size == 1:
            return 0
        trained = int((batch.response_mask[:, 1:] > 0).sum())
        return self._most_over_ranks(math.ceil(trained / self.learner_cfg.logit_chunk_tokens))

    def _most_over_ranks(self, count: int) -> int:
        """The largest `count` any rank passed (all ranks call this together)."""
        if self.world_size == 1:
            return count
        total = torch.tensor([count], dtype=torch.long, device=self.device)
        self._ds.comm.all_reduce(total, op=self._ds.comm.ReduceOp.MAX)
        return int(total.item())

    def _accumulate(self, micro_batches: list[Callable[[], None]]) -> float:
        """Run each micro-batch's forward and backward, then the optimizer step at the last
        (the boundary set per micro-batch, so their number may change from step to step);
        returns the gradient norm before clipping (NaN where none is kept)."""
        manual_grad_norm: float | None = None
        for index, run in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            self.engine.set_gradient_accumulation_boundary(last)
            run()
            if last and self.learner_cfg.zero_stage == 0:
                # Without ZeRO (fp32) DeepSpeed clips but does not keep the norm; the gradients
                # are already all-reduced after the boundary backward, so measure them here.
                manual_grad_norm = self._grad_norm()
            self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None:
            return manual_grad_norm if manual_grad_norm is not None else math.nan
        return float(grad_norm)

    def _micro_batch(self, batch: TrainBatch, global_tokens: float, global_seqs: float) -> StepSums:
        """Forward, loss and backward of one micro-batch (the optimizer step is the caller's);
        returns what it adds to the step's sums."""
        algo = self.algo_cfg
        lc = self.learner_cfg
        shared = lc.shared_prefix and can_share_prefix(self.engine, batch)
        logp, stats = forward_logprobs(
            self.engine, self.processor, batch, self.device, self.temperature, shared, self.banned,
            chunk_tokens=lc.logit_chunk_tokens, packed=lc.packing, top_k=self.top_k, top_p=self.top_p,
            min_chunks=self._chunks_in_step(batch),
        )
        mask = batch.response_mask[:, 1:].to(self.device)
        on_mask = mask > 0
        old = batch.old_logprobs[:, 1:].to(self.device)
        # NaN marks "no rollout log-prob": on-policy, so the ratio is exactly 1.
        old = torch.where(torch.isnan(old), logp.detach(), old)
        ref = None
        if algo.kl_coef > 0:
            if batch.ref_logprobs is None:
                # Only dummies here (checked in _check_step): no response token, so KL is 0 anyway.
                ref = logp.detach()
            else:
                # Rows without ref log-probs (dummies) are NaN on no position that counts.
                ref = torch.where(on_mask, batch.ref_logprobs[:, 1:].to(self.device), logp.detach())
        rollout = None if batch.rollout_logprobs is None else batch.rollout_logprobs[:, 1:].to(self.device)
        out = StepSums()
        is_weights = None
        if algo.rollout_is != "none" and rollout is not None:
            # old policy minus engine; 0 (weight 1) on tokens the engine gave no log-prob for.
            have = on_mask & ~torch.isnan(rollout)
            log_ratio = torch.where(have, old.double() - rollout, torch.zeros_like(rollout)).to(logp.dtype)
            is_weights, is_sums, is_max = rollout_is_weights(
                log_ratio, mask, algo.rollout_is, algo.rollout_is_upper, algo.rollout_is_lower
            )
            out.is_units, out.is_total, out.is_squares, out.is_outside = (float(x) for x in is_sums)
            out.is_raw_max = float(is_max)
        loss, metrics = grpo_loss(
            logp, old, ref, batch.advantages.to(self.device), mask, LossSettings.from_algo(algo, self.norm_len),
            global_tokens, global_seqs, self.world_size, is_weights,
        )
        with torch.no_grad():
            tokens = float(on_mask.sum())
            out.pg_loss, out.kl_loss, out.tokens, out.seqs = metrics["pg_loss"], metrics["kl_loss"], tokens, float(on_mask.any(-1).sum())
            out.entropy = float(stats.entropy.sum())
            out.pg_clipfrac = metrics["pg_clipfrac"] * tokens
            out.pg_clipfrac_lower = metrics["pg_clipfrac_lower"] * tokens
            out.ppo_kl = metrics["ppo_kl"] * tokens
            if rollout is not None:
                diffs = (old.double() - rollout)[on_mask & ~torch.isnan(rollout)].abs()
                out.logprob_diff, out.logprob_diff_tokens = float(diffs.sum()), float(diffs.numel())
                out.logprob_diff_max = float(diffs.max()) if diffs.numel() else 0.0
            out.padding_positions, out.positions = map(float, forwarded_positions(batch, shared, lc.packing))
        # The aggregation already normalises by the global counts; DeepSpeed must not divide by
        # the accumulation steps again.
        self.engine.backward(loss, scale_wrt_gas=False)
        return out

    def train_step_timed(
        self, experiences: Sequence[Experience], global_tokens: float, global_seqs: float
    ) -> Timed[dict[str, float]]:
        """`train_step`, with the seconds it took on this rank (collate, forward, backward,
        optimizer step and the all-reduce of its metrics)."""
        return Timed.measure(self.train_step, experiences, global_tokens, global_seqs)

    def sft_step(self, experiences: Sequence[Experience], global_tokens: float) -> dict[str, float]:
        """One supervised optimizer step: `response_ids` are the targets (`sft_loss`).

        Same sharding contract as `train_step` (every rank gets an equal-length shard of at least
        `grad_accum_steps` experiences; `global_tokens` counts target tokens over all ranks).
        Returns sft/loss (the full-batch token-mean NLL), sft/token_acc (greedy next-token
        accuracy on targets), actor/grad_norm, actor/lr and sft/num_tokens, identical on ranks.
        """
        if not self.learner_cfg.micro_batch_tokens and len(experiences) < self.grad_accum_steps:
            raise ValueError(f"sft_step: {len(experiences)} experiences cannot fill {self.grad_accum_steps} micro-batches")
        self._states_on_gpu()
        lr = float(self.engine.get_lr()[0])
        sums = torch.zeros(3, dtype=torch.float64)  # [loss, tokens, right]
        self.engine.train()

        def one(batch: TrainBatch) -> None:
            nonlocal sums
            # Unbanned: teacher forcing on fixed targets samples nothing (and the shipped base
            # judge was built this way).
            logp, stats = forward_logprobs(
                self.engine, self.processor, batch, self.device, shared_prefix=self.learner_cfg.shared_prefix,
                chunk_tokens=self.learner_cfg.logit_chunk_tokens, packed=self.learner_cfg.packing,
                min_chunks=self._chunks_in_step(batch),
            )
            mask = batch.response_mask[:, 1:].to(self.device)
            loss = sft_loss(logp, mask, float(global_tokens), self.world_size)
            with torch.no_grad():
                on = mask > 0
                targets = batch.input_ids[:, 1:].to(self.device)[on]
                right = float((stats.greedy == targets).sum())
                sums += torch.tensor([float(-(logp.detach() * mask).sum()), float(on.sum()), right], dtype=torch.float64)
            self.engine.backward(loss, scale_wrt_gas=False)

        grad_norm = self._accumulate([lambda b=b: one(b) for _, b in self._micro_batches(experiences, self._even_runs(len(experiences)))])
        totals = sums.to(self.device)
        if self.world_size > 1:
            self._ds.comm.all_reduce(totals)
        loss_sum, tokens, right = totals.cpu().tolist()
        tokens = max(tokens, 1.0)
        return {
            "sft/loss": loss_sum / tokens,
            "sft/token_acc": right / tokens,
            "sft/num_tokens": tokens,
            "actor/grad_norm": float(grad_norm),
            "actor/lr": lr,
        }

    def release_memory(self) -> None:
        """Return the CUDA caching allocator's free blocks (activations of the update) to the
        GPU, for a colocated engine that wakes into it next; with
        `learner.offload_during_generation`, first move the optimizer's states (fp32 master
        weights, Adam moments, gradient buffers) to pinned CPU memory until the next update
        (`_states_on_gpu`). A no-op on CPU."""
        if not torch.cuda.is_available():
            return
        if self.learner_cfg.offload_during_generation and not self._states_offloaded:
            self.engine.offload_states()
            self._states_offloaded = True
        torch.cuda.empty_cache()

    def _states_on_gpu(self) -> None:
        """Bring back what `release_memory` offloaded, before an optimizer step needs it."""
        if self._states_offloaded:
            self.engine.reload_states()
            self._states_offloaded = False

    def _grad_norm(self) -> float | None:
        """L2 norm of the trainable parameters' .grad (None when no gradient is held there)."""
        grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else None


    def ready(self) -> bool:
        return True

    def peak_memory(self) -> dict[str, float]:
        """This process's peak host and GPU memory in MiB (`pjray.memory`)."""
        return peak_memory_mib()

    def shutdown(self) -> None:
        """Tear down the process group (so a later rank in the same process can rejoin)."""
        self.engine = None  # type: ignore[assignment]
        self.ref = None
        if torch.distributed.is_initialized():
            self._ds.comm.destroy_process_group()
