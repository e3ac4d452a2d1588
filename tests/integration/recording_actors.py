"""Fakes of the learner rank and the vLLM rollout worker, keeping the real methods' names and
signatures. The colocated ones check on CPU the order in which the driver hands GPU memory
between them (no GPU work; every call recorded in a shared `CallLog` actor); the sync-group
members join the real weight-sync group, or stay away. Ray workers import this module by name
(the tests put this directory on their PYTHONPATH)."""

from __future__ import annotations

from typing import Any


class CallLog:
    def __init__(self) -> None:
        self.entries: list[tuple[str, int]] = []
        self.doomed: set[int] = set()  # workers that die in their next load_ipc_bucket

    def add(self, method: str, index: int) -> None:
        self.entries.append((method, index))

    def calls(self) -> list[tuple[str, int]]:
        return list(self.entries)

    def doom(self, index: int) -> None:
        self.doomed.add(index)

    def dies(self, index: int) -> bool:
        if index in self.doomed:
            self.doomed.discard(index)
            return True
        return False


class RecordingLearnerRank:
    """Fake `LearnerRank` (GPU-only parts absent): the methods the colocated sync calls. Its
    stream is the real one (`stream_buckets` through `WorkerReceiver`) over three buckets in CPU
    buffers, with no handles to share."""

    def __init__(self, log: Any, rank: int) -> None:
        self.log, self.rank = log, rank

    def _record(self, method: str) -> None:
        import ray

        ray.get(self.log.add.remote(method, self.rank))

    def release_memory(self) -> None:
        self._record("release_memory")

    def stream_ipc(self, worker: Any, bucket_bytes: int) -> bool:
        import torch

        from pjray.placement import WORKER_FAILURES
        from pjray.sync.buckets import plan_buckets
        from pjray.sync.ipc import stream_buckets
        from pjray.sync.sender import WorkerReceiver

        self._record("stream_ipc")
        plan = plan_buckets([(f"w{i}", torch.Size([4]), torch.float32) for i in range(3)], 16)
        buckets = ((bucket, {e.name: torch.ones(4) for e in bucket.entries}) for bucket in plan)
        try:
            stream_buckets(
                buckets,
                [torch.empty(16, dtype=torch.uint8) for _ in range(2)],
                WorkerReceiver(worker),
                share=lambda slot: None,
            )
        except WORKER_FAILURES:
            return False
        return True

    def export_weights(self, bucket_bytes: int) -> tuple[list, list]:
        self._record("export_weights")
        return [], []


class RecordingRolloutWorker:
    """Fake colocated `RolloutWorker` with a sleeping vLLM engine."""

    def __init__(self, log: Any, index: int) -> None:
        self.log, self.index = log, index

    def _record(self, method: str) -> None:
        import ray

        ray.get(self.log.add.remote(method, self.index))

    def ready(self) -> bool:
        return True

    def begin_ipc(self, handles: list) -> None:
        self._record("begin_ipc")

    def load_ipc_bucket(self, bucket: Any, slot: int) -> None:
        import os

        import ray

        if ray.get(self.log.dies.remote(self.index)):
            os._exit(1)
        self._record("load_ipc_bucket")

    def finish_ipc(self) -> None:
        self._record("finish_ipc")

    def load_weights(self, plan: list, refs: list) -> None:
        self._record("load_weights")

    def wake_up(self) -> None:
        self._record("wake_up")

    def set_weight_version(self, version: int) -> None:
        self._record("set_weight_version")


class GroupLearnerRank:
    """Fake learner rank 0 of the broadcast transport: it hosts and joins the real weight-sync
    group (`WeightSyncGroup`) and sends an empty plan."""

    def sync_address(self) -> tuple[str, int]:
        from pjray.placement import free_address

        return free_address()

    def init_weight_sync(self, address: Any) -> None:
        self.group = address.join(0)

    def weight_plan(self, bucket_bytes: int) -> list:
        return []


class GroupRolloutWorker:
    """Fake one-rank engine of the broadcast transport: it joins the group, or, `absent`, is
    busy elsewhere and never does (its call returns only after a minute)."""

    def __init__(self, absent: bool) -> None:
        self.absent = absent

    def init_weight_sync(self, address: Any, rank_offset: int) -> list[int]:
        import time

        if self.absent:
            time.sleep(60)
            return []
        self.group = address.join(rank_offset)
        return [rank_offset]
