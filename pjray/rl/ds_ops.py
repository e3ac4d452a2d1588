"""DeepSpeed's JIT-built ops on a learner rank: none is built.

When a process creates its communication backend, DeepSpeed (on CPU) JIT-compiles its
shared-memory collective (`deepspeed_shm_comm`) with `torch.utils.cpp_extension`: 1-3 min on
2 cores the first time in an environment, a load at every later start, and a `lock` file that a
build killed mid-way leaves behind, on which every later build waits without a limit. The op
serves one call, `inference_all_reduce` (the all-reduce of DeepSpeed's tensor-parallel inference
layers), which falls back to the process group's all-reduce without it; ZeRO training's
collectives never use it. pjray's learner runs no tensor-parallel inference layer, so the op is
marked as not buildable here before `deepspeed.init_distributed`, the one check DeepSpeed makes
before building it. The optimizer is torch's AdamW (see `ds_setup.optimizer`), so no other op is
built either.
"""

from __future__ import annotations

SHM_BUILDER = "ShareMemCommBuilder"


def skip_unused_ops() -> list[str]:
    """Marks the ops a learner rank never calls as not buildable; returns their names. Call after
    DS_ACCELERATOR is set and before `deepspeed.init_distributed`."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(SHM_BUILDER)
    if builder is None:
        return []  # an accelerator without the op (CUDA)
    deepspeed.ops.__compatible_ops__[builder.NAME] = False
    return [builder.NAME]
