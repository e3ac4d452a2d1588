"""Joining or starting the Ray cluster: the one place every pjray entry point connects to Ray.

`connect(ray_cfg)` joins the cluster the job runs in (`ray.address`, else `RAY_ADDRESS`, which
`ray job submit` sets) or starts a local one with `ray.num_cpus` CPUs (and Ray's dashboard only
with `ray.dashboard=true`). Every actor and task then starts with `actor_env()`: pjray's
defaults for variables the user (or the job's runtime env) did not set.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading

from pjray.config import RayConfig
from pjray.console import ACTOR_WARNING_FILTERS, NO_PROGRESS_BARS_ENV, verbose

__all__ = ["actor_env", "connect", "job_env_vars"]


def connect(ray_cfg: RayConfig) -> None:
    """Join the cluster we run in (ray.address / RAY_ADDRESS) or start a local one; a no-op when
    this process is already connected."""
    import ray

    if ray.is_initialized():
        return
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS") or None
    kwargs = {} if address else {"num_cpus": ray_cfg.num_cpus or None, "include_dashboard": ray_cfg.dashboard}
    # ray.init replaces the SIGTERM handler with sys.exit; keep a handler the caller installed
    # (pjray.signals: `ray job stop` stops a training at a checkpoint).
    sigterm = signal.getsignal(signal.SIGTERM)
    # Ray's own INFO lines (the local instance and its dashboard address) only with --verbose.
    level = logging.INFO if verbose() else logging.WARNING
    ray.init(address=address, runtime_env={"env_vars": actor_env()}, log_to_driver=True, logging_level=level, **kwargs)
    if callable(sigterm) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, sigterm)


def actor_env() -> dict[str, str]:
    """Defaults for every actor's environment; a variable the user set (also through a job's
    runtime env) wins."""
    defaults = {
        "TOKENIZERS_PARALLELISM": "false",
        # Weight buckets travel as out-of-band buffers, mapped read-only on get, not pickled: a
        # faster sync (benchmarks/bench_sync.py; benchmarks/results/design_notes.md). Receivers
        # only copy.
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
        # vLLM turns NCCL's cuMem allocator off in its workers at import; a learner that kept it
        # on would join the weight-sync group with a different setting (hangs or errors in the
        # broadcast). Every actor gets the same value, the learner's included.
        "NCCL_CUMEM_ENABLE": "0",
    }
    if not verbose():
        defaults["PYTHONWARNINGS"] = ACTOR_WARNING_FILTERS
        defaults[NO_PROGRESS_BARS_ENV] = "1"
    # Under `ray job submit` the job's runtime env already reaches every actor, and ray.init
    # refuses a driver env that names one of its variables again: leave those to the job.
    job_vars = job_env_vars()
    return {key: os.environ.get(key, value) for key, value in defaults.items() if key not in job_vars}


def job_env_vars() -> dict[str, str]:
    """The env_vars of the runtime env `ray job submit` gave this driver; empty outside a job."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")  # set by Ray's job manager
    if not raw:
        return {}
    runtime_env = json.loads(raw).get("runtime_env") or {}
    return dict(runtime_env.get("env_vars") or {})
