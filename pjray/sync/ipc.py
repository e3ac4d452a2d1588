"""CUDA IPC handles of packed buckets: the colocated transport, learner rank i to the engine on
its GPU."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from pjray.sync.buckets import Bucket, pack

__all__ = ["ipc_handles", "open_ipc_handle"]


def ipc_handles(
    buckets: Iterable[tuple[Bucket, dict[str, Tensor]]], keep: list[Tensor]
) -> tuple[list[Bucket], list[Any]]:
    """Sender side of the colocated path: pack every bucket on its CUDA device, return handles.

    The packed buffers are appended to `keep`: the sender must hold them until the receiver has
    loaded (the handles point into them), then clear `keep`.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    plan: list[Bucket] = []
    handles: list[Any] = []
    for bucket, tensors in buckets:
        flat = pack(bucket, tensors)
        if flat.device.type != "cuda":
            raise ValueError("ipc_handles: CUDA IPC needs the learner's weights on a GPU")
        keep.append(flat)
        plan.append(bucket)
        handles.append(reduce_tensor(flat))
    torch.cuda.synchronize()  # the receiver reads the buffers from another process
    return plan, handles


def open_ipc_handle(handle: Any, device_index: int) -> Tensor:
    """Receiver side: map a handle from `ipc_handles` as a tensor on this process's GPU.

    The handle records the sender's device index; both processes see the shared GPU, but
    possibly under different indices, so the receiver's own index is put in its place.
    """
    rebuild, args = handle
    args = list(args)
    args[6] = device_index  # rebuild_cuda_tensor(..., storage_device, ...)
    return rebuild(*args)
