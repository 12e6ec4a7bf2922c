"""A worker's view of its data: the loaders over its part of the task's splits (read by
the torch engine here, or streamed by Ray Data), and their sizes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from ray_ddp.config import TrainConfig
from ray_ddp.config.batch import accumulation
from ray_ddp.data.loaders import make_loaders
from ray_ddp.data.order.continuation import order_record, split_fingerprint
from ray_ddp.data.order.global_order import GlobalOrderBatches
from ray_ddp.task import Task
from ray_ddp.testing import harness as rig
from ray_ddp.testing.harness import Harness
from ray_ddp.worker.collectives import is_distributed
from ray_ddp.worker.identity import Worker


@dataclass
class WorkerData:
    """This worker's view of the data: loaders over its part, and their sizes."""

    train_loader: DataLoader
    train_order: GlobalOrderBatches
    """The batch sampler behind ``train_loader``: this rank's micro-batches of the epoch's
    global order, from the position it is set to."""
    val_loader: DataLoader
    train_size: int
    val_size: int
    steps_per_epoch: int
    """Optimizer steps per epoch: the same at every world size (the last may be short)."""
    accumulation: int
    """Micro-batches each worker accumulates per optimizer step at this world size."""
    order_record: dict[str, Any] | None = None
    """What decides the training split's epoch order (``data.order.continuation``); None
    for a Ray Data stream (a resume restarts its epoch)."""


def build_worker_data(
    cfg: TrainConfig,
    worker: Worker,
    task: Task,
    facts: dict[str, Any],
    harness: Harness,
    waiting: Callable[[bool], None] = lambda first: None,
) -> WorkerData:
    """The loaders over this worker's part of the task's data (``waiting``: what a Ray Data
    stream calls before each step's batches, for the watchdog)."""
    if cfg.data.data_engine == "ray":  # Ray Data reads and decodes (ray_ddp.data.ray_data)
        from ray_ddp.data.ray_data.worker import worker_data

        run_dir = cfg.checkpointing.run_dir
        return WorkerData(
            **worker_data(cfg.data, cfg.optim, cfg.global_batch_size, run_dir, worker, waiting)
        )
    if cfg.data.download:
        for turn in (0, 1):
            if download_turn(worker.rank, worker.local_rank) == turn:
                task.datasets(cfg, facts)
            if is_distributed():
                torch.distributed.barrier()
    train_ds, val_ds = task.datasets(cfg.replace(download=False), facts)
    fingerprint = split_fingerprint(train_ds)
    train_ds = rig.hang_loader(harness, cfg.checkpointing.run_dir, train_ds)
    train_loader, train_order, val_loader = make_loaders(
        cfg.optim, cfg.data, cfg.target, cfg.scaling, cfg.global_batch_size,
        task, task.random_samples(cfg), train_ds, val_ds,
        worker.rank, worker.world_size, worker.device,
    )  # fmt: skip
    return WorkerData(
        train_loader,
        train_order,
        val_loader,
        train_size=len(train_ds),  # map-style: sized
        val_size=len(val_ds),  # type: ignore[arg-type]  # map-style: sized
        steps_per_epoch=train_order.plan.steps,  # the order is at the epoch's start here
        accumulation=accumulation(cfg.global_batch_size, cfg.optim.batch_size, worker.world_size),
        order_record=order_record(train_order.plan, fingerprint),
    )


def download_turn(rank: int, local_rank: int) -> int | None:
    """When this worker fetches the data with ``--download``: turn 0 (rank 0, alone), turn
    1 (the first worker of every other node, at once), or never (None: it waits).

    One fetch per node, not one per worker racing on the same files. Rank 0's node goes
    first: where nodes share ``--data-dir`` (NFS) the others then find the files complete
    and only check them (torchvision skips a finished download), so no two nodes ever
    write the same files; where each node has its own disk, they fetch in parallel."""
    if rank == 0:
        return 0
    return 1 if local_rank == 0 else None
