"""The model one learner rank trains: its DeepSpeed engine, its reference, and the forwards and
optimizer steps over a shard of experiences.

`PolicyModel` is a part of `pjray.rl.learner.LearnerRank`, built by `build_policy` once the rank
has joined the process group. Under ZeRO-3 each forward gathers parameters collectively, so
every method that forwards cuts the shard into micro-batches and runs as many of them as the
rank that needs the most (`micro_batches`), with the same forwards in each: a prompt is forwarded
once for its group only where every rank's micro-batch can do so (`forward`), and one without an
image carries a blank one (`image_filler`), since the vision tower gathers its parameters too. A
rank that skipped a gather would hang the others.

`step(experiences, loss)` is the one optimizer step of GRPO and SFT alike: per micro-batch the
forward, the caller's `loss` of it, the backward (without DeepSpeed's 1/GAS scaling: the losses
divide by the global counts themselves), and the optimizer step at the last micro-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from pjray.config import AlgoConfig, LearnerConfig, ModelConfig
from pjray.models.families import family_of
from pjray.models.loading import is_text_only, load_judge, placeholder_ids
from pjray.models.lora import apply_lora
from pjray.placement import split_evenly
from pjray.rl.ds_setup import ds_config, lr_multiplier, optimizer, ref_ds_config
from pjray.rl.logprobs import TokenStats, can_share_prefix, collate, forward_logprobs, take_rows
from pjray.rl.microbatch import token_budget_batches
from pjray.types import Experience, TrainBatch


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The distribution the rollout engines sample from (rollout.temperature, top_k, top_p): every
    log-prob and the entropy of a sampled response are of it (`truncate_logits`)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclasses.dataclass
class Forward:
    """One micro-batch's forward: log-probs of the next tokens [B, T-1], their statistics
    (`pjray.rl.logprobs.forward_logprobs`), and whether a shared prompt was forwarded once."""

    logp: Tensor
    stats: TokenStats
    shared: bool


# What `learner.offload_during_generation` moves off the GPU while engines generate (DeepSpeed's
# OffloadStateTypeEnum values): the optimizer's alone. The bf16 weights ("lp_params") stay: the
# log-prob passes, the LoRA reference (the same module, adapters off) and the weight sync read
# them before the next optimizer step.
OFFLOADED = ("optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer")

# A micro-batch's loss: computed from its batch and forward, returned for the backward.
MicroLoss = Callable[[TrainBatch, Forward], Tensor]


def image_filler(processor: Any) -> Experience | None:
    """A row that runs the vision tower and trains nothing: a blank image under the judge's own
    chat template, no response (None for a text-only judge). verl runs a dummy visual forward
    for the same reason (see `PolicyModel.micro_batches`)."""
    if is_text_only(processor):
        return None
    blank = io.BytesIO()
    Image.new("RGB", (28, 28)).save(blank, format="PNG")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return Experience(prompt_text=text, image=blank.getvalue(), response_ids=(), advantage=0.0)


class PolicyModel:
    """The DeepSpeed engine of one rank's policy, its reference model and its processor.

    Attributes read by the rank's other parts (`WeightSender`, `RankCheckpoints`, the hybrid
    engine): `engine` (its `module` is the HF or PEFT model), `ref`, `processor`, `ds` (the
    deepspeed module), `device`, `rank`, `world_size`, `zero3`, `lora`.
    """

    def __init__(
        self,
        engine: Any,
        ref: torch.nn.Module | None,
        processor: Any,
        ds: Any,
        device: torch.device,
        rank: int,
        world_size: int,
        learner_cfg: LearnerConfig,
        lora: bool,
        sampling: Sampling,
        grad_accum_steps: int,
    ) -> None:
        self.engine, self.ref, self.processor, self.ds = engine, ref, processor, ds
        self.device, self.rank, self.world_size = device, rank, world_size
        self.learner_cfg, self.lora, self.sampling = learner_cfg, lora, sampling
        self.grad_accum_steps = grad_accum_steps
        self.zero3 = learner_cfg.zero_stage == 3
        # The distribution the engines sample from has no placeholder tokens; the log-probs here
        # are of that same distribution.
        self.banned = placeholder_ids(processor)
        self.image_filler = image_filler(processor)
        self.states_offloaded = False  # learner.offload_during_generation (`release_memory`)

    # ------------------------------------------------------------------ forwards
    def forward(self, model: torch.nn.Module, batch: TrainBatch, sampled: bool = True) -> Forward:
        """Log-probs of `batch` under `model` (the engine or the reference): of the sampling
        distribution when `sampled`, else of the plain softmax (teacher forcing on fixed targets,
        as SFT trains)."""
        lc = self.learner_cfg
        shared = lc.shared_prefix and can_share_prefix(model, batch)
        if self.zero3:
            # The shared-prefix path runs two forwards, the others one, and under ZeRO-3 every
            # forward gathers the parameters (collectives): a micro-batch shares only where every
            # rank's does.
            shared = self.on_every_rank(shared)
        s = self.sampling if sampled else Sampling()
        logp, stats = forward_logprobs(
            model,
            self.processor,
            batch,
            self.device,
            s.temperature,
            shared,
            self.banned if sampled else (),
            chunk_tokens=lc.logit_chunk_tokens,
            packed=lc.packing,
            top_k=s.top_k,
            top_p=s.top_p,
            min_chunks=self.chunks_in_step(batch),
        )
        return Forward(logp, stats, shared)

    @torch.no_grad()
    def logprobs(self, experiences: Sequence[Experience], which: str = "policy") -> list[tuple[float, ...]]:
        """Per-response-token log-probs under the policy or the reference model, no grad; one
        tuple per experience, len(response_ids) floats each (empty for a dummy)."""
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
        adapters_off = (
            self.engine.module.disable_adapter() if which == "ref" and self.lora else contextlib.nullcontext()
        )
        try:
            with adapters_off:
                results: list[tuple[float, ...] | None] = [None] * len(experiences)
                mbs, n = self.learner_cfg.micro_batch_size, len(experiences)
                runs = [list(range(start, min(start + mbs, n))) for start in range(0, n, mbs)]
                for rows, batch in self.micro_batches(experiences, runs):
                    logp = self.forward(model, batch).logp.float().cpu()
                    mask = batch.response_mask[:, 1:].bool()
                    for k, row in enumerate(rows):
                        results[row] = tuple(logp[k][mask[k]].tolist())
                return [r if r is not None else () for r in results]
        finally:
            self.engine.train(was_training)

    # ------------------------------------------------------------------ the optimizer step
    def step(self, experiences: Sequence[Experience], loss: MicroLoss, sampled: bool = True) -> float:
        """One optimizer step over this rank's shard: each micro-batch's forward, `loss` of it and
        backward, the optimizer step at the last; returns the gradient norm before clipping
        (NaN where none is kept)."""
        self.states_on_gpu()
        self.engine.train()
        batches = self.micro_batches(experiences, split_evenly(list(range(len(experiences))), self.grad_accum_steps))
        manual_grad_norm: float | None = None
        for index, (_, batch) in enumerate(batches):
            # The boundary is set per micro-batch, so their number may change from step to step.
            last = index == len(batches) - 1
            self.engine.set_gradient_accumulation_boundary(last)
            # The losses already normalise by the global counts; DeepSpeed must not divide by the
            # accumulation steps again.
            self.engine.backward(loss(batch, self.forward(self.engine, batch, sampled)), scale_wrt_gas=False)
            if last and self.learner_cfg.zero_stage == 0:
                # Without ZeRO (fp32) DeepSpeed clips but does not keep the norm; the gradients
                # are already all-reduced after the boundary backward, so measure them here.
                manual_grad_norm = self._grad_norm()
            self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None:
            return manual_grad_norm if manual_grad_norm is not None else math.nan
        return float(grad_norm)

    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        return float(self.engine.get_lr()[0])

    def check_shard(self, what: str, experiences: Sequence[Experience]) -> None:
        """A fixed micro-batch count needs at least that many experiences on every rank."""
        if not self.learner_cfg.micro_batch_tokens and len(experiences) < self.grad_accum_steps:
            raise ValueError(
                f"{what}: {len(experiences)} experiences cannot fill {self.grad_accum_steps} micro-batches"
            )

    def micro_batches(
        self, experiences: Sequence[Experience], runs: list[list[int]]
    ) -> list[tuple[list[int], TrainBatch]]:
        """This rank's experiences cut into micro-batches: (their indices, their batch).

        The whole shard goes through the processor once (`collate`) and is cut by rows
        (`take_rows`): into the fixed `runs` of indices, or with `learner.micro_batch_tokens`
        under that token budget (`token_budget_batches`, packed or padded as the forward runs),
        and then padded with micro-batches that train nothing up to the largest count on any rank
        (ZeRO's collectives run per micro-batch; shards of different lengths cut into fixed runs
        can make different counts too)."""
        lc = self.learner_cfg
        if not experiences:
            return []
        n = len(experiences)
        # Under ZeRO-3 the vision tower's parameters are gathered where a forward runs it, so a
        # micro-batch without an image (text rows, padding rows) carries the image filler too.
        filler = self.image_filler if self.zero3 and self.world_size > 1 else None
        whole = collate(self.processor, [*experiences, filler] if filler else experiences)

        def rows_of(rows: list[int]) -> list[int]:
            if filler is None or any(whole.vision[r] for r in rows):
                return rows
            return [*rows, n]

        if lc.micro_batch_tokens:
            lengths = [int(k) for k in whole.attention_mask[:n].sum(-1)]
            cuts = token_budget_batches(lengths, lc.micro_batch_tokens, lc.packing)
        else:
            cuts = runs
        batches = [(rows, take_rows(whole, rows_of(rows))) for rows in cuts]
        wanted = self.most_over_ranks(len(batches))
        # The shortest row's forward, with nothing to train.
        shortest = min(range(n), key=lambda i: int(whole.attention_mask[i].sum()))
        batches += [([], take_rows(whole, rows_of([shortest]), trained=False))] * (wanted - len(batches))
        return batches

    def chunks_in_step(self, batch: TrainBatch) -> int:
        """How many chunks every rank's output projection runs for this micro-batch: under
        ZeRO-3 with several ranks the most any rank needs (each projection gathers the head's
        weight, a collective), else 0 (as many as its own tokens need)."""
        if not self.zero3 or self.world_size == 1:
            return 0
        trained = int((batch.response_mask[:, 1:] > 0).sum())
        return self.most_over_ranks(math.ceil(trained / self.learner_cfg.logit_chunk_tokens))

    def most_over_ranks(self, count: int) -> int:
        """The largest `count` any rank passed (all ranks call this together)."""
        if self.world_size == 1:
            return count
        total = torch.tensor([count], dtype=torch.long, device=self.device)
        self.ds.comm.all_reduce(total, op=self.ds.comm.ReduceOp.MAX)
        return int(total.item())

    def on_every_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (all ranks call this together)."""
        return self.most_over_ranks(int(not flag)) == 0

    def all_reduce(self, tensor: Tensor, op: Any = None) -> None:
        """Sum (or `op`) `tensor` over the ranks in place; nothing with one rank."""
        if self.world_size == 1:
            return
        if op is None:
            self.ds.comm.all_reduce(tensor)
        else:
            self.ds.comm.all_reduce(tensor, op=op)

    def _grad_norm(self) -> float | None:
        """L2 norm of the trainable parameters' .grad (None when no gradient is held there)."""
        grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else None

    # ------------------------------------------------------------------ memory
    def release_memory(self) -> None:
        """Return the CUDA caching allocator's free blocks (activations of the update) to the
        GPU, for a colocated engine that wakes into it next; with
        `learner.offload_during_generation`, first move the optimizer's states (`OFFLOADED`:
        fp32 master weights, Adam moments, gradient buffers, never the bf16 weights every
        forward and weight export reads) to pinned CPU memory until the next optimizer step or
        checkpoint (`states_on_gpu`). A no-op on CPU."""
        if not torch.cuda.is_available():
            return
        if self.learner_cfg.offload_during_generation and not self.states_offloaded:
            states = self.ds.runtime.zero.offload_config.OffloadStateTypeEnum
            self.engine.offload_states(include=[states(name) for name in OFFLOADED])
            self.states_offloaded = True
        torch.cuda.empty_cache()

    def states_on_gpu(self) -> None:
        """Bring back what `release_memory` offloaded, before an optimizer step or a checkpoint
        needs it."""
        if self.states_offloaded:
            self.engine.reload_states()
            self.states_offloaded = False


# ---------------------------------------------------------------------------------------------
# Set-up
# ---------------------------------------------------------------------------------------------


def build_policy(
    ds: Any,
    device: torch.device,
    model_cfg: ModelConfig,
    learner_cfg: LearnerConfig,
    algo_cfg: AlgoConfig,
    model_path: str,
    *,
    rank: int,
    world_size: int,
    total_steps: int,
    grad_accum_steps: int,
    sampling: Sampling,
    ds_config_overrides: dict[str, Any],
) -> PolicyModel:
    """The rank's policy, in the process group the rank has joined: the trainable model loaded
    (`_trainable_model`), wrapped in its DeepSpeed engine with optimizer and schedule, and the
    reference model beside it (`_reference`)."""
    config = ds_config(learner_cfg, grad_accum_steps, world_size, ds_config_overrides)
    model, processor = _trainable_model(device, model_cfg, model_path, config)

    def schedule(step: int) -> float:
        return lr_multiplier(
            step, learner_cfg.warmup_steps, total_steps, learner_cfg.lr_schedule, learner_cfg.min_lr_ratio
        )

    engine, _, _, _ = ds.initialize(
        model=model,
        optimizer=optimizer(model, learner_cfg),
        # A callable, so the scheduler drives the optimizer DeepSpeed actually steps.
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
        config=config,
        dist_init_required=False,
    )
    engine.train()
    lora = model_cfg.lora.rank > 0
    ref = _reference(ds, device, engine, config, model_cfg, learner_cfg, algo_cfg, model_path, world_size)
    return PolicyModel(
        engine, ref, processor, ds, device, rank, world_size, learner_cfg, lora, sampling, grad_accum_steps
    )


def _load(
    device: torch.device, model_cfg: ModelConfig, model_path: str, trainable: bool, config: dict[str, Any]
) -> tuple[Any, Any]:
    """The initial judge and its processor, in the dtype, attention kernels and image budget of
    `model.*`. Under a ZeRO-3 DeepSpeed `config` it is loaded partitioned: transformers builds
    each parameter inside `deepspeed.zero.Init` (while an `HfDeepSpeedConfig` of `config` is
    alive) and reads the checkpoint a module at a time, gathered only while it is written, so no
    rank ever holds the whole model; the engine built on it finds its parameters partitioned."""
    partitioned = config["zero_optimization"]["stage"] == 3
    with _zero3_loading(config) if partitioned else contextlib.nullcontext():
        return load_judge(
            model_path,
            dtype=model_cfg.dtype,
            device=None if partitioned else device,
            trainable=trainable,
            attn_implementation=model_cfg.attn_implementation,
            budget=model_cfg.image_budget,
        )


@contextlib.contextmanager
def _zero3_loading(config: dict[str, Any]) -> Iterator[None]:
    """transformers loads partitioned while an `HfDeepSpeedConfig` of a ZeRO-3 `config` is
    referenced (it keeps a weak reference); dropping it afterwards keeps every later
    `from_pretrained` in the process (an HF engine, an evaluation) whole."""
    from transformers.integrations import HfDeepSpeedConfig

    held = HfDeepSpeedConfig(config)
    try:
        yield
    finally:
        del held


def _trainable_model(
    device: torch.device, model_cfg: ModelConfig, model_path: str, config: dict[str, Any]
) -> tuple[Any, Any]:
    """The judge to train and its processor (loaded for the engine's DeepSpeed `config`): the
    vision tower frozen (model.freeze_vision), gradient checkpointing and LoRA adapters as
    configured."""
    model, processor = _load(device, model_cfg, model_path, True, config)
    # A text-only judge has no vision part, so there is nothing for freeze_vision to freeze.
    family = family_of(processor)
    if model_cfg.freeze_vision and family is not None:
        for part in family.vision_modules(model):
            part.requires_grad_(False)
    if model_cfg.gradient_checkpointing:
        # Non-reentrant: reentrant checkpointing silently drops the gradients of a segment
        # whose inputs do not require grad, which freezing parts of the model can cause.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if model_cfg.lora.rank > 0:
        model = apply_lora(model, model_cfg.lora)  # only the adapters require grad now
    return model, processor


def _reference(
    ds: Any,
    device: torch.device,
    engine: Any,
    config: dict[str, Any],
    model_cfg: ModelConfig,
    learner_cfg: LearnerConfig,
    algo_cfg: AlgoConfig,
    model_path: str,
    world_size: int,
) -> torch.nn.Module | None:
    """The reference model of the KL term: none without it; with LoRA the policy itself (its
    adapters disabled when it serves as the reference); else the initial judge, sharded over the
    ranks (a ZeRO-3 engine without optimizer) or whole on each."""
    if algo_cfg.kl_coef <= 0:
        return None
    if model_cfg.lora.rank > 0:
        return engine
    if learner_cfg.zero_stage == 3 or learner_cfg.shard_reference:
        ref_config = ref_ds_config(config, learner_cfg, world_size)
        ref_model, _ = _load(device, model_cfg, model_path, False, ref_config)
        ref, _, _, _ = ds.initialize(model=ref_model, config=ref_config, dist_init_required=False)
    else:
        ref_model, _ = _load(device, model_cfg, model_path, False, config)
        if learner_cfg.bf16:
            # The policy engine computes in bf16; the reference must match it at step 0.
            ref_model.to(torch.bfloat16)
        ref = ref_model
    ref.eval()
    return ref
