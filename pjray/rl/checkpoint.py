"""Checkpoints: a learner rank's weights out (the HF export and DeepSpeed checkpoints), and the
run directory's checkpoints (which one a run resumes from, how many it keeps).

`RankCheckpoints` is a part of `pjray.rl.learner.LearnerRank` (as `pjray.sync.sender.WeightSender`
is): it writes the rank's `pjray.rl.policy.PolicyModel`, whose full weights it reads bucket by
bucket through the sender (`WeightSender.full_buckets`). Every method is called on all ranks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from pjray.models.loading import save_judge
from pjray.models.lora import base_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from pjray.rl.policy import PolicyModel
    from pjray.sync.sender import WeightSender

_CLIENT_STATE_KEY = "pjray_client_state"


def completed_checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoints whose writing finished (their COMPLETE file is written last), oldest first."""
    done = [p.parent for p in (run_dir / "checkpoints").glob("global_step_*/COMPLETE")]
    return sorted(done, key=lambda p: int(p.name.rsplit("_", 1)[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = completed_checkpoints(run_dir)
    return done[-1] if done else None


def checkpoint_to_resume(resume: str, run_dir: Path) -> Path | None:
    """What trainer.resume names: nothing (disable), the run's latest checkpoint (auto, if any),
    or a checkpoint directory, which must be complete."""
    if resume == "disable":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not (path / "COMPLETE").exists():
        raise FileNotFoundError(f"trainer.resume={resume}: not a complete checkpoint directory")
    return path


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints."""
    for old in completed_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


class RankCheckpoints:
    """HF export (`save_hf`) and DeepSpeed checkpoints (`save_checkpoint`, `load_checkpoint`) of
    one rank's policy."""

    def __init__(self, model: PolicyModel, weights: WeightSender) -> None:
        self.model, self.weights = model, weights

    def save_hf(self, path: str) -> None:
        """Write an HF model directory (weights, config, processor) at `path` from rank 0.

        Loadable by `transformers` and by `load_judge`. With LoRA the weights are merged, and the
        adapter itself is written to `<path>/adapter` (PEFT's format, e.g. for vLLM's LoRA
        serving). Call on all ranks (ZeRO-3 gathers).
        """
        m = self.model
        state: dict[str, Tensor] = {}
        for _, tensors in self.weights.full_buckets(256 << 20):
            if m.rank == 0:
                state.update({name: t.detach().cpu().clone() for name, t in tensors.items()})
        if m.lora:
            adapters = [p for n, p in m.engine.module.named_parameters() if ".lora_" in n]
            gathered = (
                m.ds.zero.GatheredParameters(adapters, modifier_rank=None) if m.zero3 else contextlib.nullcontext()
            )
            with gathered:
                if m.rank == 0:
                    m.engine.module.save_pretrained(os.path.join(path, "adapter"))
        if m.rank == 0:
            module: PreTrainedModel = base_model(m.engine.module)
            save_judge(module, path, state)
            m.processor.save_pretrained(path)
        if m.world_size > 1:
            # Nobody reads the directory before it is complete.
            m.ds.comm.barrier()

    def save_checkpoint(self, path: str, client_state: dict[str, Any] | None = None) -> None:
        """Model, optimizer and LR-scheduler state of every rank under `path` (shared storage).

        `client_state` (e.g. the trainer's step and RNG) is stored with it and returned by
        `load_checkpoint`. Call on all ranks.
        """
        # Nested under one key: DeepSpeed returns its own bookkeeping (module state, config,
        # ...) in the same dict on load, and the caller should get back only what it saved.
        self.model.states_on_gpu()
        self.model.engine.save_checkpoint(path, client_state={_CLIENT_STATE_KEY: dict(client_state or {})})

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore what `save_checkpoint` wrote (the latest tag under `path`); returns client_state."""
        self.model.states_on_gpu()
        load_path, client_state = self.model.engine.load_checkpoint(
            path, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {path}")
        return dict((client_state or {}).get(_CLIENT_STATE_KEY, {}))
