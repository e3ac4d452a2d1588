"""`WeightSender`: the learner's side of every weight transport, a part the learner rank holds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from pjray.models.lora import ExportedParam, export_view
from pjray.sync.adapter import AdapterUpdate, adapter_update
from pjray.sync.buckets import Bucket, pack, plan_buckets, state_checksums
from pjray.sync.collective import GroupAddress, WeightSyncGroup, broadcast_buckets
from pjray.sync.ipc import stream_buckets
from pjray.sync.shared import SharedBuckets

if TYPE_CHECKING:
    import ray

__all__ = ["WeightSender", "WorkerReceiver"]


def _plan(exported: list[ExportedParam], bucket_bytes: int) -> list[Bucket]:
    return plan_buckets([(p.name, p.shape, p.dtype) for p in exported], bucket_bytes)


class WorkerReceiver:
    """A rollout worker actor as the receiving end of a CUDA IPC stream (`pjray.sync.ipc`)."""

    def __init__(self, worker: ray.actor.ActorHandle) -> None:
        import ray

        self.worker, self.get = worker, ray.get

    def begin(self, handles: list[Any]) -> None:
        self.get(self.worker.begin_ipc.remote(handles))

    def load(self, bucket: Bucket, slot: int) -> ray.ObjectRef:
        return self.worker.load_ipc_bucket.remote(bucket, slot)

    def wait(self, pending: ray.ObjectRef) -> None:
        self.get(pending)

    def finish(self) -> None:
        self.get(self.worker.finish_ipc.remote())


class TrainedWeights(Protocol):
    """What the sender reads of the model a learner rank trains (`pjray.rl.policy.PolicyModel`)."""

    engine: Any  # the DeepSpeed engine; its `module` is the HF model (or a PeftModel over it)
    ds: Any  # the deepspeed module
    rank: int
    zero3: bool


class WeightSender:
    """The learner's side of weight sync, checksums included; `LearnerRank` holds one and offers
    its methods as the actor's.

    Like the learner's other methods, each one here is called on ALL learner ranks: ZeRO-3
    gathers every bucket collectively. Exported weights carry the names of a freshly loaded HF
    model's `named_parameters()` (`model.visual...`, `lm_head.weight`): no DeepSpeed `module.`
    prefix.
    """

    def __init__(self, model: TrainedWeights) -> None:
        self.model = model
        self._shared: SharedBuckets | None = None  # the shm transport's buffers (rank 0)
        self._sync_group: WeightSyncGroup | None = None  # the broadcast group (rank 0)

    def _exported(self) -> list[ExportedParam]:
        # The engine's inner module is the HF model (or a PeftModel over it): the view names its
        # parameters as a plain HF model does, LoRA adapters merged.
        return export_view(self.model.engine.module)

    def weight_plan(self, bucket_bytes: int) -> list[Bucket]:
        """The bucket plan of the full weights (from parameter shapes; no gather)."""
        return _plan(self._exported(), bucket_bytes)

    def full_buckets(self, bucket_bytes: int) -> Iterator[tuple[Bucket, dict[str, Tensor]]]:
        """(bucket, name -> full tensor) for every bucket; ALL ranks must iterate to the end.

        Under ZeRO-3 each bucket's parameters are all-gathered (a collective) for the duration
        of one iteration, so at most one bucket is materialised at a time; the tensors must be
        used or copied before advancing.
        """
        exported = self._exported()
        by_name = {p.name: p for p in exported}
        for bucket in _plan(exported, bucket_bytes):
            params = [param for e in bucket.entries for param in by_name[e.name].params]
            gathered = (
                self.model.ds.zero.GatheredParameters(params, modifier_rank=None)
                if self.model.zero3
                else contextlib.nullcontext()
            )
            with gathered:
                yield bucket, {e.name: by_name[e.name].value() for e in bucket.entries}

    # -- object store -------------------------------------------------------------------------

    def export_weights(self, bucket_bytes: int) -> tuple[list[Bucket], list[ray.ObjectRef]] | None:
        """Full weights packed into flat buckets in the Ray object store.

        Rank 0 returns (plan, refs) with refs[i] holding `pack(plan[i], ...)` as a CPU tensor;
        unpack with `pjray.sync.buckets.unpack`. Every parameter is exported, trainable or not, so
        a rollout engine that loads them is exactly the learner's policy. Other ranks return None.
        """
        import ray

        plan: list[Bucket] = []
        refs: list[ray.ObjectRef] = []
        for bucket, tensors in self.full_buckets(bucket_bytes):
            if self.model.rank == 0:
                plan.append(bucket)
                refs.append(ray.put(pack(bucket, tensors).cpu()))
        return (plan, refs) if self.model.rank == 0 else None

    # -- the adapter alone (LoRA) --------------------------------------------------------------

    def adapter(self) -> AdapterUpdate | None:
        """LoRA: the adapter alone (`pjray.sync.adapter.AdapterUpdate`: PEFT's config and state
        dict, on CPU) on rank 0, None on other ranks. Under ZeRO-3 the adapter's partitions are
        gathered for the copy (a collective: call on all ranks)."""
        module = self.model.engine.module
        adapters = [p for n, p in module.named_parameters() if ".lora_" in n]
        gathered = (
            self.model.ds.zero.GatheredParameters(adapters, modifier_rank=None)
            if self.model.zero3
            else contextlib.nullcontext()
        )
        with gathered:
            return adapter_update(module) if self.model.rank == 0 else None

    def export_adapter(self) -> tuple[ray.ObjectRef, int] | None:
        """model.lora.sync=adapter: `adapter()` put in the Ray object store once by rank 0, which
        returns (its ref, the adapter's bytes); other ranks None. Call on all ranks."""
        import ray

        update = self.adapter()
        return None if update is None else (ray.put(update), update.nbytes)

    # -- shared memory ------------------------------------------------------------------------

    def export_shared(self, bucket_bytes: int) -> tuple[list[Bucket], list[str]] | None:
        """Rank 0 writes the full weights into its shared-memory buffers in place
        (`SharedBuckets`) and returns (plan, their paths); other ranks return None."""
        if self.model.rank != 0:
            for _ in self.full_buckets(bucket_bytes):  # ZeRO-3 gathers are collective
                pass
            return None
        if self._shared is None:
            self._shared = SharedBuckets()
        return self._shared.write(self.full_buckets(bucket_bytes))

    def close_shared(self) -> None:
        """Remove the shared-memory buffers (the trainer calls it before it stops the learners)."""
        if self._shared is not None:
            self._shared.close()
            self._shared = None

    # -- broadcast ----------------------------------------------------------------------------

    def sync_address(self) -> tuple[str, int]:
        """This rank's node IP and a free port there, for the broadcast group's store. Asked of
        the rank itself: its bundle has no CPU left for a probe task once it runs."""
        from pjray.placement import free_address

        return free_address()

    def init_weight_sync(self, address: GroupAddress) -> None:
        """Rank 0 joins (and hosts) the broadcast group with the engines; other ranks do nothing.
        The engines join concurrently (`RolloutWorker.init_weight_sync`)."""
        if self._sync_group is not None:
            self._sync_group.close()
        self._sync_group = address.join(0) if self.model.rank == 0 else None

    def broadcast_weights(self, bucket_bytes: int) -> list[Bucket]:
        """Send every bucket from rank 0 over the broadcast group; returns the plan sent. If the
        collective fails (an engine died), rank 0 leaves the group, so the other engines' receives
        fail at once instead of waiting out the timeout; the driver then forms a new one."""
        group = self._sync_group
        try:
            return broadcast_buckets(group, self.full_buckets(bucket_bytes))
        except Exception:
            if group is not None:
                group.close()
                self._sync_group = None
            raise

    # -- CUDA IPC -----------------------------------------------------------------------------

    def stream_ipc(self, worker: ray.actor.ActorHandle, bucket_bytes: int, slots: int = 2) -> bool:
        """Colocated sync: stream this rank's full weights to `worker`, the rollout worker on this
        rank's GPU, through `slots` reused CUDA buffers (`pjray.sync.ipc.stream_buckets`).

        Returns False when the worker died during the stream (the driver rebuilds it). Every
        rank gathers every bucket all the same, as ZeRO-3's collective gathers need.
        """
        from pjray.placement import WORKER_FAILURES

        plan = self.weight_plan(bucket_bytes)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        buffers = [torch.empty(max(b.nbytes for b in plan), dtype=torch.uint8, device=device) for _ in range(slots)]
        buckets = self.full_buckets(bucket_bytes)
        try:
            stream_buckets(buckets, buffers, WorkerReceiver(worker))
            return True
        except Exception as err:
            for _ in buckets:  # the other ranks gather the rest of the buckets
                pass
            if isinstance(err, WORKER_FAILURES):
                return False
            raise
        finally:
            del buffers
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()  # blocks the engine no longer maps
                torch.cuda.empty_cache()  # for the colocated engine's KV cache, which wakes next

    # -- verification -------------------------------------------------------------------------

    def checksums(self, on_all_ranks: bool = False) -> dict[str, str]:
        """name -> sha256 of each full (gathered) parameter.

        Rank 0 returns them, other ranks {} unless `on_all_ranks`: then every rank hashes the
        full weights as it sees them (under ZeRO-0/1/2 its own replica), so replicas that drifted
        apart show up as different dicts.
        """
        result: dict[str, str] = {}
        for _, tensors in self.full_buckets(64 << 20):
            if self.model.rank == 0 or on_all_ranks:
                result.update(state_checksums(tensors))
        return result
