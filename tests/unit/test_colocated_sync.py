"""The colocated GPU sync on CPU: its memory order, with the real `VllmEngine` methods around a
recording stand-in for `vllm.LLM` (the GPU-only part; it keeps the methods the engine calls),
and the learner's stream through two reused slots (`stream_buckets`, CPU buffers in place of
CUDA ones).

Colocated, the learner and the engine share one GPU. After the update the engine must first
take back its weights only and load the new ones while its KV cache stays released; the KV cache
may wake only when the driver says so, after the learner freed its stream buffers.
The driver's side of the order is checked in tests/integration/test_trainer.py. Neither has run
on a GPU here. At sleep level 2 (the default) a sleeping engine has no weights: only a sync brings
them back, and a wake-up before one is refused. In every layout and transport, a load resets the encoder cache (the vision
tower's embeddings of images already seen were computed with the old weights); the real engine's
side of that is tests/integration/test_vllm_vl_cpu.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from pjray.config import RolloutConfig
from pjray.config import load as load_config
from pjray.rollout import vllm_engine
from pjray.rollout.vllm_engine import VllmEngine, WeightSyncExtension, release_cached_memory
from pjray.sync.buckets import plan_buckets, state_checksums, unpack
from pjray.sync.ipc import ipc_handle, slot_view, stream_buckets

BUCKET = plan_buckets([("w", torch.Size([2]), torch.float32)], 1 << 10)[0]


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


def _engine(sleep_enabled: bool, sleep_level: int = RolloutConfig.sleep_level) -> VllmEngine:
    """A VllmEngine whose vllm.LLM is the recording fake (no vLLM, no GPU needed)."""
    engine = VllmEngine.__new__(VllmEngine)
    engine.llm = RecordingLLM()
    engine.sleep_enabled = sleep_enabled
    engine.sleep_level = sleep_level
    engine.sleeping = set()
    return engine


def _stream(engine: VllmEngine) -> None:
    """The engine's calls in one colocated sync of one bucket (`WeightSender.stream_ipc`)."""
    engine.begin_ipc([])
    engine.load_ipc_bucket(BUCKET, 0)
    engine.finish_ipc()


def test_colocated_load_wakes_weights_only_and_the_kv_cache_on_wake_up():
    engine = _engine(sleep_enabled=True)
    engine.sleep()
    _stream(engine)
    assert engine.llm.calls == [
        ("sleep", 2),
        ("wake_up", ("weights",)),
        ("rpc", "pjray_begin_ipc"),
        ("rpc", "pjray_load_ipc_bucket"),
        ("rpc", "pjray_finish_ipc"),
        ("reset_encoder_cache",),
    ]
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
    lambda e: _stream(e),
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
    _stream(engine)
    engine.wake_up()
    assert engine.llm.calls[-2:] == [("reset_encoder_cache",), ("reset_prefix_cache",)]
    assert [c for c in engine.llm.calls if c[0] in ("sleep", "wake_up")] == []


def test_colocated_engines_discard_their_weights_while_they_sleep_by_default():
    colocated = [
        "rollout.backend=vllm",
        "rollout.device=cuda",
        "rollout.colocate=true",
        "learner.num_gpus_per_rank=0.5",
        "rollout.num_gpus_per_worker=0.4",
    ]
    assert load_config(overrides=colocated).rollout.sleep_level == 2
    assert load_config(overrides=colocated + ["rollout.sleep_level=1"]).rollout.sleep_level == 1


def test_at_sleep_level_2_only_a_sync_brings_the_weights_back():
    """Discarded weights woken without a load would be served as they are (memory nothing
    wrote): a wake-up, or a generation, before a sync is refused and asks vLLM for nothing."""
    engine = _engine(sleep_enabled=True, sleep_level=2)
    engine.sleep()
    engine.llm.calls.clear()
    with pytest.raises(RuntimeError, match="sleep_level=2 and no sync"):
        engine.wake_up()
    with pytest.raises(RuntimeError, match="sleep_level=2 and no sync"):
        engine.generate([], n=1, seed=0)
    assert engine.llm.calls == [] and engine.sleeping == {"weights", "kv_cache"}
    _stream(engine)  # the sync wakes the weights and loads every one
    engine.wake_up()
    assert engine.llm.calls[-2:] == [("wake_up", ("kv_cache",)), ("reset_prefix_cache",)] and not engine.sleeping


def test_at_sleep_level_1_the_kept_weights_may_wake_without_a_sync():
    engine = _engine(sleep_enabled=True, sleep_level=1)
    engine.sleep()
    engine.wake_up()
    assert engine.llm.calls == [("sleep", 1), ("wake_up", ("kv_cache", "weights")), ("reset_prefix_cache",)]


def test_a_load_returns_the_allocators_free_blocks_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", str(device))))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    release_cached_memory(torch.device("cpu"))
    assert calls == []
    release_cached_memory(torch.device("cuda", 0))
    assert calls == [("synchronize", "cuda:0"), ("empty_cache",)]


class GraphWrapper:
    """Stands in for vLLM's CUDAGraphWrapper (not a module; it forwards attribute reads to the
    model it wraps): what `model_runner.model` is on a V1 GPU runner with CUDA graphs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.runnable = model

    def __getattr__(self, key: str):
        return getattr(self.runnable, key)

    def unwrap(self) -> torch.nn.Module:
        return self.runnable


class FakeWorker(WeightSyncExtension):
    """A vLLM worker reduced to what the extension reads of it: the V1 GPU runner's layout, its
    `model` a graph wrapper and `get_model()` (the worker's, as in vLLM) unwrapping it."""

    def __init__(self, model: torch.nn.Module) -> None:
        from types import SimpleNamespace

        self.model_runner = SimpleNamespace(model=GraphWrapper(model), get_model=lambda: model)

    def get_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()


def test_the_extension_reaches_the_model_through_vllms_unwrapping_accessor():
    model = torch.nn.Linear(3, 2)
    worker = FakeWorker(model)
    assert vllm_engine.served_model(worker) is model
    assert worker.pjray_checksums() == state_checksums(model.named_parameters())
    # No method reads the runner's attribute, which on a GPU with graphs is the wrapper.
    assert "model_runner.model" not in inspect.getsource(vllm_engine)


class DeferredReceiver:
    """An engine that reads a slot only when the learner waits for that load, as a process that
    runs behind the learner would: a slot packed again before its wait would deliver the wrong
    bucket."""

    def __init__(self, slots: list[torch.Tensor]) -> None:
        self.slots, self.received, self.events = slots, {}, []

    def begin(self, handles: list) -> None:
        assert handles == list(range(len(self.slots)))  # one handle per slot, shared once
        self.events.append("begin")

    def load(self, bucket, slot: int) -> tuple:
        self.events.append(("load", slot))
        return bucket, slot

    def wait(self, pending: tuple) -> None:
        bucket, slot = pending
        self.received.update({k: v.clone() for k, v in unpack(bucket, slot_view(self.slots[slot], bucket)).items()})
        self.events.append(("read", slot))

    def finish(self) -> None:
        self.events.append("finish")


def test_a_stream_reuses_two_slots_and_never_packs_one_still_being_read():
    weights = {f"layer{i}.weight": torch.randn(3, 5) for i in range(7)}
    weights["layer7.bias"] = torch.arange(4, dtype=torch.int64)  # a dtype change starts a bucket
    plan = plan_buckets([(k, v.shape, v.dtype) for k, v in weights.items()], 2 * 15 * 4)
    assert len(plan) == 5
    slots = [torch.zeros(max(b.nbytes for b in plan), dtype=torch.uint8) for _ in range(2)]
    receiver = DeferredReceiver(slots)
    shared = iter(range(2))
    sent = stream_buckets(((b, weights) for b in plan), slots, receiver, share=lambda slot: next(shared))
    assert sent == 5
    assert receiver.received.keys() == weights.keys()
    assert all(torch.equal(receiver.received[k], v) for k, v in weights.items())
    # Each slot is read before it is packed again, and the first read comes only when the
    # third bucket needs the first slot: the learner runs one bucket ahead of the engine.
    assert receiver.events == [
        "begin",
        ("load", 0),
        ("load", 1),
        ("read", 0),
        ("load", 0),
        ("read", 1),
        ("load", 1),
        ("read", 0),
        ("load", 0),
        ("read", 1),
        ("read", 0),
        "finish",
    ]


def test_a_bucket_larger_than_its_slot_is_refused():
    plan = plan_buckets([("w", torch.Size([8]), torch.float32)], 1 << 10)
    slots = [torch.empty(16, dtype=torch.uint8)]
    with pytest.raises(ValueError, match="does not fit"):
        stream_buckets(((b, {"w": torch.ones(8)}) for b in plan), slots, DeferredReceiver(slots), share=lambda slot: 0)


def test_only_a_cuda_buffer_has_an_ipc_handle():
    with pytest.raises(ValueError, match="CUDA IPC needs"):
        ipc_handle(torch.empty(4, dtype=torch.uint8))
