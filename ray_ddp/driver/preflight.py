"""Everything about a request that can be refused without Ray: the config, the task (it
imports, it implements the interface, its data and model work), the checkpoint to resume
from, the batch against the data. Each refusal is a ConfigError with one line saying what
to change, raised before any cluster work."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray_ddp.checkpoint.format import (
    CheckpointError,
    check_compatible,
    check_strategy,
    load_checkpoint_state,
    task_meta,
)
from ray_ddp.config import ConfigError, TrainConfig, validate
from ray_ddp.config.batch import global_batch
from ray_ddp.config.sections import Optimisation, Scaling, Target
from ray_ddp.driver.rerun_guard import check_rerun
from ray_ddp.driver.tracking import check_tracking
from ray_ddp.task import Task
from ray_ddp.task.checks import check_facts, user_code
from ray_ddp.task.loading import load_task


@dataclass(frozen=True)
class PreparedTask:
    """A task that passed the checks, with what they learnt about its data."""

    task: Task
    facts: dict[str, Any]
    """``task.describe(cfg)``: saved in every checkpoint, given to ``task.model``."""
    train_size: int | None
    val_size: int | None
    resume_config: dict[str, Any] | None = None
    """The config saved in the ``--resume-from`` checkpoint (None without one)."""

    def meta(self, target: Target) -> dict[str, Any]:
        """What a checkpoint of this run (of ``target.task``) records about its model."""
        return task_meta(target.task, self.facts)


def preflight(
    cfg: TrainConfig, batch_sizes: Sequence[int] = (), task: Task | None = None
) -> PreparedTask:
    """Check ``cfg`` and its task (``task``, else the one ``cfg.target.task`` names), and the
    per-worker ``batch_sizes`` a sweep will try (default: the config's own) against the
    data."""
    validate(cfg)
    check_tracking(cfg.logging)
    if (
        cfg.optim.amp == "fp16"
        and cfg.scaling.use_gpu is None
        and not cfg.scaling.address
        and not os.environ.get("RAY_ADDRESS")  # a submitted job: the GPUs are the cluster's
        and not _local_gpus()
    ):
        raise ConfigError(
            "--amp fp16 needs GPUs and this machine has none; use --amp bf16 or --amp off"
        )
    task = task if task is not None else load_task(cfg.target.task)
    facts = check_facts(task, user_code(task, "describe", lambda: task.describe(cfg)))
    train_size, val_size = user_code(task, "check", lambda: task.check(cfg, facts))
    prepared = PreparedTask(task, facts, train_size, val_size)
    check_rerun(cfg, global_batch=False)  # compared once the worker count is resolved
    if cfg.checkpointing.resume_from:
        try:
            state = load_checkpoint_state(cfg.checkpointing.resume_from)
            check_compatible(
                state, prepared.meta(cfg.target), f"--resume-from {cfg.checkpointing.resume_from}"
            )
            check_strategy(
                state, cfg.scaling.strategy, f"--resume-from {cfg.checkpointing.resume_from}"
            )
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from exc
        prepared = dataclasses.replace(prepared, resume_config=state.get("config"))
    for batch_size in batch_sizes or [cfg.optim.batch_size]:
        check_batch_fits(cfg.scaling, cfg.optim, train_size, batch_size)
    return prepared


def check_batch_fits(
    scaling: Scaling, optim: Optimisation, train_size: int | None, batch_size: int
) -> None:
    """A per-worker batch larger than a worker's shard of the data is never filled: it is
    refused rather than run as something else. Needs num_workers; a no-op while it is
    "auto"."""
    if train_size is None or not scaling.num_workers:
        return
    shard = -(-train_size // scaling.num_workers)  # at the most workers, for an elastic run
    if batch_size > shard:
        raise ConfigError(
            f"--batch-size {batch_size} (per worker) is larger than a worker's "
            f"share of the {train_size} training samples ({shard}); lower it"
        )
    accum = optim.accum_steps
    batch = global_batch(batch_size, scaling.num_workers, accum)
    if batch > train_size:
        raise ConfigError(
            f"--accum-steps {accum} makes a global batch of {batch} ({batch_size} x "
            f"{scaling.num_workers} workers x {accum}), more than the {train_size} "
            "training samples, so no optimizer step would be full; lower --accum-steps or "
            "--batch-size"
        )


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
