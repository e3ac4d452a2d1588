"""`trainer.*`: the training loop (steps, checkpoints, exports, weight sync, async rollouts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pjray.config.fields import ConfigError, opt


@dataclass(frozen=True)
class TrainerConfig:
    steps: int = opt(40, gt=0)
    prompts_per_step: int = opt(8, gt=0)
    seed: int = 0
    run_dir: str = "runs/demo"
    save_every: int = opt(10, ge=0)  # 0: only at the end
    keep_checkpoints: int = opt(2, gt=0)
    resume: str = "auto"  # auto | disable | a checkpoint directory
    export_hf: bool = True
    # Also write the HF judge at these steps, into <run_dir>/hf_model_step_<N>: the judges of a
    # learning curve (e.g. [10, 20, 40]), each judged afterwards like the final one.
    export_steps: list[int] = field(default_factory=list)
    # Keep the judge of the best validation so far: a metric the evaluation hook logs every
    # eval.every_steps steps (e.g. eval/vl_rewardbench/gap with eval.train_bench=vl_rewardbench
    # and eval.blind=[mismatched]); the judge is written to <run_dir>/hf_model_best and its step
    # and value to best.json and the run's summary. Empty: off.
    keep_best: str = ""
    # Whether a larger or a smaller keep_best value is better.
    keep_best_mode: str = opt("max", choices=("max", "min"))
    sync_bucket_mb: int = opt(64, gt=0)
    # How weights reach the rollout engines: shm (shared memory: every engine on learner rank
    # 0's node), object_store (Ray objects; any layout), gloo or nccl (a broadcast group of
    # learner rank 0 + every engine rank; nccl needs split GPUs), ipc (CUDA IPC handles,
    # colocated GPUs only); auto: ipc for colocated vLLM engines, nccl for vLLM engines and
    # learner on GPUs of their own, else shm when every engine is on rank 0's node, else
    # object_store (the run's log says which; pjray.sync.transports.auto_transport).
    sync_backend: str = opt("auto", choices=("auto", "shm", "object_store", "gloo", "nccl", "ipc"))
    max_step_retries: int = opt(2, ge=0)  # a step is retried when a rollout or reward worker dies
    # Async rollouts: the rollout workers generate the batches of steps t+1 .. t+k while the
    # learner trains step t, so a batch is trained on by weights k versions newer than those
    # that sampled it (rollout/staleness_*; correct the gap with algo.rollout_is). 0: the
    # synchronous loop. Split layouts only (hf or vllm workers on cores or GPUs of their own).
    max_staleness: int = opt(0, ge=0)

    def check(self) -> None:
        """The steps that write a judge, and the checkpoint to resume from."""
        outside = [s for s in self.export_steps if not 1 <= s <= self.steps]
        if outside:
            raise ConfigError(f"trainer.export_steps: {outside} outside the run's steps 1..{self.steps}")
        if self.resume not in ("auto", "disable") and not Path(self.resume).is_dir():
            raise ConfigError(f"trainer.resume={self.resume!r}: not auto, disable or a directory")
