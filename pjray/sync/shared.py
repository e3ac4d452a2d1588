"""The same-node transport: flat buffers in shared memory, written in place by learner rank 0
(`SharedBuckets`) and mapped once by each engine (`SharedBucketReader`)."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from pjray.sync.buckets import Bucket, pack

__all__ = ["SharedBucketReader", "SharedBuckets", "remove_stale_buffers", "shared_dir"]


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
