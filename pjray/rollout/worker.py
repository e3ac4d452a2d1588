"""`RolloutWorker`: the rollout actor around one engine (`pjray.rollout.engine.build_engine`),
and `generate_with_pool`, how the driver spreads a step's prompts over a pool of them."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
import torch

from pjray.config import ModelConfig, RolloutConfig
from pjray.memory import peak_memory_mib
from pjray.placement import split_evenly
from pjray.rollout.engine import RolloutEngine, build_engine
from pjray.sync.buckets import Bucket
from pjray.types import Completion, JudgePrompt, Timed

if TYPE_CHECKING:
    from pjray.placement import PendingCall, RankGroup, WorkerPool

__all__ = ["PendingGeneration", "RolloutWorker", "generate_with_pool", "submit_generation"]


def generate_with_pool(pool: WorkerPool | RankGroup, prompts: list[JudgePrompt], n: int, seed: int) -> Timed[list[Completion]]:
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


class RolloutWorker:
    """One rollout replica. A plain class: the driver launches it with
    `ray.remote(num_cpus=..., num_gpus=...)(RolloutWorker)`, and tests can build it directly.
    """

    def __init__(
        self, model_path: str, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, worker_index: int, num_threads: int = 0
    ) -> None:
        self.worker_index = worker_index
        if num_threads:
            torch.set_num_threads(num_threads)
        # Ray hides unassigned GPUs, so a GPU is visible here exactly when one was requested.
        device = "cuda" if rollout_cfg.num_gpus_per_worker > 0 and torch.cuda.is_available() else "cpu"
        self.engine: RolloutEngine = build_engine(model_path, model_cfg, rollout_cfg, device=device)
        self.weight_version = 0  # the training step whose weights the engine holds

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

    def load_weights(self, plan: list[Bucket], refs: list[Any]) -> None:
        """See `HFEngine.load_weights`. Pass `refs` inside a list so Ray does not resolve them
        all up front: the engine fetches one bucket at a time."""
        self.engine.load_weights(plan, refs)

    def load_shared(self, plan: list[Bucket], paths: list[str]) -> None:
        """Same-node sync: the engine copies from learner rank 0's shared-memory buffers
        (`pjray.sync.shared`), mapped once and reused at every sync."""
        self.engine.load_shared(plan, paths)

    def node_id(self) -> str:
        """The Ray node this worker runs on."""
        return ray.get_runtime_context().get_node_id()

    def checksums(self) -> dict[str, str]:
        return self.engine.checksums()

    # The broadcast and IPC transports exist only on the vLLM engine (pjray.sync); the
    # driver calls them only when trainer.sync_backend selects them, which config validation
    # allows only with rollout.backend=vllm.

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, backend: str) -> list[int]:
        return self.engine.init_weight_sync(host, port, rank_offset, world_size, backend)  # type: ignore[attr-defined]

    def receive_weights(self, plan: list[Bucket]) -> None:
        self.engine.receive_weights(plan)  # type: ignore[attr-defined]

    def load_ipc(self, plan: list[Bucket], handles: list[Any]) -> None:
        self.engine.load_ipc(plan, handles)  # type: ignore[attr-defined]

    def continuation_logprobs(self, prompt: JudgePrompt, continuation: tuple[int, ...]) -> list[float]:
        return self.engine.continuation_logprobs(prompt, continuation)  # type: ignore[attr-defined]

    def sleep(self) -> None:
        self.engine.sleep()

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
