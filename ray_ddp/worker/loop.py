"""The function Ray Train runs in every worker process, and what it is given: a
:class:`~ray_ddp.worker.run.WorkerRun` is built, restored and trained (see there)."""

from __future__ import annotations

from typing import Any

from ray_ddp.config import TrainConfig
from ray_ddp.task import Task
from ray_ddp.testing import harness as rig
from ray_ddp.testing.harness import Harness
from ray_ddp.worker.run import WorkerRun


def loop_config(
    cfg: TrainConfig, task: Task, facts: dict[str, Any], harness: Harness = rig.NONE,
    notices: bool = True, tracking: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """What ``train_loop_per_worker`` gets: the config as plain values, the task object
    (Ray pickles it to every worker), the facts the driver found about its data, a test's
    harness (``ray_ddp.testing``; none outside ray_ddp's tests), and whether Ray watches
    the nodes for reclaim notices (``compat.versions.reclaim_watcher_on``), and where
    rank 0 tracks the run (``tracking.params.Settings``, as a dict; None: nowhere)."""
    return {"config": cfg.to_dict(), "task": task, "facts": facts, "harness": harness,
            "notices": notices, "tracking": tracking}  # fmt: skip


def train_loop_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Build, restore and train this worker's run; its summary (Ray hands rank 0's to the
    driver)."""
    run = WorkerRun.start(config)
    try:
        run.restore()
        return run.train()
    finally:
        run.stop_watching()
