"""The driver's side of weight sync: one class per transport (`trainer.sync_backend`), chosen once
at set-up (`make_transport`; `auto_transport` resolves `auto` from the layout).

Each class drives the learner ranks' side (`pjray.sync.sender.WeightSender`, every rank takes
part: ZeRO-3 gathers are collective) and the rollout workers' side (`RolloutWorker`) through
their actor methods: `connect` at set-up, `send` at every sync, `refresh` for one rebuilt worker,
`close` at shutdown. The trainer only calls these; it holds no branch on the transport's name.
With LoRA and model.lora.sync=adapter the layout uses `AdapterTransport` (the adapter alone,
through the object store) whatever trainer.sync_backend resolves to.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import ray

from pjray.config import RolloutConfig
from pjray.placement import WORKER_FAILURES
from pjray.sync.collective import JOIN_S, GroupAddress

if TYPE_CHECKING:
    from pjray.placement import WorkerPool

__all__ = ["TRANSPORTS", "AdapterTransport", "Transport", "auto_transport", "make_transport"]


def auto_transport(rollout: RolloutConfig, learner_gpus: bool, learner_node: str, worker_nodes: list[str]) -> str:
    """What trainer.sync_backend=auto means for this layout, first match wins:

    * colocated vLLM engines: `ipc` (each maps its learner rank's buffers on their shared GPU);
    * vLLM engines on GPUs of their own, learner on GPUs: `nccl` (GPU to GPU, any node);
    * every engine on learner rank 0's node: `shm` (HF engines, or vLLM on CPU);
    * otherwise: `object_store`, which reaches any layout.
    """
    gpu_vllm = rollout.backend == "vllm" and rollout.num_gpus_per_worker > 0 and learner_gpus
    if gpu_vllm and rollout.colocate:
        return "ipc"
    if gpu_vllm:
        return "nccl"
    if worker_nodes and all(node == learner_node for node in worker_nodes):
        return "shm"
    return "object_store"


class Transport:
    """How the learner ranks' weights reach the rollout workers' engines.

    `learners` are the learner rank actors (rank 0 first), `workers` the rollout worker pool.
    """

    name = ""

    def __init__(self, bucket_bytes: int, tensor_parallel_size: int = 1) -> None:
        self.bucket_bytes = bucket_bytes
        self.tensor_parallel_size = tensor_parallel_size

    def connect(self, learners: list[Any], workers: WorkerPool) -> None:
        """Set-up before the first sync (and again when a worker was rebuilt); none by default."""

    def send(self, learners: list[Any], workers: WorkerPool) -> None:
        """One sync: every engine ends holding the learner's current weights."""
        raise NotImplementedError

    def refresh(self, learners: list[Any], workers: WorkerPool, worker: Any) -> None:
        """Bring one rebuilt worker to the learner's current weights: through the object store,
        which reaches a single worker in any layout."""
        plan, refs = ray.get([r.export_weights.remote(self.bucket_bytes) for r in learners])[0]
        ray.get(worker.load_weights.remote(plan, refs))

    def close(self, learners: list[Any]) -> None:
        """Free what the transport holds; none by default."""


class ObjectStoreTransport(Transport):
    """Rank 0 puts each packed bucket in the Ray object store once; every engine fetches them one
    at a time. Reaches any layout (the CPU path across nodes)."""

    name = "object_store"

    def send(self, learners: list[Any], workers: WorkerPool) -> None:
        plan, refs = ray.get([r.export_weights.remote(self.bucket_bytes) for r in learners])[0]
        workers.broadcast("load_weights", plan, refs)


class SharedMemoryTransport(Transport):
    """Rank 0 writes the buckets in place into shared-memory buffers; the engines on its node copy
    from them (`pjray.sync.shared`). What `auto` picks for HF engines on that node: the buffers
    (files in /dev/shm mapped by both sides) are created once and reused at every sync, and each
    engine maps them once, so a sync is one copy in and one copy out; nothing is serialised or
    sent over a socket."""

    name = "shm"

    def send(self, learners: list[Any], workers: WorkerPool) -> None:
        exported = ray.get([r.export_shared.remote(self.bucket_bytes) for r in learners])
        workers.broadcast("load_shared", *exported[0])

    def refresh(self, learners: list[Any], workers: WorkerPool, worker: Any) -> None:
        self.send(learners, workers)

    def close(self, learners: list[Any]) -> None:
        with contextlib.suppress(Exception):  # a dead learner leaves them to the next run's sweep
            ray.get([r.close_shared.remote() for r in learners], timeout=30)


class BroadcastTransport(Transport):
    """A process group of learner rank 0 and every engine rank (`pjray.sync.collective`; world =
    1 + engines x tensor_parallel_size, on its own TCP store so it never touches DeepSpeed's
    default group): rank 0 packs each bucket and broadcasts the flat buffer, each vLLM rank
    receives it into an empty buffer and loads it; one collective per bucket, one RPC per engine
    per sync. `gloo` on CPU tensors, `nccl` GPU to GPU for engines on GPUs of their own (NCCL
    refuses two ranks of one communicator on the same GPU)."""

    name = "gloo"
    # How long the members of a collective that lost one may take to fail out of it.
    timeout_s = 120.0
    # How long forming the group waits for its members (`GroupAddress.join_s`): each member
    # fails out by then, rank 0 naming the members that never joined.
    join_s = JOIN_S

    def members(self, workers: int) -> tuple[str, ...]:
        """The group's ranks by name: learner rank 0, then each engine's tensor-parallel ranks."""
        tp = self.tensor_parallel_size
        return (
            "learner rank 0",
            *(
                f"rollout worker {i}" + (f", tensor-parallel rank {j}" if tp > 1 else "")
                for i in range(workers)
                for j in range(tp)
            ),
        )

    def connect(self, learners: list[Any], workers: WorkerPool) -> None:
        """Form the group, every member joining at once (each waits, at most `join_s`, until all
        have); re-formed on a fresh port after a worker was rebuilt, since a dead member cannot be
        replaced in place. A join that has not returned `join_s` and a margin later (a member
        blocked elsewhere, or in NCCL's first collective) is an error naming it."""
        host, port = ray.get(learners[0].sync_address.remote())
        world = 1 + len(workers) * self.tensor_parallel_size
        address = GroupAddress(host, port, world, self.name, self.members(len(workers)), self.join_s)
        joins = {r.init_weight_sync.remote(address): f"learner rank {k}" for k, r in enumerate(learners)}
        joins |= {
            w.init_weight_sync.remote(address, 1 + i * self.tensor_parallel_size): f"rollout worker {i}"
            for i, w in enumerate(workers.actors)
        }
        patience = self.join_s + 30.0
        deadline = time.monotonic() + patience
        pending = list(joins)
        leader = pending[0]  # learner rank 0's join
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise RuntimeError(
                    f"weight sync ({self.name}): the group did not form within {patience:g}s; "
                    f"still joining: {', '.join(joins[ref] for ref in pending)}"
                )
            try:
                ray.get(done[0])
            except ray.exceptions.RayTaskError:
                # Every member fails at the same bound; rank 0's error is the one that names who
                # never joined, so it is raised in preference when it comes within seconds.
                if done[0] is not leader:
                    with contextlib.suppress(ray.exceptions.GetTimeoutError):
                        ray.get(leader, timeout=10)
                raise
        self.plan = ray.get(learners[0].weight_plan.remote(self.bucket_bytes))

    def send(self, learners: list[Any], workers: WorkerPool) -> None:
        """One broadcast. An engine that died before or during it ends the collective for every
        member (each leaves the group on the failure); the dead workers are rebuilt, which forms
        a new group and sends again (`refresh`). Each member's broadcast is bounded
        (`WeightSyncGroup.wait_s`, below `timeout_s`): under NCCL, whose survivors would
        otherwise report success with hung streams, they fail out and abort the group as gloo's
        do. A collective still running `timeout_s` after a death is an error naming the dead
        workers, never a hang."""
        # Direct calls, not the restartable pool: a retry could not rejoin a collective that the
        # learner is still blocked in.
        sends = [r.broadcast_weights.remote(self.bucket_bytes) for r in learners]
        receives = {w.receive_weights.remote(self.plan): i for i, w in enumerate(workers.actors)}
        dead, failures, pending = [], [], [*receives, *sends]
        deadline = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not done:
                raise RuntimeError(
                    f"weight sync ({self.name}): rollout workers {dead} died and the collective did not end "
                    f"within {self.timeout_s:g}s; the learner may be blocked in it"
                )
            try:
                ray.get(done[0])
            except WORKER_FAILURES:
                dead.append(receives[done[0]])
                deadline = deadline or time.monotonic() + self.timeout_s
            except ray.exceptions.RayTaskError as err:
                failures.append(err)
        if not dead and failures:
            raise failures[0]
        if dead:
            workers.restart(*sorted(dead))  # rebuilds them and re-forms the group (on_restart -> refresh)

    def refresh(self, learners: list[Any], workers: WorkerPool, worker: Any) -> None:
        self.connect(learners, workers)
        self.send(learners, workers)


class NcclTransport(BroadcastTransport):
    name = "nccl"


class CudaIpcTransport(Transport):
    """Colocated engines: learner rank i streams its weights to engine i, on the GPU they share,
    through two reused CUDA buffers (`WeightSender.stream_ipc`); an engine that died meanwhile is
    rebuilt and brought up to date (`refresh`). The learner packs bucket k+1 while the engine
    loads bucket k; the cost is two buckets of GPU memory, freed (with the allocator's cached
    blocks) before the engine wakes its KV cache."""

    name = "ipc"

    def send(self, learners: list[Any], workers: WorkerPool) -> None:
        streamed = ray.get([r.stream_ipc.remote(w, self.bucket_bytes) for r, w in zip(learners, workers.actors)])
        dead = [i for i, ok in enumerate(streamed) if not ok]
        if dead:
            workers.restart(*dead)


class AdapterTransport(Transport):
    """LoRA with model.lora.sync=adapter: the adapter alone travels. Rank 0 puts it in the object
    store once (`WeightSender.export_adapter`); Ray fetches it for every worker, whose engine
    serves the base weights it loaded at start-up with it (`RolloutEngine.load_adapter`). The
    base weights never train, so the adapter also brings a rebuilt worker up to date.
    `sent_bytes`: the adapter's bytes at the last sync (what each engine received)."""

    name = "adapter"
    sent_bytes = 0

    def send(self, learners: list[Any], workers: WorkerPool) -> None:
        ref, self.sent_bytes = ray.get([r.export_adapter.remote() for r in learners])[0]
        workers.broadcast("load_adapter", ref)

    def refresh(self, learners: list[Any], workers: WorkerPool, worker: Any) -> None:
        ref, self.sent_bytes = ray.get([r.export_adapter.remote() for r in learners])[0]
        ray.get(worker.load_adapter.remote(ref))


TRANSPORTS: dict[str, type[Transport]] = {
    cls.name: cls
    for cls in (ObjectStoreTransport, SharedMemoryTransport, BroadcastTransport, NcclTransport, CudaIpcTransport)
}


def make_transport(name: str, bucket_bytes: int, tensor_parallel_size: int = 1) -> Transport:
    """The transport of `name` (a `trainer.sync_backend` other than auto)."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {name!r}; expected one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[name](bucket_bytes, tensor_parallel_size)
