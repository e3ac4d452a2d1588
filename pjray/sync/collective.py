"""The broadcast group of learner rank 0 and the vLLM ranks (gloo on CPU, NCCL on GPUs), and how
a bucket plan crosses it."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pjray.sync.buckets import Bucket, pack

__all__ = ["WeightSyncGroup", "broadcast_buckets", "dumps", "loads", "nccl_options", "receive_buckets"]

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
        where = f"weight-sync group ({backend}, rank {rank} of {world_size}, store {host}:{port}, timeout {timeout_s:g}s)"
        try:
            store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
            prefixed = dist.PrefixStore(_STORE_PREFIX, store)
            if backend == "nccl":
                self.group: Any = dist.ProcessGroupNCCL(prefixed, rank, world_size, nccl_options(timeout))
                self.device = torch.device("cuda", torch.cuda.current_device())
            else:
                self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
                self.device = torch.device("cpu")
            # NCCL builds its communicator at the first collective: run one now, so a group that
            # cannot work fails at set-up, naming itself, and not at the end of the first step.
            self.broadcast(torch.zeros(1, device=self.device))
        except (RuntimeError, dist.DistError) as err:
            raise RuntimeError(f"{where}: could not form the group or run its first collective: {err}") from err
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


def nccl_options(timeout: timedelta) -> Any:
    """`ProcessGroupNCCL.Options` with an explicit collective timeout, set as torch's own
    `new_group` sets it (`_timeout`): a sync peer that died fails the collective after
    `timeout` instead of leaving the learner blocked."""
    if not dist.is_nccl_available():
        raise RuntimeError("trainer.sync_backend=nccl: this torch has no NCCL (a CPU build?); use gloo on CPU")
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    return options


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
