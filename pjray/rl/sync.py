"""Learner -> vLLM weight transports: a broadcast group (gloo / NCCL) and CUDA IPC handles.

The object-store transport (`LearnerRank.export_weights` + `RolloutEngine.load_weights`) works
for every layout and is the CPU path. The two here are for vLLM engines, one implementation
each, shared by the sending learner and the receiving vLLM worker extension
(`pjray.rl.vllm_engine.WeightSyncExtension`):

* Broadcast (`trainer.sync_backend=nccl`, or `gloo`): a process group of learner rank 0 plus
  every vLLM rank (world = 1 + engines x tensor_parallel_size), built on its own TCP store so it
  never touches DeepSpeed's default group. Rank 0 packs each bucket (`weights.pack`) and
  broadcasts the flat buffer; each vLLM rank receives it into an empty buffer and loads it. One
  collective per bucket, one RPC per engine per sync. NCCL for engines on their own GPUs (NCCL
  refuses two ranks of one communicator on the same GPU); gloo is the same code on CPU tensors.
* IPC (`trainer.sync_backend=ipc`, colocated): learner rank i packs every bucket on its GPU
  and hands CUDA IPC handles to engine i on the same GPU, which maps them without a copy over
  the wire and loads them. Costs one extra copy of the weights in GPU memory until the engine
  has loaded them (`release` frees it); one RPC per engine per sync.

Under ZeRO-3 the learner gathers parameters bucket by bucket (`LearnerRank._full_buckets`),
so every learner rank must take part in a sync, even though only rank 0 (broadcast) sends.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pjray.rl.weights import Bucket, pack

__all__ = [
    "WeightSyncGroup",
    "broadcast_buckets",
    "dumps",
    "ipc_handles",
    "loads",
    "open_ipc_handle",
    "receive_buckets",
]

_STORE_PREFIX = "pjray/weight-sync"


def dumps(value: Any) -> bytes:
    """Plans and IPC handles cross vLLM's RPC as bytes: its encoder takes only plain types."""
    return pickle.dumps(value)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


class WeightSyncGroup:
    """A process group of learner rank 0 (rank 0, hosting the store) and the engines' ranks.

    Built from a private `TCPStore`, not `init_process_group`: the learner already has
    DeepSpeed's default group and a vLLM worker has vLLM's, and neither may be disturbed.

    Args:
        host, port: where rank 0 (the learner) listens; every member passes the same pair.
        rank, world_size: this member's rank; 1 + engines x tensor_parallel_size members.
        backend: "nccl" (CUDA tensors) or "gloo" (CPU tensors).
    """

    def __init__(
        self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float = 600.0
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight-sync backend must be gloo or nccl, got {backend!r}")
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore(_STORE_PREFIX, store)
        if backend == "nccl":
            self.group: Any = dist.ProcessGroupNCCL(prefixed, rank, world_size)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            self.device = torch.device("cpu")
        self._store = store  # keep the store (rank 0 serves it) alive with the group

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        """In-place broadcast of `tensor` from member `src` (a collective on every member)."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        self.group.broadcast([tensor], options).wait()

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self.group = None


def broadcast_buckets(
    group: WeightSyncGroup | None, buckets: Iterable[tuple[Bucket, dict[str, Tensor]]]
) -> list[Bucket]:
    """Sender side: pack each bucket and broadcast it from rank 0; returns the plan sent.

    Every learner rank iterates `buckets` (ZeRO-3 gathers are collective); only the rank that
    holds `group` (learner rank 0) packs and sends.
    """
    plan: list[Bucket] = []
    for bucket, tensors in buckets:
        plan.append(bucket)
        if group is None:
            continue
        flat = pack(bucket, tensors).to(group.device)
        group.broadcast(flat, src=0)
        del flat
    return plan


def receive_buckets(
    group: WeightSyncGroup, plan: list[Bucket], load: Callable[[Bucket, Tensor], None]
) -> None:
    """Receiver side: for each bucket of `plan`, receive its flat buffer and `load` it."""
    for bucket in plan:
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=group.device)
        group.broadcast(flat, src=0)
        load(bucket, flat)
        del flat


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
