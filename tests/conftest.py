"""Shared fixtures. One real local Ray instance per test session (start-up is paid once)."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="module")
def ray_session():
    """A real local Ray with 2 CPUs, shared by every test that trains: started by the
    first module that needs it and kept for the next ones (start-up is paid once), unless a
    module that builds its own cluster (multi-node tests) shut it down in between."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, logging_level="WARNING")
    return ray


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray_at_the_end():
    yield
    import ray

    ray.shutdown()


@pytest.fixture
def storage(tmp_path):
    path = tmp_path / "runs"
    path.mkdir()
    return str(path)
