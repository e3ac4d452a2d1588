"""The broadcast group of learner rank 0 and the vLLM ranks (gloo on CPU, NCCL on GPUs), and how
a bucket plan crosses it."""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pjray.sync.buckets import Bucket, pack

__all__ = [
    "JOIN_S",
    "GroupAddress",
    "SyncStalled",
    "WeightSyncGroup",
    "broadcast_buckets",
    "dumps",
    "loads",
    "nccl_options",
    "receive_buckets",
]

_STORE_PREFIX = "pjray/weight-sync"
_ALL_JOINED = "joined/all"  # rank 0's word that every member has joined
JOIN_S = 120.0  # how long forming a group waits for its members, by default
# Gloo groups dropped with a collective in flight (`WeightSyncGroup.abort`).
_ABANDONED: list[Any] = []


def dumps(value: Any) -> bytes:
    """Plans and IPC handles cross vLLM's RPC as bytes: its encoder takes only plain types."""
    return pickle.dumps(value)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


class SyncStalled(RuntimeError):
    """A collective of the weight-sync group did not complete in time: a member died or never
    took part. The group has been torn down; the transport forms a new one."""


@dataclass(frozen=True)
class GroupAddress:
    """What every member of a broadcast group is told to join it (the driver's
    `BroadcastTransport.connect`): rank 0's store, the group's size and backend, each rank's
    name for errors, and how long forming it may wait for its members."""

    host: str
    port: int
    world_size: int
    backend: str
    members: tuple[str, ...] = ()
    join_s: float = JOIN_S

    def join(self, rank: int) -> WeightSyncGroup:
        """Join as `rank` (rank 0 hosts the store); returns the formed group."""
        return WeightSyncGroup(
            self.host, self.port, rank, self.world_size, self.backend, join_s=self.join_s, members=self.members
        )


class WeightSyncGroup:
    """A process group of learner rank 0 (rank 0, hosting the store) and the engines' ranks.

    Built from a private `TCPStore`, not `init_process_group`: the learner already has
    DeepSpeed's default group and a vLLM worker has vLLM's, and neither may be disturbed.

    Forming it is bounded by `join_s` and names who is missing: each member first marks itself
    joined in the store; rank 0 waits for every mark and reports the members whose mark never
    came, then tells the others to go on; a member waits for that word (or for rank 0's store)
    no longer than `join_s` either. Only then is the backend's group built and its first
    collective run (NCCL builds its communicator there), with every member known to be present.

    Args:
        host, port: where rank 0 (the learner) listens; every member passes the same pair.
        rank, world_size: this member's rank; 1 + engines x tensor_parallel_size members.
        backend: "nccl" (CUDA tensors) or "gloo" (CPU tensors).
        timeout_s: the backend's own timeout.
        wait_s: how long one broadcast may take on this member before it counts as stalled
            (`broadcast`); below the driver's patience with a sync that lost a member.
        join_s: how long forming the group may wait for its members.
        members: each rank's name in errors (e.g. "rollout worker 1"); empty: "rank r".
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float = 600.0,
        wait_s: float = 60.0,
        join_s: float = JOIN_S,
        members: Sequence[str] = (),
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight-sync backend must be gloo or nccl, got {backend!r}")
        if members and len(members) != world_size:
            raise ValueError(f"weight-sync group: {len(members)} member names for {world_size} ranks")
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend, self.wait_s = rank, world_size, backend, wait_s
        self.members = tuple(members)
        self.where = where = (
            f"weight-sync group ({backend}, rank {rank} of {world_size}, store {host}:{port}, timeout {timeout_s:g}s)"
        )
        try:
            store = dist.TCPStore(
                host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=join_s), wait_for_workers=False
            )
        except (RuntimeError, dist.DistError) as err:
            raise RuntimeError(
                f"{where}: could not reach the store of {self.member(0)} within {join_s:g}s: {err}"
            ) from err
        prefixed = dist.PrefixStore(_STORE_PREFIX, store)
        self._store = store  # keep the store (rank 0 serves it) alive with the group
        self._join(prefixed, join_s)
        try:
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

    def member(self, rank: int) -> str:
        """Member `rank` as errors name it: "rollout worker 1 (rank 3)", or "rank 3" unnamed."""
        return f"{self.members[rank]} (rank {rank})" if self.members else f"rank {rank}"

    def _join(self, store: Any, join_s: float) -> None:
        """Mark this member joined; on rank 0 wait for every mark (naming the members still
        missing at `join_s`) and then say so; elsewhere wait for rank 0 to say so."""
        store.set(f"joined/{self.rank}", "1")
        if self.rank != 0:
            try:
                store.wait([_ALL_JOINED], timedelta(seconds=join_s))
            except (RuntimeError, dist.DistError) as err:
                raise RuntimeError(
                    f"{self.where}: {self.member(0)} did not see every member join within {join_s:g}s "
                    f"(its error names who is missing): {err}"
                ) from err
            return
        deadline = time.monotonic() + join_s
        missing = list(range(1, self.world_size))
        while missing:
            missing = [r for r in missing if not store.check([f"joined/{r}"])]
            if missing and time.monotonic() > deadline:
                names = ", ".join(self.member(r) for r in missing)
                raise RuntimeError(f"{self.where}: never joined within {join_s:g}s: {names}")
            if missing:
                time.sleep(0.05)
        store.set(_ALL_JOINED, "1")

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        """In-place broadcast of `tensor` from member `src` (a collective on every member).

        Bounded: NCCL's `wait()` only orders this stream behind the collective, so a member
        that died leaves the others "done" with streams that hang until NCCL's watchdog kills
        the process. The collective's completion is polled instead (a CUDA event query for
        NCCL); past `wait_s` the group is aborted and `SyncStalled` raised. Gloo's errors
        surface from `wait()` as before."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        work = self.group.broadcast([tensor], options)
        deadline = time.monotonic() + self.wait_s
        pause = 1e-4
        while not work.is_completed():
            if time.monotonic() > deadline:
                self.abort()
                raise SyncStalled(
                    f"{self.where}: a broadcast from member {src} did not complete within {self.wait_s:g}s "
                    "(a member died or is not taking part); the group is torn down"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        work.wait()

    def abort(self) -> None:
        """Drop the group with a collective still in flight. NCCL's communicator is aborted,
        which unblocks its stream and frees it; gloo's cannot be (its shutdown waits for the
        work in flight), so its worker thread is left to fail out at the backend's timeout."""
        if self.group is not None and self.backend == "nccl":
            with contextlib.suppress(RuntimeError):  # already broken: nothing left to free
                self.group.abort()
        elif self.group is not None:
            # Its destructor would join the blocked worker thread: keep it referenced.
            _ABANDONED.append(self.group)
        self.group = None

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


def receive_buckets(group: WeightSyncGroup, plan: list[Bucket], load: Callable[[Bucket, Tensor], None]) -> None:
    """Receiver side: for each bucket of `plan`, receive its flat buffer and `load` it."""
    for bucket in plan:
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=group.device)
        group.broadcast(flat, src=0)
        load(bucket, flat)
        del flat
