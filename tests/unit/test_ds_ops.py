"""A learner rank has DeepSpeed build none of its JIT ops."""

from __future__ import annotations

import os

import torch


def test_deepspeed_builds_no_shared_memory_op_once_it_is_marked_unused(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
    from deepspeed.comm.torch import build_shm_op

    from pjray.rl.ds_ops import skip_unused_ops

    skipped = skip_unused_ops()
    if torch.cuda.is_available():
        assert skipped == []  # no such op on CUDA
    else:
        assert skipped == ["deepspeed_shm_comm"]
    assert build_shm_op() is None  # what DeepSpeed's backend calls at init_distributed
