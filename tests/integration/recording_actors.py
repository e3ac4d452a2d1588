"""Fakes of the colocated learner rank and vLLM rollout worker, for checking on CPU the order in
which the driver hands GPU memory between them. They keep the real methods' names and
signatures, do no GPU work, and record every call in a shared `CallLog` actor. Ray workers
import this module by name (the tests put this directory on their PYTHONPATH)."""

from __future__ import annotations

from typing import Any


class CallLog:
    def __init__(self) -> None:
        self.entries: list[tuple[str, int]] = []

    def add(self, method: str, index: int) -> None:
        self.entries.append((method, index))

    def calls(self) -> list[tuple[str, int]]:
        return list(self.entries)


class RecordingLearnerRank:
    """Fake `LearnerRank` (GPU-only parts absent): the methods the colocated sync calls."""

    def __init__(self, log: Any, rank: int) -> None:
        self.log, self.rank = log, rank

    def _record(self, method: str) -> None:
        import ray

        ray.get(self.log.add.remote(method, self.rank))

    def release_memory(self) -> None:
        self._record("release_memory")

    def export_ipc(self, bucket_bytes: int) -> tuple[list, list]:
        self._record("export_ipc")
        return [], []

    def release_ipc(self) -> None:
        self._record("release_ipc")


class RecordingRolloutWorker:
    """Fake colocated `RolloutWorker` with a sleeping vLLM engine."""

    def __init__(self, log: Any, index: int) -> None:
        self.log, self.index = log, index

    def _record(self, method: str) -> None:
        import ray

        ray.get(self.log.add.remote(method, self.index))

    def ready(self) -> bool:
        return True

    def load_ipc(self, plan: list, handles: list) -> None:
        self._record("load_ipc")

    def wake_up(self) -> None:
        self._record("wake_up")

    def set_weight_version(self, version: int) -> None:
        self._record("set_weight_version")
