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
* Every log-prob (current, old, reference) and the entropy are of the logits divided by the
  rollout's sampling temperature: the distribution the responses were sampled from.
* Weight sync to the rollout engines and checksums are `pjray.rl.sync.WeightSender`'s methods,
  mixed into the rank; exported weights carry the HF model's own parameter names.
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
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from pjray.config import AlgoConfig, LearnerConfig, ModelConfig, RolloutConfig
from pjray.console import quiet_actor_warnings, quiet_prints
from pjray.models.loading import continued_positions, load_judge, mm_token_type_ids, processor_inputs, prompt_positions
from pjray.models.lora import apply_lora, base_model
from pjray.rl.ds_ops import prepare_ops
from pjray.rl.grpo import entropy_from_logits, grpo_loss, sft_loss, token_logprobs
from pjray.rl.placement import split_evenly
from pjray.rl.rollout import HFEngine
from pjray.rl.sync import WeightSender
from pjray.types import Completion, Experience, JudgePrompt, Timed, TrainBatch

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.processing_utils import ProcessorMixin

__all__ = ["LearnerRank", "collate", "forward_logprobs", "forwarded_positions", "lr_multiplier"]

_CLIENT_STATE_KEY = "pjray_client_state"


# ---------------------------------------------------------------------------------------------
# Pure helpers: batching and the learning-rate schedule
# ---------------------------------------------------------------------------------------------


def collate(
    processor: ProcessorMixin, experiences: Sequence[Experience], pad_to: int | None = None
) -> TrainBatch:
    """Model inputs for prompt + response sequences, right-padded to one length.

    The prompts go through the processor together (it expands each image placeholder into the
    image's pad tokens), the processor's padding is stripped by its attention mask (so left- and
    right-padded prompts both work), the response ids are appended, and each row is right-padded.
    Right padding keeps every real token at the position it has in an unpadded sequence, for
    1-D RoPE and for Qwen-VL's M-RoPE alike (the model computes M-RoPE positions over the
    attended tokens only).

    Args:
        processor: the judge's processor (`pjray.models.loading.load_processor`).
        experiences: B sequences; `prompt_text` holds one placeholder iff `image` is set.
        pad_to: pad every row to exactly this many tokens (ValueError if one is longer);
            None pads to the longest row.

    Returns:
        TrainBatch with input_ids / attention_mask / response_mask / old_logprobs [B, T]
        (response_mask is 1 on the response tokens that `loss_mask` keeps; old_logprobs holds
        the given values on response positions, NaN where an experience has none, meaning "use
        the current policy"), advantages [B], per-row pixel_values [P_b, D] and image_grid_thw [n_b, 3]
        (empty for rows without an image), ref_logprobs / rollout_logprobs [B, T] when any
        experience has them (NaN on the response positions of those that do not), prompt_lens
        [B] and prompt_group [B] (the first row with the same prompt text and image).
    """
    if not experiences:
        raise ValueError("collate: no experiences")
    for i, e in enumerate(experiences):
        n = len(e.response_ids)
        for field_name in ("old_logprobs", "ref_logprobs", "rollout_logprobs", "loss_mask"):
            values = getattr(e, field_name)
            if values is not None and len(values) != n:
                raise ValueError(
                    f"experience {i}: {field_name} has {len(values)} values for {n} response tokens"
                )

    enc = processor_inputs(
        processor, [e.prompt_text for e in experiences], [e.image for e in experiences], padding_side="right"
    )
    prompt_ids: Tensor = enc["input_ids"]  # [B, P] padded
    prompt_mask: Tensor = enc["attention_mask"]  # [B, P]
    pad_id = processor.tokenizer.pad_token_id

    # Per-row pixel values: the processor concatenates the images' patches in row order.
    pixel_values: Tensor | None = enc["pixel_values"]
    grid_thw: Tensor | None = enc["image_grid_thw"]
    dim = pixel_values.shape[-1] if pixel_values is not None else 0
    row_pixels: list[Tensor] = []
    row_grids: list[Tensor] = []
    image_index, patch_offset = 0, 0
    for e in experiences:
        if e.image is None:
            row_pixels.append(torch.zeros(0, dim, dtype=torch.float32))
            row_grids.append(torch.zeros(0, 3, dtype=torch.long))
            continue
        assert pixel_values is not None and grid_thw is not None
        grid = grid_thw[image_index : image_index + 1]
        patches = int(grid.prod(-1).sum())
        row_pixels.append(pixel_values[patch_offset : patch_offset + patches])
        row_grids.append(grid)
        image_index += 1
        patch_offset += patches

    rows: list[Tensor] = []
    prompt_lens: list[int] = []
    first_row: dict[tuple[str, bytes | None], int] = {}
    prompt_group = [first_row.setdefault((e.prompt_text, e.image), i) for i, e in enumerate(experiences)]
    for i, e in enumerate(experiences):
        prompt = prompt_ids[i][prompt_mask[i].bool()]
        response = torch.tensor(e.response_ids, dtype=torch.long)
        row = torch.cat([prompt, response])
        if row.numel() == 0:
            # A row with no attended token can make attention produce NaN, which 0 * NaN would
            # carry into the loss; one attended pad token keeps the row harmless.
            row = torch.tensor([pad_id], dtype=torch.long)
        rows.append(row)
        prompt_lens.append(prompt.numel())

    longest = max(r.numel() for r in rows)
    if pad_to is not None and longest > pad_to:
        raise ValueError(f"collate: a sequence has {longest} tokens, more than pad_to={pad_to}")
    length = longest if pad_to is None else pad_to
    batch_size = len(experiences)

    input_ids = torch.full((batch_size, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(batch_size, length, dtype=torch.long)
    response_mask = torch.zeros(batch_size, length, dtype=torch.float32)
    old_logprobs = torch.zeros(batch_size, length, dtype=torch.float32)
    optional = {
        name: torch.zeros(batch_size, length, dtype=torch.float32)
        for name in ("ref_logprobs", "rollout_logprobs")
        if any(getattr(e, name) is not None for e in experiences)
    }
    for i, (e, row, start) in enumerate(zip(experiences, rows, prompt_lens)):
        input_ids[i, : row.numel()] = row
        attention_mask[i, : row.numel()] = 1
        end = start + len(e.response_ids)
        response_mask[i, start:end] = 1.0 if e.loss_mask is None else torch.tensor(e.loss_mask, dtype=torch.float32)
        for name, values in [("old_logprobs", old_logprobs), *optional.items()]:
            given = getattr(e, name)
            values[i, start:end] = torch.tensor(given, dtype=torch.float32) if given is not None else math.nan

    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        old_logprobs=old_logprobs,
        advantages=torch.tensor([float(e.advantage) for e in experiences], dtype=torch.float32),
        pixel_values=row_pixels,
        image_grid_thw=row_grids,
        ref_logprobs=optional.get("ref_logprobs"),
        rollout_logprobs=optional.get("rollout_logprobs"),
        prompt_lens=torch.tensor(prompt_lens, dtype=torch.long),
        prompt_group=torch.tensor(prompt_group, dtype=torch.long),
    )


def _model_inputs(
    processor: ProcessorMixin, batch: TrainBatch, device: torch.device
) -> dict[str, Tensor | None]:
    """Keyword arguments for a Qwen-VL forward of `batch` on `device`.

    A sampled response may contain an image or video pad id (a random or badly behaved policy
    can emit one). The model treats every such id as a slot for image features and would fail
    (or misplace features), so on response positions it is fed as the pad token instead: its
    own log-prob is still read against the real id, only later tokens see the substitute.
    """
    ids = batch.input_ids
    if processor.image_token_id is None:
        # A text-only judge (a causal LM): token ids and the mask are all it takes.
        return {"input_ids": ids.to(device), "attention_mask": batch.attention_mask.to(device)}
    model_ids = _image_pads_as_pad(processor, ids, batch.response_mask > 0)
    with_images = [i for i, g in enumerate(batch.image_grid_thw) if g.numel() > 0]
    pixel_values = torch.cat([batch.pixel_values[i] for i in with_images]) if with_images else None
    grid_thw = torch.cat([batch.image_grid_thw[i] for i in with_images]) if with_images else None
    return {
        "input_ids": model_ids.to(device),
        "attention_mask": batch.attention_mask.to(device),
        "mm_token_type_ids": mm_token_type_ids(processor, model_ids).to(device),
        "pixel_values": pixel_values.to(device) if pixel_values is not None else None,
        "image_grid_thw": grid_thw.to(device) if grid_thw is not None else None,
    }


def _image_pads_as_pad(processor: ProcessorMixin, ids: Tensor, where: Tensor) -> Tensor:
    """`ids` with the image and video pad ids at `where` replaced by the pad token."""
    placeholder = (ids == processor.image_token_id) | (ids == processor.video_token_id)
    return torch.where(placeholder & where, torch.full_like(ids, processor.tokenizer.pad_token_id), ids)


def forward_logprobs(
    model: torch.nn.Module,
    processor: ProcessorMixin,
    batch: TrainBatch,
    device: torch.device | str = "cpu",
    temperature: float = 1.0,
    shared_prefix: bool = True,
) -> tuple[Tensor, Tensor]:
    """Log-prob of each next token under logits / temperature, and the scaled logits of the
    positions that predict a response token.

    Only what the response needs goes through the output projection: the prompt, with its image
    tokens, is most of a judge's sequence, and its [T, V] logits (kept for backward) would be
    most of the activation memory. With `shared_prefix` (and rows that share a prompt, as a
    GRPO group's samples do), each distinct prompt is forwarded once and its keys and values
    serve every response to it (`_shared_prefix_logits`): the same numbers as one forward per
    row, with a fraction of the compute.

    Args:
        model: a Qwen-VL judge or a causal LM (or a DeepSpeed engine wrapping one).
        batch: from `collate`, B rows of padded length T.
        temperature: the rollout's sampling temperature, so that the log-probs (and an entropy
            of the returned logits) are of the distribution the responses were sampled from.
        shared_prefix: forward a prompt that several rows share once (falls back to one forward
            per row when no prompt is shared, or under gradient checkpointing in training, which
            keeps no cache).

    Returns:
        (logp [B, T-1] float32, logits [N, V] detached): logp[:, t] = log pi_T(input_ids[:, t+1]
        | ...), so response_mask[:, 1:] selects the response tokens (other positions hold 0);
        the logits are those of the N positions where response_mask[:, 1:] > 0, in row-major
        order (for entropies and accuracies).
    """
    device = torch.device(device)
    predicts = batch.response_mask[:, 1:] > 0  # [B, T-1]: position t predicts a response token
    if shared_prefix and _can_share_prefix(model, batch):
        return _shared_prefix_logits(model, processor, batch, device, temperature)
    length = predicts.shape[1]
    hits = predicts.any(0).nonzero()
    first = int(hits[0]) if len(hits) else max(length - 1, 0)
    keep = length - first
    out = model(**_model_inputs(processor, batch, device), use_cache=False, logits_to_keep=keep + 1)
    logits = out.logits[:, :-1]  # [B, keep, V]: positions first .. T-2
    if temperature != 1.0:
        # In place: a second [B, K, V] tensor would double the largest activation. The lm_head's
        # backward does not read its output, so autograd allows it.
        logits.div_(temperature)
    kept = token_logprobs(logits, batch.input_ids[:, first + 1 :].to(device))
    logp = torch.cat([torch.zeros(kept.shape[0], first, dtype=kept.dtype, device=kept.device), kept], dim=1)
    return logp, logits.detach()[predicts[:, first:].to(device)]


def forwarded_positions(batch: TrainBatch, shared: bool) -> tuple[int, int]:
    """(padding positions, all positions) that `forward_logprobs` runs through the model for
    `batch`: B x T rows, or with a shared prefix U distinct prompts x P plus B responses x R."""
    if not shared:
        return int((batch.attention_mask == 0).sum()), batch.attention_mask.numel()
    heads, plens, rlens = _prefix_layout(batch)
    total = len(heads) * int(plens[heads].max()) + plens.numel() * max(int(rlens.max()), 1)
    return total - int(plens[heads].sum()) - int(rlens.sum()), total


def _prefix_layout(batch: TrainBatch) -> tuple[list[int], Tensor, Tensor]:
    """(the first row of each distinct prompt, prompt lengths [B], response lengths [B])."""
    plens = batch.prompt_lens
    return sorted(set(batch.prompt_group.tolist())), plens, batch.attention_mask.sum(-1) - plens


def _can_share_prefix(model: torch.nn.Module, batch: TrainBatch) -> bool:
    """Whether some rows share a prompt and the model can carry its keys and values over."""
    if batch.prompt_group is None or batch.prompt_lens is None:
        return False
    if len(set(batch.prompt_group.tolist())) == batch.prompt_group.numel() or int(batch.prompt_lens.min()) < 1:
        return False
    hf = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF (or PEFT) model
    return not (hf.training and getattr(hf, "is_gradient_checkpointing", False))


def _shared_prefix_logits(
    model: torch.nn.Module, processor: ProcessorMixin, batch: TrainBatch, device: torch.device, temperature: float
) -> tuple[Tensor, Tensor]:
    """`forward_logprobs` with each distinct prompt forwarded once.

    1. The U distinct prompts, left-padded to P tokens, go through the model with their images;
       it returns their keys and values and the logits at their last token (which predict each
       response's first token).
    2. The cache is indexed out to the B rows (autograd sums the rows' gradients into the one
       prompt forward), and the right-padded responses [B, R] are forwarded on top of it, with
       explicit positions that continue each prompt's (for Qwen-VL, its M-RoPE positions from
       the model's own `get_rope_index`), so every token sees the keys and positions it sees in
       the unshared forward.
    """
    B, T = batch.input_ids.shape
    pad_id = processor.tokenizer.pad_token_id
    heads, plens, rlens = _prefix_layout(batch)
    index = torch.tensor([heads.index(g) for g in batch.prompt_group.tolist()], dtype=torch.long)  # row -> prompt
    P, R = int(plens[heads].max()), max(int(rlens.max()), 1)

    ids = torch.full((len(heads), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(heads), P, dtype=torch.long)
    for u, h in enumerate(heads):
        n = int(plens[h])
        ids[u, P - n :], mask[u, P - n :] = batch.input_ids[h, :n], 1
    prompt: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
    if processor.image_token_id is not None:
        images = [h for h in heads if batch.image_grid_thw[h].numel() > 0]
        prompt["mm_token_type_ids"] = mm_token_type_ids(processor, ids)
        if images:
            prompt["pixel_values"] = torch.cat([batch.pixel_values[h] for h in images])
            prompt["image_grid_thw"] = torch.cat([batch.image_grid_thw[h] for h in images])
    # [3, U, P] for Qwen-VL (M-RoPE), [U, P] for a causal LM; following [U]: the position after each prompt
    prompt["position_ids"], following = prompt_positions(model, prompt)
    out = model(**{k: v.to(device) for k, v in prompt.items()}, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_select_indices(index.to(device))

    steps = torch.arange(R)
    real = steps[None, :] < rlens[:, None]  # [B, R]
    cols = (plens[:, None] + steps[None, :]).clamp(max=T - 1)
    response = torch.where(real, batch.input_ids.gather(1, cols), torch.full_like(cols, pad_id))
    fed = response
    if processor.image_token_id is not None:  # as in `_model_inputs`: a sampled image pad is fed as pad
        fed = _image_pads_as_pad(processor, response, real)
    positions = continued_positions(prompt["position_ids"], following[index], R)
    out2 = model(
        input_ids=fed.to(device), attention_mask=torch.cat([mask[index], real.long()], 1).to(device),
        position_ids=positions.to(device), past_key_values=cache, use_cache=True,
    )  # fmt: skip
    # logits[:, j] predicts response token j: the prompt's last logits, then the responses'.
    logits = torch.cat([out.logits[index.to(device)], out2.logits[:, : R - 1]], dim=1)  # [B, R, V]
    if temperature != 1.0:
        logits.div_(temperature)
    lp = token_logprobs(logits, response.to(device))  # [B, R]
    rows = torch.arange(B)[:, None].expand(B, R)
    at = (rows[real], cols[real] - 1)  # logp[:, t] predicts token t + 1
    logp = torch.zeros(B, T - 1, dtype=lp.dtype, device=device).index_put(
        tuple(i.to(device) for i in at), lp[real.to(device)]
    )
    trained = (batch.response_mask.gather(1, cols) > 0) & real
    return logp, logits.detach()[trained.to(device)]


def lr_multiplier(
    step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float
) -> float:
    """Learning-rate factor for optimizer step `step` (0 = the first update).

    Linear warmup (step + 1) / warmup_steps over the first `warmup_steps` updates (so the first
    update already moves), then 1.0 ("constant") or a half cosine from 1.0 down to
    `min_lr_ratio` at `total_steps` ("cosine"), held at the floor afterwards.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"unknown lr schedule {schedule!r}; expected constant or cosine")
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision encoder of a Qwen2/2.5/3-VL model (transformers 5: `model.model.visual`)."""
    for owner in (model, getattr(model, "model", None)):
        visual = getattr(owner, "visual", None) if owner is not None else None
        if isinstance(visual, torch.nn.Module):
            return visual
    return None


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; `extra` wins."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------------------------------------
# The rank
# ---------------------------------------------------------------------------------------------


class LearnerRank(WeightSender):
    """One DeepSpeed rank of the policy (and, when the KL term is on, of the reference model).

    Args:
        model_cfg, learner_cfg, algo_cfg: the run's config sections.
        model_path: HF directory of the initial judge (every rank loads it).
        rank, world_size: this rank and the data-parallel size.
        master_addr, master_port: rendezvous of the process group (rank 0's node, a free port).
        total_steps: optimizer steps of the whole run (the cosine schedule's length).
        grad_accum_steps: micro-batches per optimizer step on each rank, normally
            prompts_per_step * group_size / (ppo_mini_batches * num_ranks * micro_batch_size).
        norm_len: the constant length of the "seq-mean-token-sum-norm" aggregation (the
            configured max response length); None uses the padded micro-batch length.
        temperature: the rollout's sampling temperature (rollout.temperature); every log-prob
            and the entropy are of logits / temperature.
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
        num_threads: int = 0,
        rollout_cfg: RolloutConfig | None = None,
    ) -> None:
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        quiet_actor_warnings()
        self.temperature = temperature
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
        prepare_ops()  # DeepSpeed's JIT-built op: this environment's directory, no stale lock
        with quiet_prints():
            deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo", auto_mpi_discovery=False)

        self.zero3 = learner_cfg.zero_stage == 3
        ds_config = self._ds_config(ds_config_overrides or {})
        model, self.processor = load_judge(model_path, dtype=model_cfg.dtype, device=self.device, trainable=True)
        # A text-only judge has no vision tower, so there is nothing for freeze_vision to freeze.
        if model_cfg.freeze_vision and self.processor.image_token_id is not None:
            visual = _vision_tower(model)
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

        decay, no_decay = [], []
        for p in model.parameters():
            if p.requires_grad:
                # Biases and norm weights (1-D) are not decayed, the usual AdamW convention.
                (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [g for g in (
            {"params": decay, "weight_decay": learner_cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ) if g["params"]]  # fmt: skip
        # A plain torch AdamW: DeepSpeed's own Adam variants JIT-compile a C++/CUDA op first.
        optimizer = torch.optim.AdamW(groups, lr=learner_cfg.lr, betas=(0.9, 0.999), eps=1e-8)

        def schedule(step: int) -> float:
            return lr_multiplier(
                step, learner_cfg.warmup_steps, total_steps, learner_cfg.lr_schedule, learner_cfg.min_lr_ratio
            )

        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            # A callable, so the scheduler drives the optimizer DeepSpeed actually steps.
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
            config=ds_config,
            dist_init_required=False,
        )
        self.engine.train()

        self.ref: torch.nn.Module | None = None
        if algo_cfg.kl_coef > 0 and self.lora:
            # The frozen base weights are the reference: the policy with its adapters disabled.
            self.ref = self.engine
        elif algo_cfg.kl_coef > 0:
            ref_model, _ = load_judge(model_path, dtype=model_cfg.dtype, device=self.device, trainable=False)
            if self.zero3:
                # The reference is sharded like the policy: a ZeRO-3 engine without optimizer
                # (same partitioning settings, nothing optimizer-related).
                ref_config = {
                    "train_micro_batch_size_per_gpu": learner_cfg.micro_batch_size,
                    "train_batch_size": learner_cfg.micro_batch_size * world_size,
                    "bf16": ds_config["bf16"],
                    "zero_optimization": {
                        k: v for k, v in ds_config["zero_optimization"].items() if not k.startswith("offload_optimizer")
                    },
                    "steps_per_print": ds_config["steps_per_print"],
                }
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

    def _ds_config(self, overrides: dict[str, Any]) -> dict[str, Any]:
        lc = self.learner_cfg
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": lc.micro_batch_size,
            "gradient_accumulation_steps": self.grad_accum_steps,
            "train_batch_size": lc.micro_batch_size * self.grad_accum_steps * self.world_size,
            "gradient_clipping": lc.grad_clip,
            "zero_optimization": {"stage": lc.zero_stage},
            "bf16": {"enabled": bool(lc.bf16)},
            # Required to pass a torch optimizer under ZeRO (see __init__).
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        return _merge(config, overrides)

    # -----------------------------------------------------------------------------------------
    # Forward passes
    # -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, experiences: Sequence[Experience], which: str = "policy") -> list[tuple[float, ...]]:
        """Per-response-token log-probs under the policy or the reference model, no grad.

        Runs ceil(len / micro_batch_size) forwards whatever the content, so ranks given shards
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
                results: list[tuple[float, ...]] = []
                mbs = self.learner_cfg.micro_batch_size
                for start in range(0, len(experiences), mbs):
                    chunk = experiences[start : start + mbs]
                    batch = collate(self.processor, chunk)
                    logp, _ = forward_logprobs(model, self.processor, batch, self.device, self.temperature, self.learner_cfg.shared_prefix)
                    logp = logp.float().cpu()
                    mask = batch.response_mask[:, 1:].bool()
                    results.extend(tuple(logp[i][mask[i]].tolist()) for i in range(len(chunk)))
                return results
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
            metrics, identical on every rank (they are all-reduced): actor/pg_loss and
            actor/kl_loss (the full mini-batch values), token means over the mini-batch of
            actor/entropy, actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl; actor/grad_norm
            (before clipping), actor/lr (the rate this step used), actor/num_tokens and
            actor/num_seqs (mini-batch totals), perf/padding_fraction (padding positions over
            all forwarded positions). When experiences carry `rollout_logprobs`, also
            rollout/logprob_diff_mean and rollout/logprob_diff_max: |learner - rollout engine|
            per response token (before this step's update), over the tokens that have one.
        """
        if len(experiences) < self.grad_accum_steps:
            raise ValueError(
                f"train_step: {len(experiences)} experiences cannot fill {self.grad_accum_steps} micro-batches"
            )
        kl_coef = self.algo_cfg.kl_coef
        if kl_coef > 0:
            missing = [i for i, e in enumerate(experiences) if e.response_ids and e.ref_logprobs is None]
            if missing:
                raise ValueError(
                    f"train_step: algo.kl_coef={kl_coef} but experiences {missing[:5]} have no ref_logprobs; "
                    "fill them with compute_logprobs(..., 'ref') first"
                )
        dual_clip = self.algo_cfg.dual_clip if self.algo_cfg.dual_clip > 0 else None
        lr = float(self.engine.get_lr()[0])

        # Sums over this rank's micro-batches: [pg_loss, kl_loss, tokens, seqs,
        # entropy*tokens, clipfrac*tokens, clipfrac_lower*tokens, ppo_kl*tokens,
        # |logp - rollout logp| summed, tokens with a rollout logp, padding positions, all
        # positions]; and that difference's max.
        sums = torch.zeros(12, dtype=torch.float64)
        diff_max = torch.zeros(1, dtype=torch.float64)
        self.engine.train()
        manual_grad_norm: float | None = None
        chunks = split_evenly(experiences, self.grad_accum_steps)
        for index, chunk in enumerate(chunks):
            batch = collate(self.processor, chunk)
            shared = self.learner_cfg.shared_prefix and _can_share_prefix(self.engine, batch)
            logp, logits = forward_logprobs(self.engine, self.processor, batch, self.device, self.temperature, shared)
            mask = batch.response_mask[:, 1:].to(self.device)
            old = batch.old_logprobs[:, 1:].to(self.device)
            # NaN marks "no rollout log-prob": on-policy, so the ratio is exactly 1.
            old = torch.where(torch.isnan(old), logp.detach(), old)
            ref = None
            if kl_coef > 0:
                if batch.ref_logprobs is None:
                    # Only dummies here (checked above): no response token, so KL is 0 anyway.
                    ref = logp.detach()
                else:
                    # Rows without ref log-probs (dummies) are NaN on no position that counts.
                    ref = torch.where(mask > 0, batch.ref_logprobs[:, 1:].to(self.device), logp.detach())
            loss, metrics = grpo_loss(
                logp, old, ref, batch.advantages.to(self.device), mask,
                kl_coef=kl_coef, clip_low=self.algo_cfg.clip_low, clip_high=self.algo_cfg.clip_high,
                dual_clip=dual_clip, agg=self.algo_cfg.loss_agg, global_tokens=float(global_tokens),
                global_seqs=float(global_seqs), dp_size=self.world_size, norm_len=self.norm_len,
            )  # fmt: skip
            with torch.no_grad():
                on_mask = mask > 0
                tokens = float(on_mask.sum())
                # Entropy of the response positions only: [n_tokens, V], not [B, T, V].
                entropy_sum = float(entropy_from_logits(logits).sum())
                seqs = float(on_mask.any(-1).sum())
                diff_sum, diff_count = 0.0, 0.0
                if batch.rollout_logprobs is not None:
                    rollout = batch.rollout_logprobs[:, 1:].to(self.device)
                    diffs = (logp.detach().double() - rollout)[on_mask & ~torch.isnan(rollout)].abs()
                    diff_sum, diff_count = float(diffs.sum()), float(diffs.numel())
                    if diffs.numel():
                        diff_max = torch.maximum(diff_max, diffs.max().cpu().reshape(1))
            del logits

            # The aggregation already normalises by the global counts; DeepSpeed must not
            # divide by the accumulation steps again.
            self.engine.backward(loss, scale_wrt_gas=False)
            if index == len(chunks) - 1 and self.learner_cfg.zero_stage == 0:
                # Without ZeRO (fp32) DeepSpeed clips but does not keep the norm; the gradients
                # are already all-reduced after the boundary backward, so measure them here.
                manual_grad_norm = self._grad_norm()
            self.engine.step()

            sums += torch.tensor([
                metrics["pg_loss"], metrics["kl_loss"], tokens, seqs, entropy_sum,
                metrics["pg_clipfrac"] * tokens, metrics["pg_clipfrac_lower"] * tokens,
                metrics["ppo_kl"] * tokens, diff_sum, diff_count,
                *map(float, forwarded_positions(batch, shared)),
            ], dtype=torch.float64)  # fmt: skip
            del logp, loss

        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None:
            grad_norm = manual_grad_norm if manual_grad_norm is not None else math.nan
        grad_norm = float(grad_norm)

        totals = sums.to(self.device)
        diff_max = diff_max.to(self.device)
        if self.world_size > 1:
            self._ds.comm.all_reduce(totals)
            self._ds.comm.all_reduce(diff_max, op=torch.distributed.ReduceOp.MAX)
        totals = totals.cpu().tolist()
        tokens = max(totals[2], 1.0)
        rollout = {}
        if totals[9] > 0:
            rollout = {"rollout/logprob_diff_mean": totals[8] / totals[9], "rollout/logprob_diff_max": float(diff_max)}
        return {
            # Each rank's sum is its share times dp_size (see grpo.aggregate): average ranks.
            "actor/pg_loss": totals[0] / self.world_size,
            "actor/kl_loss": totals[1] / self.world_size,
            "actor/entropy": totals[4] / tokens,
            "actor/pg_clipfrac": totals[5] / tokens,
            "actor/pg_clipfrac_lower": totals[6] / tokens,
            "actor/ppo_kl": totals[7] / tokens,
            "actor/grad_norm": grad_norm,
            "actor/lr": lr,
            "actor/num_tokens": totals[2],
            "actor/num_seqs": totals[3],
            # Share of the forwarded positions that were padding (rows padded to the longest; with
            # a shared prefix, prompts to the longest prompt and responses to the longest response).
            "perf/padding_fraction": totals[10] / max(totals[11], 1.0),
            **rollout,
        }

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
        if len(experiences) < self.grad_accum_steps:
            raise ValueError(f"sft_step: {len(experiences)} experiences cannot fill {self.grad_accum_steps} micro-batches")
        lr = float(self.engine.get_lr()[0])
        sums = torch.zeros(3, dtype=torch.float64)  # [loss, tokens, right]
        self.engine.train()
        manual_grad_norm: float | None = None
        chunks = split_evenly(experiences, self.grad_accum_steps)
        for index, chunk in enumerate(chunks):
            batch = collate(self.processor, chunk)
            logp, logits = forward_logprobs(self.engine, self.processor, batch, self.device, shared_prefix=self.learner_cfg.shared_prefix)
            mask = batch.response_mask[:, 1:].to(self.device)
            loss = sft_loss(logp, mask, float(global_tokens), self.world_size)
            with torch.no_grad():
                on = mask > 0
                targets = batch.input_ids[:, 1:].to(self.device)[on]
                right = float((logits.argmax(-1) == targets).sum())
                sums += torch.tensor([float(-(logp.detach() * mask).sum()), float(on.sum()), right], dtype=torch.float64)
            del logits
            self.engine.backward(loss, scale_wrt_gas=False)
            if index == len(chunks) - 1 and self.learner_cfg.zero_stage == 0:
                manual_grad_norm = self._grad_norm()
            self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None:
            grad_norm = manual_grad_norm if manual_grad_norm is not None else math.nan
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
        GPU, for a colocated engine that wakes into it next; a no-op on CPU."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _grad_norm(self) -> float | None:
        """L2 norm of the trainable parameters' .grad (None when no gradient is held there)."""
        grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else None

    # -----------------------------------------------------------------------------------------
    # Weights out: HF export (weight sync and checksums come from WeightSender, pjray.rl.sync)
    # -----------------------------------------------------------------------------------------

    def save_hf(self, path: str) -> None:
        """Write an HF model directory (weights, config, processor) at `path` from rank 0.

        Loadable by `transformers` and by `load_judge`. With LoRA the weights are merged, and the
        adapter itself is written to `<path>/adapter` (PEFT's format, e.g. for vLLM's LoRA
        serving). Call on all ranks (ZeRO-3 gathers).
        """
        state: dict[str, Tensor] = {}
        for _, tensors in self._full_buckets(256 << 20):
            if self.rank == 0:
                state.update({name: t.detach().cpu().clone() for name, t in tensors.items()})
        if self.lora:
            adapters = [p for n, p in self.engine.module.named_parameters() if ".lora_" in n]
            gathered = self._ds.zero.GatheredParameters(adapters, modifier_rank=None) if self.zero3 else contextlib.nullcontext()
            with gathered:
                if self.rank == 0:
                    self.engine.module.save_pretrained(os.path.join(path, "adapter"))
        if self.rank == 0:
            module: PreTrainedModel = base_model(self.engine.module)
            module.save_pretrained(path, state_dict=state)
            self.processor.save_pretrained(path)
        if self.world_size > 1:
            # Nobody reads the directory before it is complete.
            self._ds.comm.barrier()

    # -----------------------------------------------------------------------------------------
    # Checkpoints and lifecycle
    # -----------------------------------------------------------------------------------------

    def save_checkpoint(self, path: str, client_state: dict[str, Any] | None = None) -> None:
        """Model, optimizer and LR-scheduler state of every rank under `path` (shared storage).

        `client_state` (e.g. the trainer's step and RNG) is stored with it and returned by
        `load_checkpoint`. Call on all ranks.
        """
        # Nested under one key: DeepSpeed returns its own bookkeeping (module state, config,
        # ...) in the same dict on load, and the caller should get back only what it saved.
        self.engine.save_checkpoint(path, client_state={_CLIENT_STATE_KEY: dict(client_state or {})})

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore what `save_checkpoint` wrote (the latest tag under `path`); returns client_state."""
        load_path, client_state = self.engine.load_checkpoint(
            path, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {path}")
        return dict((client_state or {}).get(_CLIENT_STATE_KEY, {}))

    def ready(self) -> bool:
        return True

    def shutdown(self) -> None:
        """Tear down the process group (so a later rank in the same process can rejoin)."""
        self.engine = None  # type: ignore[assignment]
        self.ref = None
        if torch.distributed.is_initialized():
            self._ds.comm.destroy_process_group()
