"""Ray placement of the training roles, pools of workers that survive worker deaths, and how a
list of work is cut over workers (`split_evenly`).

One placement group holds a bundle per learner rank, rollout worker and reward worker, so a
job either gets all of its resources or waits for them (no half-started job holding GPUs). It is
the training's own, or the one Ray Tune reserved for a sweep's trial (`placement_plan` sizes both).
A dead rollout or reward worker is rebuilt in its own bundle and the call it failed is retried.
"""

from __future__ import annotations

import logging
import socket
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

log = logging.getLogger(__name__)

WORKER_FAILURES = (RayActorError, ActorDiedError, ActorUnavailableError)

T = TypeVar("T")


def split_evenly(values: Sequence[T], parts: int) -> list[list[T]]:
    """`parts` contiguous chunks whose sizes differ by at most one, the longer ones first.

    With fewer values than parts there is one chunk per value (no empty chunks), so callers
    that need exactly `parts` chunks (ranks in a collective) must pass at least that many.
    """
    if parts < 1:
        raise ValueError(f"split_evenly: parts must be >= 1, got {parts}")
    size, extra = divmod(len(values), parts)
    out, start = [], 0
    for p in range(min(parts, len(values))):
        end = start + size + (p < extra)
        out.append(list(values[start:end]))
        start = end
    return out


def shared_threads(actor_nodes: Sequence[str], node_cpus: dict[str, float]) -> list[int]:
    """Intra-op threads per actor: its node's CPUs divided among the actors on that node
    (at least one each)."""
    per_node = Counter(actor_nodes)
    return [max(1, int(node_cpus.get(node, 1) // per_node[node])) for node in actor_nodes]


# Sockets holding the ports `free_address` handed out (the latest 64; one evicted closes).
_RESERVED: deque[socket.socket] = deque(maxlen=64)


def free_address() -> tuple[str, int]:
    """This node's IP and a port reserved on it by this process.

    The port stays bound here (SO_REUSEADDR, never listening): the kernel gives it to no other
    `bind` to port 0 and to no outgoing connection, while the listener it is meant for binds it
    anyway (torch's TCPStore sets SO_REUSEADDR too). A port probed and released at once could be
    taken by anything on the node before rank 0 binds it, seconds later."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    _RESERVED.append(sock)
    return ray.util.get_node_ip_address(), sock.getsockname()[1]


@dataclass(frozen=True)
class RoleResources:
    count: int
    num_cpus: float
    num_gpus: float
    # Another role whose bundles this role's actors share (actor i in that role's bundle i), so
    # both hold fractions of the same GPU: colocated learner ranks and vLLM engines.
    share_with: str | None = None
    # Custom Ray resources per actor (`ray start --resources`): the bundles, and so the actors,
    # go to nodes that offer them.
    resources: dict[str, float] = field(default_factory=dict)


def placement_plan(roles: dict[str, RoleResources], first: int = 0) -> tuple[list[dict[str, float]], dict[str, range]]:
    """The bundles a training needs, one per actor of each role (a role that shares another's
    bundles adds its share to them), and each role's bundle indices, counted from `first` (the
    bundles before it belong to someone else: a Tune trial's driver)."""
    ranges: dict[str, range] = {}
    bundles: list[dict[str, float]] = []
    for role, res in roles.items():
        if res.share_with is not None:
            host = ranges[res.share_with]  # the shared role must come first
            if res.count > len(host):
                raise ValueError(f"{role}: {res.count} actors cannot share {len(host)} {res.share_with} bundles")
            for index in host[: res.count]:
                bundle = bundles[index - first]
                bundle["CPU"] += res.num_cpus
                for name, amount in res.resources.items():
                    bundle[name] = bundle.get(name, 0.0) + amount
                if res.num_gpus:
                    # Both shares live on one whole GPU (colocated validation: sum <= 1).
                    bundle["GPU"] = 1.0
            ranges[role] = host[: res.count]
            continue
        start = first + len(bundles)
        for _ in range(res.count):
            bundle = {"CPU": res.num_cpus, **res.resources}
            if res.num_gpus:
                bundle["GPU"] = res.num_gpus
            bundles.append(bundle)
        ranges[role] = range(start, first + len(bundles))
    return bundles, ranges


def same_bundles(given: Sequence[dict[str, float]], needed: Sequence[dict[str, float]]) -> bool:
    """Whether the bundles of a placement group hold what `needed` asks, resource by resource
    (a resource of amount 0 counts as absent)."""

    def nonzero(bundle: dict[str, float]) -> dict[str, float]:
        return {k: float(v) for k, v in bundle.items() if v}

    return len(given) == len(needed) and all(nonzero(g) == nonzero(n) for g, n in zip(given, needed))


class Placement:
    """A placement group with consecutive bundle ranges per role.

    By default the group is created here (and removed at shutdown). With `group`, the actors go
    into that group instead, from bundle `first` on (a Ray Tune trial's group: bundle 0 is the
    trial's own); its bundles from `first` must be exactly the plan's, and it is left to its owner.
    """

    def __init__(
        self,
        roles: dict[str, RoleResources],
        strategy: str,
        timeout_s: float = 600.0,
        group: PlacementGroup | None = None,
        first: int = 0,
    ):
        bundles, self.ranges = placement_plan(roles, first)
        self.roles = roles
        self.actors: list[Any] = []  # every actor launched here, for shutdown
        self.owned = group is None
        if group is not None:
            given = group.bundle_specs[first:]
            if not same_bundles(given, bundles):
                raise ValueError(
                    f"the placement group given has bundles {given} from bundle {first} on; this "
                    f"training needs {bundles} (roles {', '.join(roles)})"
                )
            self.pg: PlacementGroup = group
            return
        self.pg = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s or None)
        if not ready:
            total = {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU")}
            raise RuntimeError(
                f"placement group not ready after {timeout_s:.0f}s: it needs {total['CPU']:g} CPUs "
                f"and {total['GPU']:g} GPUs (and any custom resources named) in bundles {bundles}; the cluster has "
                f"{ray.cluster_resources()}"
            )

    def strategy(self, role: str, index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg,
            placement_group_bundle_index=self.ranges[role][index],
        )

    def launch(self, role: str, cls: type, index: int, *args: Any, **kwargs: Any) -> Any:
        """Start `cls` as an actor in the `index`-th bundle of `role`."""
        res = self.roles[role]
        actor = (
            ray.remote(num_cpus=res.num_cpus, num_gpus=res.num_gpus, resources=dict(res.resources) or None)(cls)
            .options(scheduling_strategy=self.strategy(role, index), max_concurrency=1)
            .remote(*args, **kwargs)
        )
        self.actors.append(actor)
        return actor

    def threads(self, role: str, requested: int) -> list[int]:
        """torch threads for each actor of `role`: `requested` if > 0, else the CPUs of the
        actor's node shared by the role's actors on it (`shared_threads`). The driver runs
        its phases one after another, so roles take turns on a node's cores."""
        indices = list(self.ranges[role])
        if requested > 0:
            return [requested] * len(indices)
        nodes = placement_group_table(self.pg)["bundles_to_node_id"]
        cpus = {n["NodeID"]: n["Resources"].get("CPU", 1.0) for n in ray.nodes() if n["Alive"]}
        return shared_threads([nodes[i] for i in indices], cpus)

    def nodes(self) -> list[str]:
        """The Ray node id of every bundle, in bundle order."""
        table = placement_group_table(self.pg)["bundles_to_node_id"]
        return [table[i] for i in range(len(table))]

    def master_address(self, role: str) -> tuple[str, int]:
        """IP and a free port on the node of the role's first bundle (for torch.distributed):
        reserved here when that node is the driver's, else by a task in the bundle (whose pooled
        worker process holds it while it lives)."""
        node = placement_group_table(self.pg)["bundles_to_node_id"][self.ranges[role][0]]
        if node == ray.get_runtime_context().get_node_id():
            return free_address()  # no worker process to start for a port number
        task = ray.remote(num_cpus=min(0.01, self.roles[role].num_cpus))(free_address)
        return ray.get(task.options(scheduling_strategy=self.strategy(role, 0)).remote())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Kill every actor launched here (also one still in its constructor) and wait until
        they are gone, then free the bundles. A caller that shuts Ray down next (an interrupted
        job) must not pull the raylet from under a live actor: the actor would die on a failed
        check with a C++ stack dump on the console."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.actors:
            # A call to a killed actor resolves (with ActorDiedError) once the actor is dead.
            calls = [a.__ray_ready__.remote() for a in self.actors]
            ray.wait(calls, num_returns=len(calls), timeout=timeout_s)
        self.actors = []
        if self.owned:
            remove_placement_group(self.pg)


class WorkerPool:
    """Actors of one role. `call` spreads one call per worker and rebuilds dead workers.

    `lockstep` is False: a call may go to fewer workers than the pool has.

    `on_restart(actor)` brings a rebuilt worker up to date (for rollout workers: the current
    weights) before its call is retried, so a retried call computes exactly what the lost one
    would have, and only results of calls that succeeded are ever returned.
    """

    def __init__(
        self,
        placement: Placement,
        role: str,
        cls: type,
        args: Callable[[int], tuple],
        max_retries: int,
        on_restart: Callable[[Any], None] | None = None,
        wait: bool = True,
    ):
        self.placement, self.role, self.cls, self.args = placement, role, cls, args
        self.max_retries = max_retries
        self.on_restart = on_restart
        self.actors = [placement.launch(role, cls, i, *args(i)) for i in range(placement.roles[role].count)]
        if wait:
            ray.get(self.ready())
        self.restarts = 0
        self.lockstep = False

    def __len__(self) -> int:
        return len(self.actors)

    def ready(self) -> list[Any]:
        """One ref per worker that resolves once its constructor has finished (raises if it
        failed); with `wait=False` the caller gets them here and waits with other roles'."""
        return [a.ready.remote() for a in self.actors]

    def restart(self, *indices: int) -> None:
        """Rebuild the workers at `indices`, all of them before `on_restart` sees any: bringing
        one up to date may need every worker alive (a weight-sync group of them all)."""
        rebuilt = []
        for index in indices:
            log.warning("%s worker %d died; restarting it", self.role, index)
            try:
                ray.kill(self.actors[index], no_restart=True)
            except Exception:  # already gone
                pass
            actor = self.placement.launch(self.role, self.cls, index, *self.args(index))
            ray.get(actor.ready.remote())
            self.actors[index] = actor
            self.restarts += 1
            rebuilt.append(actor)
        if self.on_restart is not None:
            for actor in rebuilt:
                self.on_restart(actor)

    def call(self, method: str, per_worker_args: list[tuple]) -> list[Any]:
        """Call `method(*per_worker_args[i])` on worker i (fewer args lists than workers is fine)."""
        return self.submit(method, per_worker_args).wait()

    def submit(self, method: str, per_worker_args: list[tuple]) -> PendingCall:
        """`call` without waiting: the calls start now, `wait()` on the answer collects them
        (rebuilding dead workers and retrying their calls then)."""
        refs = {i: getattr(self.actors[i], method).remote(*a) for i, a in enumerate(per_worker_args)}
        return PendingCall(self, method, per_worker_args, refs, {i: self.actors[i] for i in refs})

    def collect(self, started: PendingCall) -> list[Any]:
        """The answers of `started`, a worker that died meanwhile rebuilt and its call retried.
        A call that went to a worker rebuilt since (by another call's collect: several calls may
        be in flight) is sent again to the new one without rebuilding it twice."""
        method, per_worker_args = started.method, started.per_worker_args
        pending, sent_to = dict(started.refs), dict(started.actors)
        results: list[Any] = [None] * len(per_worker_args)
        attempts = 0
        while pending:
            failed = []
            for i, ref in pending.items():
                try:
                    results[i] = ray.get(ref)
                except WORKER_FAILURES:
                    failed.append(i)
            if not failed:
                break
            attempts += 1
            if attempts > self.max_retries:
                raise RuntimeError(f"{self.role} workers {failed} kept dying ({attempts} attempts)")
            self.restart(*[i for i in failed if self.actors[i] is sent_to[i]])
            sent_to = {i: self.actors[i] for i in failed}
            pending = {i: getattr(self.actors[i], method).remote(*per_worker_args[i]) for i in failed}
        return results

    def broadcast(self, method: str, *args: Any) -> list[Any]:
        return self.call(method, [args] * len(self.actors))

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


@dataclass
class PendingCall:
    """Calls a pool has started (`submit`); `wait` returns their answers in worker order."""

    pool: WorkerPool | RankGroup
    method: str
    per_worker_args: list[tuple]
    refs: dict[int, Any]
    actors: dict[int, Any]  # the actor each call went to

    def wait(self) -> list[Any]:
        return self.pool.collect(self)


class RankGroup:
    """The learner ranks seen through the pool interface (`call`, `broadcast`, `len`), for the
    hybrid engine's generation. Ranks run collectives together, so every call goes to every
    rank (`lockstep`), and a dead rank is not rebuilt: its error ends the step."""

    def __init__(self, actors: list[Any]):
        self.actors = actors
        self.restarts = 0
        self.lockstep = True

    def __len__(self) -> int:
        return len(self.actors)

    def call(self, method: str, per_worker_args: list[tuple]) -> list[Any]:
        return self.submit(method, per_worker_args).wait()

    def submit(self, method: str, per_worker_args: list[tuple]) -> PendingCall:
        if len(per_worker_args) != len(self.actors):
            raise ValueError(f"{method}: {len(per_worker_args)} argument lists for {len(self.actors)} ranks (lockstep)")
        refs = {i: getattr(a, method).remote(*args) for i, (a, args) in enumerate(zip(self.actors, per_worker_args))}
        return PendingCall(self, method, per_worker_args, refs, dict(enumerate(self.actors)))

    def collect(self, started: PendingCall) -> list[Any]:
        return ray.get([started.refs[i] for i in range(len(started.refs))])

    def broadcast(self, method: str, *args: Any) -> list[Any]:
        return self.call(method, [args] * len(self.actors))
