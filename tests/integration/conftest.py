"""Fixtures shared by the integration tests."""

from typing import Iterator

import pytest
import ray


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A local 2-CPU Ray cluster for the module, unless one is already running."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()
