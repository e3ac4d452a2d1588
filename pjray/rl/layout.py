"""Where the rollout engines run beside the learner ranks, and everything that follows from it.

A layout is chosen once from the config (`choose_layout`); the trainer asks it (`Layout`, a
protocol) and never names one. It owns which roles are placed and how (`roles`), how the rollout
side starts (`start_rollout`), the weight transport (`connect`), what happens around a step's
generation (`after_generation`), a sync (`sync`), version stamping (`staleness`), and which
actors report memory as which role (`memory_roles`). Three sibling classes implement it:

* `Split` (rollout workers of their own): weights travel over the transport `trainer.sync_backend`
  names (`auto`: `pjray.sync.transports.auto_transport`), or with LoRA the adapter alone through
  the object store (`model.lora.sync`, `AdapterTransport`); every sample is stamped with the
  version that made it, which lets generation run ahead of training (`trainer.max_staleness`).
* `Colocated` (rollout.colocate): rollout worker i shares learner rank i's GPU bundle. Its engine
  starts once the ranks hold their memory (it sizes its KV cache from what is free), sleeps while
  the learner trains and wakes at the sync. With LoRA it takes merged weights (model.lora.sync=auto
  resolves to merged): a sleeping engine discards its weights, which only a full sync restores.
* `Hybrid` (rollout.backend=hybrid): the learner ranks generate with the weights they train; no
  rollout workers, no transport, no version gap.

The two layouts with rollout workers derive from `WithWorkers`, which holds what they share (the
workers' start, transport and refresh). Adding a layout is one class here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Protocol

import ray

from pjray.config import Config, ModelConfig, RolloutConfig
from pjray.placement import Placement, RankGroup, RoleResources, WorkerPool
from pjray.rl.timer import Timer
from pjray.rollout.worker import RolloutWorker
from pjray.sync.transports import AdapterTransport, Transport, auto_transport, make_transport
from pjray.types import Completion

log = logging.getLogger(__name__)

# A rollout pool: rollout workers (WorkerPool) or the learner ranks themselves (RankGroup).
Rollout = WorkerPool | RankGroup


class Layout(Protocol):
    def roles(self) -> dict[str, RoleResources]:
        """The actors a training places, by role (learner, rollout where it has workers, reward)."""

    def learner_rollout(self) -> RolloutConfig | None:
        """The rollout settings the learner ranks generate with (`LearnerRank(rollout_cfg=...)`),
        None where they only train."""

    def start_rollout(
        self, placement: Placement, learners: list, starting: list, model_path: str, version: Callable[[], int]
    ) -> Rollout:
        """The rollout pool, its workers started (their `ready` calls appended to `starting`); a
        worker rebuilt later is brought to the learner's weights of `version()`."""

    def connect(self, learners: list, rollout: Rollout) -> None:
        """Set up the weight transport, once the learners and the pool are ready."""

    def after_generation(self, rollout: Rollout, timer: Timer) -> None:
        """What happens between a step's generation and its update."""

    def sync(self, learners: list, rollout: Rollout, version: int) -> None:
        """The learner's weights of `version` to every engine."""

    def staleness(self, version: int, completions: list[Completion]) -> list[int]:
        """Weight versions between the learner's weights now and those that sampled each completion."""

    def memory_roles(self, learners: list, pools: dict[str, WorkerPool], rollout: Rollout) -> dict[str, list]:
        """The actors whose peak memory is reported, by role (`pools`: the task's scoring roles)."""

    def close(self, learners: list) -> None:
        """Release what the transport holds."""


def base_roles(cfg: Config) -> dict[str, RoleResources]:
    """The learner ranks and the reward workers, which every layout places."""
    return {
        "learner": RoleResources(
            cfg.learner.num_ranks,
            cfg.learner.num_cpus_per_rank,
            cfg.learner.num_gpus_per_rank,
            resources=dict(cfg.learner.resources),
        ),
        "reward": RoleResources(cfg.reward.num_workers, cfg.reward.num_cpus_per_worker, 0.0),
    }


class WithWorkers:
    """What the layouts with rollout workers of their own share: the workers' placement, start,
    weight transport and refresh. `Split` and `Colocated` derive from it and add, each its own,
    how a step's generation, a sync and the workers' start are timed; neither overrides the other."""

    share_learner_bundles = False

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.transport: Transport | None = None
        # What a sync sends with LoRA: "adapter", "merged", or "" (no LoRA).
        self.lora_sync = cfg.model.lora.sync_mode(cfg.rollout, cfg.trainer.sync_backend)

    def roles(self) -> dict[str, RoleResources]:
        cfg, base = self.cfg, base_roles(self.cfg)
        rollout = RoleResources(
            cfg.rollout.num_workers,
            cfg.rollout.num_cpus_per_worker,
            cfg.rollout.num_gpus_per_worker,
            share_with="learner" if self.share_learner_bundles else None,
            resources=dict(cfg.rollout.resources),
        )
        # In placement order: a role that shares another's bundles comes after it.
        return {"learner": base["learner"], "rollout": rollout, "reward": base["reward"]}

    def learner_rollout(self) -> RolloutConfig | None:
        """None: the learner ranks only train."""
        return None

    def worker_model(self) -> ModelConfig:
        """The model settings the rollout workers start with: model.lora.sync resolved (an engine
        that takes the adapter alone starts with LoRA serving on)."""
        model = self.cfg.model
        if not self.lora_sync:
            return model
        return dataclasses.replace(model, lora=dataclasses.replace(model.lora, sync=self.lora_sync))

    def start_workers(
        self, placement: Placement, learners: list, starting: list, model_path: str, version: Callable[[], int]
    ) -> WorkerPool:
        """The rollout pool, its workers starting (their `ready` calls appended to `starting`)."""
        cfg = self.cfg
        threads = placement.threads("rollout", cfg.rollout.num_threads)
        model_cfg = self.worker_model()
        pool = WorkerPool(
            placement,
            "rollout",
            RolloutWorker,
            lambda i: (model_path, model_cfg, cfg.rollout, i, threads[i]),
            max_retries=cfg.trainer.max_step_retries,
            wait=False,
            on_restart=lambda worker: self.refresh(learners, pool, worker, version()),
        )
        starting += pool.ready()
        return pool

    def connect(self, learners: list, rollout: Rollout) -> None:
        """Choose the weight transport once (`trainer.sync_backend`; `auto` from where the actors
        landed) and set it up. With LoRA and model.lora.sync resolving to adapter: the adapter
        transport, whatever trainer.sync_backend (auto or object_store, as validated) says."""
        cfg = self.cfg
        if self.lora_sync == "adapter":
            log.info(
                "weight sync: the LoRA adapter alone, through the object store (model.lora.sync=%s)",
                cfg.model.lora.sync,
            )
            self.transport = AdapterTransport(cfg.trainer.sync_bucket_mb << 20)
            self.transport.connect(learners, rollout)
            return
        name = cfg.trainer.sync_backend
        if name == "auto":
            learner_node = ray.get(learners[0].node_id.remote())
            workers = ray.get([w.node_id.remote() for w in rollout.actors])
            name = auto_transport(cfg.rollout, cfg.learner.num_gpus_per_rank > 0, learner_node, workers)
            log.info(
                "weight sync: %s (trainer.sync_backend=auto; learner rank 0 on node %s, rollout workers on %s)",
                name,
                learner_node[:8],
                [w[:8] for w in workers],
            )
        self.transport = make_transport(name, cfg.trainer.sync_bucket_mb << 20, cfg.rollout.tensor_parallel_size)
        self.transport.connect(learners, rollout)

    def send(self, learners: list, rollout: Rollout, version: int) -> None:
        """The learner's weights of `version` to every engine, which stamps it on what it samples."""
        assert self.transport is not None
        self.transport.send(learners, rollout)
        rollout.broadcast("set_weight_version", version)

    def refresh(self, learners: list, rollout: Rollout, worker: Any, version: int) -> None:
        """Bring one rebuilt rollout worker to the learner's weights of `version`."""
        assert self.transport is not None
        self.transport.refresh(learners, rollout, worker)
        ray.get(worker.set_weight_version.remote(version))

    def close(self, learners: list) -> None:
        if self.transport is not None:
            self.transport.close(learners)

    def staleness(self, version: int, completions: list[Completion]) -> list[int]:
        """How many updates behind the learner's `version` each completion's sampling weights are."""
        return [version - c.weight_version for c in completions]

    def memory_roles(self, learners: list, pools: dict[str, WorkerPool], rollout: Rollout) -> dict[str, list]:
        return {"learner": learners, **{role: p.actors for role, p in pools.items()}, "rollout": rollout.actors}


class Split(WithWorkers):
    """Rollout workers in bundles of their own, weights sent after every update."""

    def start_rollout(
        self, placement: Placement, learners: list, starting: list, model_path: str, version: Callable[[], int]
    ) -> Rollout:
        return self.start_workers(placement, learners, starting, model_path, version)

    def after_generation(self, rollout: Rollout, timer: Timer) -> None:
        """Nothing: the engines keep their memory."""

    def sync(self, learners: list, rollout: Rollout, version: int) -> None:
        self.send(learners, rollout, version)


class Colocated(WithWorkers):
    """Rollout worker i in learner rank i's GPU bundle, asleep while the learner trains."""

    share_learner_bundles = True

    def start_rollout(
        self, placement: Placement, learners: list, starting: list, model_path: str, version: Callable[[], int]
    ) -> Rollout:
        # An engine sizes its KV cache from the GPU memory it finds free: start it once the
        # learner ranks (and whatever else was starting) hold theirs.
        ray.get(starting)
        return self.start_workers(placement, learners, starting, model_path, version)

    def after_generation(self, rollout: Rollout, timer: Timer) -> None:
        """The engines hand their GPU memory to the learner until the next sync wakes them."""
        with timer("sleep"):
            rollout.broadcast("sleep")

    def sync(self, learners: list, rollout: Rollout, version: int) -> None:
        """GPU memory changes hands in this order: the learners return their allocator's cached
        blocks, the sleeping engines wake their weights and load, the learners free their two
        stream buffers, and only then do the engines wake their KV caches."""
        ray.get([r.release_memory.remote() for r in learners])
        self.send(learners, rollout, version)
        rollout.broadcast("wake_up")


class Hybrid:
    """The learner ranks generate with the weights they train: no rollout workers, nothing to send."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def roles(self) -> dict[str, RoleResources]:
        return base_roles(self.cfg)

    def learner_rollout(self) -> RolloutConfig | None:
        return self.cfg.rollout

    def start_rollout(
        self, placement: Placement, learners: list, starting: list, model_path: str, version: Callable[[], int]
    ) -> Rollout:
        """The learner ranks, as a pool that calls every rank (no worker is ever rebuilt)."""
        return RankGroup(learners)

    def connect(self, learners: list, rollout: Rollout) -> None:
        log.info("weight sync: none (rollout.backend=hybrid: the learner ranks generate with the weights they train)")

    def after_generation(self, rollout: Rollout, timer: Timer) -> None:
        """Nothing: the ranks' memory is their own."""

    def sync(self, learners: list, rollout: Rollout, version: int) -> None:
        """Nothing to send: the engine is the learner."""

    def staleness(self, version: int, completions: list[Completion]) -> list[int]:
        """The learner's own weights sampled every completion."""
        return [0] * len(completions)

    def memory_roles(self, learners: list, pools: dict[str, WorkerPool], rollout: Rollout) -> dict[str, list]:
        """The learner ranks are the rollout role too."""
        return {"learner": learners, **{role: p.actors for role, p in pools.items()}}

    def close(self, learners: list) -> None:
        """No transport to release."""


def choose_layout(cfg: Config) -> Layout:
    """The layout `cfg` describes (rollout.backend=hybrid, else rollout.colocate, else split)."""
    if cfg.rollout.backend == "hybrid":
        return Hybrid(cfg)
    if cfg.rollout.colocate:
        return Colocated(cfg)
    return Split(cfg)
