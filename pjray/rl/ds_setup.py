"""What a learner rank hands DeepSpeed: its config, the optimizer, the learning-rate schedule and
the reference model's config. Pure functions of the run's config sections.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pjray.config import LearnerConfig


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
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


def ds_config(lc: LearnerConfig, grad_accum_steps: int, world_size: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """The policy engine's DeepSpeed config; learner.ds_config merged in, then `overrides`."""
    zero: dict[str, Any] = {"stage": lc.zero_stage}
    if lc.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if lc.offload == "all":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": lc.micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": lc.micro_batch_size * grad_accum_steps * world_size,
        "gradient_clipping": lc.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": bool(lc.bf16)},
        # Required to pass a torch optimizer under ZeRO (see `optimizer`).
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    return merge(merge(config, lc.ds_config), overrides)


def ref_ds_config(policy: dict[str, Any], lc: LearnerConfig, world_size: int) -> dict[str, Any]:
    """A ZeRO-3 reference model sharded over the policy's ranks (with the policy's partitioning
    settings where it is ZeRO-3 itself): nothing optimizer-related."""
    return {
        "train_micro_batch_size_per_gpu": lc.micro_batch_size,
        "train_batch_size": lc.micro_batch_size * world_size,
        "bf16": policy["bf16"],
        "zero_optimization": {
            **{k: v for k, v in policy["zero_optimization"].items() if not k.startswith("offload_optimizer")},
            "stage": 3,
        },
        "steps_per_print": policy["steps_per_print"],
    }


def optimizer(model: torch.nn.Module, lc: LearnerConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; biases and norm weights (1-D) are not decayed, the
    usual convention. A plain torch AdamW: DeepSpeed's own Adam variants JIT-compile a C++/CUDA
    op first; with learner.offload the states live in CPU memory, which DeepSpeed steps with its
    CPU Adam, and ZeRO-3 with learner.offload_during_generation needs its FusedAdam (the same
    AdamW update)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        g
        for g in (
            {"params": decay, "weight_decay": lc.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        )
        if g["params"]
    ]
    if lc.offload != "none":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=lc.lr, betas=(0.9, 0.999), eps=1e-8, adamw_mode=True)
    if lc.offload_during_generation and lc.zero_stage == 3:
        # ZeRO-3 moves its optimizer states off the GPU (`engine.offload_states`) only when the
        # optimizer is DeepSpeed's FusedAdam (a CUDA op; offload during generation is GPU-only).
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, lr=lc.lr, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True)
    return torch.optim.AdamW(groups, lr=lc.lr, betas=(0.9, 0.999), eps=1e-8)


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; `extra` wins."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
