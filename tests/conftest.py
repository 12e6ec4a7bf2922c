"""Shared fixtures. One real local Ray instance for the whole test session.

Modules that need a cluster of their own (several simulated nodes, a token-auth head, a
benchmark that starts its own Ray) are marked ``own_cluster`` and run after all the
others, so the shared instance starts once and is stopped once, before them.
"""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ray_ddp.cluster import QUIET_LOCAL_RAY  # noqa: E402 - after the path is set

# Ray reads this once, on import: every worker prints the same rank-table header and
# restart lines, which deduplication would fold away (the entry points set it too).
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# The Ray the tests start is a local one, like the one jobs/train.py starts for itself:
# the same quiet settings (cluster.QUIET_LOCAL_RAY), and fits on it get the same trimmed
# Ray Train (lean_trainer). Every Train controller (Tune trials' and the own clusters'
# too) polls its workers every 0.5 s instead of 2 s: a finished run is noticed sooner.
# Measured on 2 cores, a 1-epoch run: 9.5 s instead of 14 s, over ~30 runs in the suite.
os.environ.update(QUIET_LOCAL_RAY)
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests with their own Ray cluster last (a stable sort keeps the order otherwise)."""
    items.sort(key=lambda item: item.get_closest_marker("own_cluster") is not None)


@pytest.fixture(scope="session")
def ray_session():
    """A real local Ray with 2 CPUs, shared by every test that trains."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def straight_run(ray_session, tmp_path_factory):
    """The uninterrupted 2-worker run of ``ledgers.EXACT_RUN`` that the world-size tests
    compare with. Session-wide, so the simulated cluster of test_elastic (which shuts the
    shared Ray down) reuses it rather than training it again on its slower nodes."""
    from ledgers import EXACT_RUN

    from ray_ddp.trainer import fit

    storage = str(tmp_path_factory.mktemp("straight"))
    return fit(
        "ray_ddp.image_classification:ImageClassification",
        num_workers=2,
        storage_path=storage,
        name="straight",
        **EXACT_RUN,
    )


@pytest.fixture(scope="module")
def no_shared_ray():
    """For a module that starts its own cluster: the shared instance must not run beside
    it (one Ray per machine), and runs last (see ``pytest_collection_modifyitems``)."""
    import ray

    ray.shutdown()
    yield
    ray.shutdown()


@pytest.fixture
def storage(tmp_path):
    path = tmp_path / "runs"
    path.mkdir()
    return str(path)
