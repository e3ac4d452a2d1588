"""`RolloutWorker` with an engine whose own processes died: the actor exits, so that the pool
rebuilds it, whether a call to the engine raised or its watch found it dead (the real vLLM
engine's side is tests/integration/test_vllm_cpu.py)."""

from __future__ import annotations

import time

import pytest

from pjray.rollout import worker as worker_module
from pjray.rollout.worker import RolloutWorker, wait_for_gpu_memory


class EngineGone(Exception):
    pass


class FailingEngine:
    """Raises `error` from every call; `is_dead` says whether that error means it is gone."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def is_dead(self, err: BaseException) -> bool:
        return isinstance(err, EngineGone)

    def alive(self) -> bool:
        self.checks = getattr(self, "checks", 0) + 1
        return self.checks < 3

    def generate(self, *args):
        raise self.error

    def receive_weights(self, *args):
        raise self.error


def _worker(error: Exception) -> RolloutWorker:
    worker = RolloutWorker.__new__(RolloutWorker)
    worker.worker_index, worker.weight_version, worker.engine = 3, 0, FailingEngine(error)
    return worker


@pytest.fixture
def exits(monkeypatch) -> list[int]:
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(worker_module.os, "_exit", fake_exit)
    return codes


def test_a_dead_engine_takes_its_actor_down(exits, caplog) -> None:
    worker = _worker(EngineGone("EngineCore encountered an issue"))
    with pytest.raises(SystemExit):
        worker.generate_timed([], 1, 0)
    with pytest.raises(SystemExit):
        worker.receive_weights([])
    assert exits == [1, 1]
    assert "rollout worker 3: its engine died" in caplog.text and "receive_weights" in caplog.text


def test_any_other_engine_error_is_raised_as_it_is(exits) -> None:
    worker = _worker(ValueError("n must be >= 1"))
    with pytest.raises(ValueError, match="n must be"):
        worker.generate([], 0, 0)
    assert exits == []


def test_the_watch_exits_once_the_engine_is_no_longer_alive(exits, monkeypatch, caplog) -> None:
    monkeypatch.setattr(worker_module, "ENGINE_WATCH_S", 0.01)
    worker = _worker(EngineGone())
    with pytest.raises(SystemExit):
        worker._watch_engine()  # alive twice, then dead: a call blocked on it would never return
    assert exits == [1] and worker.engine.checks == 3
    assert "found by its watch" in caplog.text


def test_a_rebuilt_worker_waits_for_the_dead_engines_memory_then_gives_up():
    """`wait_for_gpu_memory`: polls until the GPU has the engine's share free (a dead engine's
    processes releasing it), and past its timeout stops waiting rather than hanging."""
    readings = iter([2, 5, 9, 12])
    assert wait_for_gpu_memory(10, timeout_s=60, free=lambda: next(readings), pause_s=0.0) >= 0
    assert next(readings, None) is None  # read until 12 >= 10, no further
    start = time.monotonic()
    waited = wait_for_gpu_memory(10, timeout_s=0.2, free=lambda: 3, pause_s=0.01)
    assert 0.2 <= waited < 5 and time.monotonic() - start < 5
