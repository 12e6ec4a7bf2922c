"""The driver's pipeline before a run, a sweep or an evaluation starts: everything that
can be refused without Ray first (``preflight``), then connect, resolve the workers against
the cluster and wait for them, re-check the batch now that the worker count is known, and
make the storage absolute and shared."""

from __future__ import annotations

from collections.abc import Sequence

from ray_ddp.cluster.connect import connect
from ray_ddp.cluster.resources import resolve_scaling
from ray_ddp.cluster.shared_storage import check_shared_storage
from ray_ddp.config import TrainConfig
from ray_ddp.driver.preflight import PreparedTask, check_batch_fits, preflight
from ray_ddp.driver.tracking import check_profile_steps
from ray_ddp.io.storage import storage_location
from ray_ddp.io.timeline import mark
from ray_ddp.task import Task


def prepare_cluster_run(
    cfg: TrainConfig,
    batch_sizes: Sequence[int] = (),
    task: Task | None = None,
    dashboard: bool = False,
) -> tuple[TrainConfig, PreparedTask]:
    """Preflight (of ``task``, else the one ``cfg.target.task`` names), connect, resolve the
    workers, re-check the batch now that the worker count is known, and make the storage
    absolute and shared; ``dashboard``: a local Ray must start its dashboard (a sweep
    needs its State API, see :func:`connect`). Returns the resolved config
    (``num_workers`` and ``use_gpu`` set, ``storage_path`` absolute or a URI) and the
    checked task."""
    prepared = preflight(cfg, batch_sizes, task)
    mark("task and data checked")
    connect(cfg.scaling.address, dashboard)
    mark("Ray connected")
    cfg = cfg.replace(scaling=resolve_scaling(cfg.scaling, cfg.optim.amp))
    for batch_size in batch_sizes or [cfg.optim.batch_size]:
        check_batch_fits(cfg.scaling, cfg.optim, prepared.train_size, batch_size)
    check_profile_steps(cfg.logging, cfg.optim, cfg.scaling, prepared.train_size)
    cfg = cfg.replace(storage_path=storage_location(cfg.checkpointing.storage_path))
    check_shared_storage(cfg.checkpointing.storage_path)
    return cfg, prepared
