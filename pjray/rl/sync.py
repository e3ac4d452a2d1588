"""Learner -> rollout weight transports: the learner's side of all of them (`WeightSender`), a
broadcast group (gloo / NCCL) and CUDA IPC handles.

`WeightSender` is mixed into `pjray.rl.learner.LearnerRank`, so every transport is a method of
the learner actor the driver calls, while the learner file stays about learning. Under ZeRO-3
the learner gathers parameters bucket by bucket (`WeightSender._full_buckets`), so every learner
rank must take part in a sync, even though only rank 0 (or, for IPC, each rank for its own
engine) sends. Transports (`trainer.sync_backend`):

* Object store (`export_weights` + `RolloutEngine.load_weights`): works for every layout and is
  the CPU path. Rank 0 puts each packed bucket in the Ray object store once.
* Broadcast (`nccl`, or `gloo`): a process group of learner rank 0 plus every vLLM rank (world =
  1 + engines x tensor_parallel_size), built on its own TCP store so it never touches
  DeepSpeed's default group. Rank 0 packs each bucket (`weights.pack`) and broadcasts the flat
  buffer; each vLLM rank receives it into an empty buffer and loads it. One collective per
  bucket, one RPC per engine per sync. NCCL for engines on their own GPUs (NCCL refuses two
  ranks of one communicator on the same GPU); gloo is the same code on CPU tensors.
* Shared memory (`shm`, engines on learner rank 0's node; what `auto` picks for the HF engine
  there): rank 0 writes each bucket in place into a flat buffer in shared memory
  (`SharedBuckets`: a file in /dev/shm mapped by both sides, created once and reused at every
  sync), and each engine maps the same file once (`SharedBucketReader`) and copies from it into
  its parameters. One copy in and one copy out; nothing is serialised or sent over a socket.
* IPC (`ipc`, colocated): learner rank i packs every bucket on its GPU and hands CUDA IPC
  handles to engine i on the same GPU, which maps them without a copy over the wire and loads
  them. Costs one extra copy of the weights in GPU memory until the engine has loaded them;
  `release_ipc` frees it (and returns the allocator's cached blocks) before the engine wakes its
  KV cache.

The receiving side of the broadcast and IPC paths is `pjray.rl.vllm_engine.WeightSyncExtension`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from pjray.config import RolloutConfig
from pjray.models.lora import ExportedParam, export_view
from pjray.rl.weights import Bucket, pack, plan_buckets, state_checksums

if TYPE_CHECKING:
    import ray

__all__ = [
    "SharedBucketReader",
    "SharedBuckets",
    "WeightSender",
    "WeightSyncGroup",
    "auto_transport",
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
            self.group: Any = dist.ProcessGroupNCCL(prefixed, rank, world_size, nccl_options(timeout))
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


SHARED_PREFIX = "pjray-sync-"


def shared_dir() -> Path:
    """Where the shared-memory buffers live: /dev/shm (a RAM file system on Linux) when it can
    be written, else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class SharedBuckets:
    """The learner's side of the same-node transport: one flat shared-memory buffer per bucket.

    Each buffer is a file in `directory` mapped with MAP_SHARED (`torch.from_file`), made when a
    bucket is first written (or changes size) and rewritten in place at every later sync, so a
    sync costs one copy of the weights into memory that the engines on the node map too. A
    buffer that would not fit in the directory's free space (a container's /dev/shm is often
    64 MB, and a mapped page past a full tmpfs is a SIGBUS) goes to the temporary directory, a
    file the page cache shares all the same. Files are named `pjray-sync-<pid>-<random>-<index>`;
    `close` removes them, and a new instance removes those of processes that no longer run (an
    actor killed before it closed).
    """

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory) if directory is not None else shared_dir()
        self.fallback = Path(tempfile.gettempdir())
        self._tag = f"{SHARED_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._paths: list[Path] = []
        self._buffers: list[Tensor] = []
        for directory in {self.directory, self.fallback}:
            remove_stale_buffers(directory)

    def write(self, buckets: Iterable[tuple[Bucket, dict[str, Tensor]]]) -> tuple[list[Bucket], list[str]]:
        """Pack every bucket into its buffer; returns (plan, the buffers' paths)."""
        plan: list[Bucket] = []
        for bucket, tensors in buckets:
            pack(bucket, tensors, out=self._buffer(len(plan), bucket))
            plan.append(bucket)
        while len(self._paths) > len(plan):  # the plan shrank: drop the buffers it no longer uses
            self._buffers.pop()
            self._paths.pop().unlink(missing_ok=True)
        return plan, [str(p) for p in self._paths]

    def _buffer(self, index: int, bucket: Bucket) -> Tensor:
        if index < len(self._buffers):
            old = self._buffers[index]
            if old.numel() == bucket.numel and old.dtype == bucket.dtype:
                return old
            self._paths[index].unlink(missing_ok=True)
        fits = free_bytes(self.directory) >= bucket.nbytes + (16 << 20)  # leave the others some room
        path = (self.directory if fits else self.fallback) / f"{self._tag}-{index}"
        with open(path, "wb") as f:
            f.truncate(bucket.nbytes)
        buffer = torch.from_file(str(path), shared=True, size=bucket.numel, dtype=bucket.dtype)
        if index < len(self._buffers):
            self._paths[index], self._buffers[index] = path, buffer
        else:
            self._paths.append(path)
            self._buffers.append(buffer)
        return buffer

    def close(self) -> None:
        """Remove the buffers' files (mappings already open stay valid until dropped)."""
        self._buffers = []
        for path in self._paths:
            path.unlink(missing_ok=True)
        self._paths = []


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged process may still write in `directory`'s file system."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def remove_stale_buffers(directory: Path) -> list[Path]:
    """Remove the shared-memory buffers whose writer process no longer runs; returns them."""
    removed = []
    for path in directory.glob(f"{SHARED_PREFIX}*"):
        pid = path.name[len(SHARED_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class SharedBucketReader:
    """The engine's side of the same-node transport: maps the learner's buffers (once per
    path) and hands out flat views of them to copy from."""

    def __init__(self) -> None:
        self._maps: dict[str, Tensor] = {}

    def views(self, plan: list[Bucket], paths: list[str]) -> list[Tensor]:
        """[bucket.numel] views of the buffers at `paths`, one per bucket of `plan`."""
        if len(plan) != len(paths):
            raise ValueError(f"shared-memory sync: {len(plan)} buckets in the plan but {len(paths)} buffers")
        maps: dict[str, Tensor] = {}
        for bucket, path in zip(plan, paths):
            mapped = self._maps.get(path)
            if mapped is None or mapped.numel() != bucket.numel or mapped.dtype != bucket.dtype:
                if not os.path.isfile(path):
                    raise FileNotFoundError(
                        f"shared-memory sync: {path} is not on this node; trainer.sync_backend=shm needs "
                        "every rollout worker on learner rank 0's node (use object_store across nodes)"
                    )
                mapped = torch.from_file(path, shared=True, size=bucket.numel, dtype=bucket.dtype)
            maps[path] = mapped
        self._maps = maps  # buffers the learner dropped are unmapped with their last view
        return [maps[p] for p in paths]


def _plan(exported: list[ExportedParam], bucket_bytes: int) -> list[Bucket]:
    return plan_buckets([(p.name, p.shape, p.dtype) for p in exported], bucket_bytes)


class WeightSender:
    """The learner's side of weight sync, checksums included; mixed into `LearnerRank`.

    The host class provides `engine` (the DeepSpeed engine, whose `module` is the HF model),
    `rank`, `zero3` and `_ds` (the deepspeed module). Like the learner's other methods, each
    one here is called on ALL learner ranks: ZeRO-3 gathers every bucket collectively.
    Exported weights carry the names of a freshly loaded HF model's `named_parameters()`
    (`model.visual...`, `lm_head.weight`): no DeepSpeed `module.` prefix.
    """

    engine: Any
    rank: int
    zero3: bool
    _ds: Any

    def _exported(self) -> list[ExportedParam]:
        # The engine's inner module is the HF model (or a PeftModel over it): the view names its
        # parameters as a plain HF model does, LoRA adapters merged.
        return export_view(self.engine.module)

    def weight_plan(self, bucket_bytes: int) -> list[Bucket]:
        """The bucket plan of the full weights (from parameter shapes; no gather)."""
        return _plan(self._exported(), bucket_bytes)

    def _full_buckets(self, bucket_bytes: int) -> Iterator[tuple[Bucket, dict[str, Tensor]]]:
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
                self._ds.zero.GatheredParameters(params, modifier_rank=None) if self.zero3 else contextlib.nullcontext()
            )
            with gathered:
                yield bucket, {e.name: by_name[e.name].value() for e in bucket.entries}

    # -- object store -------------------------------------------------------------------------

    def export_weights(self, bucket_bytes: int) -> tuple[list[Bucket], list[ray.ObjectRef]] | None:
        """Full weights packed into flat buckets in the Ray object store.

        Rank 0 returns (plan, refs) with refs[i] holding `pack(plan[i], ...)` as a CPU tensor;
        unpack with `pjray.rl.weights.unpack`. Every parameter is exported, trainable or not, so
        a rollout engine that loads them is exactly the learner's policy. Other ranks return None.
        """
        import ray

        plan: list[Bucket] = []
        refs: list[ray.ObjectRef] = []
        for bucket, tensors in self._full_buckets(bucket_bytes):
            if self.rank == 0:
                plan.append(bucket)
                refs.append(ray.put(pack(bucket, tensors).cpu()))
        return (plan, refs) if self.rank == 0 else None

    # -- shared memory ------------------------------------------------------------------------

    def export_shared(self, bucket_bytes: int) -> tuple[list[Bucket], list[str]] | None:
        """Rank 0 writes the full weights into its shared-memory buffers in place
        (`SharedBuckets`) and returns (plan, their paths); other ranks return None."""
        if self.rank != 0:
            for _ in self._full_buckets(bucket_bytes):  # ZeRO-3 gathers are collective
                pass
            return None
        if getattr(self, "_shared", None) is None:
            self._shared = SharedBuckets()
        return self._shared.write(self._full_buckets(bucket_bytes))

    def close_shared(self) -> None:
        """Remove the shared-memory buffers (the trainer calls it before it stops the learners)."""
        shared = getattr(self, "_shared", None)
        if shared is not None:
            shared.close()
            self._shared = None

    def node_id(self) -> str:
        """The Ray node this rank runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    # -- broadcast ----------------------------------------------------------------------------

    def sync_address(self) -> tuple[str, int]:
        """This rank's node IP and a free port there, for the broadcast group's store. Asked of
        the rank itself: its bundle has no CPU left for a probe task once it runs."""
        from pjray.rl.placement import free_address

        return free_address()

    def init_weight_sync(self, host: str, port: int, world_size: int, backend: str) -> None:
        """Rank 0 joins (and hosts) the broadcast group with the engines; other ranks do nothing.
        The engines join concurrently (`RolloutWorker.init_weight_sync`)."""
        old = getattr(self, "_sync_group", None)
        if old is not None:
            old.close()
        self._sync_group = WeightSyncGroup(host, port, 0, world_size, backend) if self.rank == 0 else None

    def broadcast_weights(self, bucket_bytes: int) -> list[Bucket]:
        """Send every bucket from rank 0 over the broadcast group; returns the plan sent."""
        return broadcast_buckets(getattr(self, "_sync_group", None), self._full_buckets(bucket_bytes))

    # -- CUDA IPC -----------------------------------------------------------------------------

    def export_ipc(self, bucket_bytes: int) -> tuple[list[Bucket], list[Any]]:
        """(plan, CUDA IPC handles) of this rank's full weights for its colocated engine.

        The packed buffers stay alive until `release_ipc`, after the engine has loaded them.
        """
        self._ipc_buffers: list[Tensor] = []
        return ipc_handles(self._full_buckets(bucket_bytes), self._ipc_buffers)

    def release_ipc(self) -> None:
        """Free the packed copy and return the allocator's cached blocks to the GPU, which the
        colocated engine's KV cache takes next."""
        self._ipc_buffers = []
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- verification -------------------------------------------------------------------------

    def checksums(self, on_all_ranks: bool = False) -> dict[str, str]:
        """name -> sha256 of each full (gathered) parameter.

        Rank 0 returns them, other ranks {} unless `on_all_ranks`: then every rank hashes the
        full weights as it sees them (under ZeRO-0/1/2 its own replica), so replicas that drifted
        apart show up as different dicts.
        """
        result: dict[str, str] = {}
        for _, tensors in self._full_buckets(64 << 20):
            if self.rank == 0 or on_all_ranks:
                result.update(state_checksums(tensors))
        return result
