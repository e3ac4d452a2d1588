"""The colocated GPU sync's memory order, on CPU: the real `VllmEngine` methods around a recording
stand-in for `vllm.LLM` (the GPU-only part; it keeps the methods the engine calls).

Colocated, the learner and the engine share one GPU. After the update the engine must first
take back its weights only and load the new ones while its KV cache stays released; the KV cache
may wake only when the driver says so, after the learner freed its packed copy of the weights.
The driver's side of the order is checked in tests/integration/test_trainer.py. Neither has run
on a GPU here. In every layout and transport, a load resets the encoder cache (the vision
tower's embeddings of images already seen were computed with the old weights); the real engine's
side of that is tests/integration/test_vllm_vl_cpu.py.
"""

from __future__ import annotations

from pjray.rollout.vllm_engine import VllmEngine


class RecordingLLM:
    """Fake `vllm.LLM`: records the sleep-mode and RPC calls the engine makes, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.llm_engine = self  # `LLM.llm_engine.reset_encoder_cache`

    def reset_encoder_cache(self) -> None:
        self.calls.append(("reset_encoder_cache",))

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tuple(tags) if tags is not None else None))

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.calls.append(("rpc", method))
        return [None]

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))


def _engine(sleep_enabled: bool) -> VllmEngine:
    """A VllmEngine whose vllm.LLM is the recording fake (no vLLM, no GPU needed)."""
    engine = VllmEngine.__new__(VllmEngine)
    engine.llm = RecordingLLM()
    engine.sleep_enabled = sleep_enabled
    engine.sleeping = set()
    return engine


def test_colocated_load_wakes_weights_only_and_the_kv_cache_on_wake_up():
    engine = _engine(sleep_enabled=True)
    engine.sleep()
    engine.load_ipc([], [])
    assert engine.llm.calls == [
        ("sleep", 1), ("wake_up", ("weights",)), ("rpc", "pjray_load_ipc"), ("reset_encoder_cache",),
    ]  # fmt: skip
    assert engine.sleeping == {"kv_cache"}  # still released while the learner frees its copy
    engine.llm.calls.clear()
    engine.wake_up()
    # The KV cache comes back last, and its prefix cache (blocks of the old weights) is reset.
    assert engine.llm.calls == [("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    engine.llm.calls.clear()
    engine.wake_up()  # nothing left asleep
    assert engine.llm.calls == [] and not engine.sleeping


TRANSPORTS = (
    lambda e: e.load_weights([], []),
    lambda e: e.load_shared([], []),
    lambda e: e.receive_weights([]),
    lambda e: e.load_ipc([], []),
)


def test_every_transport_keeps_the_kv_cache_asleep_until_wake_up():
    for load in TRANSPORTS:
        engine = _engine(sleep_enabled=True)
        engine.sleep()
        load(engine)
        assert ("wake_up", ("kv_cache",)) not in engine.llm.calls and engine.sleeping == {"kv_cache"}
        assert engine.llm.calls[-1] == ("reset_encoder_cache",)


def test_every_transport_resets_the_encoder_cache_after_its_load_in_split_layouts():
    for load in TRANSPORTS:
        engine = _engine(sleep_enabled=False)
        load(engine)
        assert engine.llm.calls[-2:] == [("reset_encoder_cache",), ("reset_prefix_cache",)]


def test_split_engines_never_sleep_and_reset_the_prefix_cache_after_a_load():
    engine = _engine(sleep_enabled=False)
    engine.sleep()
    engine.load_ipc([], [])
    engine.wake_up()
    assert engine.llm.calls == [("rpc", "pjray_load_ipc"), ("reset_encoder_cache",), ("reset_prefix_cache",)]
