"""`RolloutWorker` with an engine whose own processes died: the actor exits, so that the pool
rebuilds it, whether a call to the engine raised or its watch found it dead (the real vLLM
engine's side is tests/integration/test_vllm_cpu.py)."""

from __future__ import annotations

import pytest

from pjray.rollout import worker as worker_module
from pjray.rollout.worker import RolloutWorker


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
