"""`ray.*`: the Ray cluster a job joins or starts, and how its actors are placed (pjray.cluster).

Named cluster.py, not ray.py, so that the section's module is never taken for Ray itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from pjray.config.fields import opt


@dataclass(frozen=True)
class RayConfig:
    # Empty: RAY_ADDRESS if set (as under `ray job submit`), else a local cluster.
    address: str = ""
    num_cpus: int = opt(0, ge=0)  # local cluster only; 0: all cores
    # Local cluster only: Ray's dashboard (http://127.0.0.1:8265) beside it. Off: it costs every
    # start ~2 s on 2 cores, and a cluster started with `ray start` has its own.
    dashboard: bool = False
    # GPUs the job's layout must fit in (validated before anything starts); 0: not checked
    # here (the placement group then waits for the cluster and fails with the layout).
    num_gpus: int = opt(0, ge=0)
    placement_strategy: str = opt("PACK", choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    # How long a job waits for its placement group (the cluster busy with other jobs, or
    # autoscaling); 0: wait as long as it takes.
    placement_timeout_s: float = opt(600.0, ge=0)

    def check(self) -> None:
        """Each field's own rule (`opt`); whether the layout fits num_gpus is a tie to the learner
        and rollout sections (pjray.config.cross.check_gpus_fit)."""
