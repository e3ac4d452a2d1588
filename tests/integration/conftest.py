"""Fixtures shared by the integration tests."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from pjray.cluster import actor_env

TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A local 2-CPU Ray cluster for the module, unless one is already running. Its actors start
    with pjray's environment defaults and import test-only helpers (the reward functions of
    tests/integration/learnable_rewards.py) from this directory."""
    started = not ray.is_initialized()
    if started:
        path = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
        env = {**actor_env(), "PYTHONPATH": path}
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    yield
    if started:
        ray.shutdown()
