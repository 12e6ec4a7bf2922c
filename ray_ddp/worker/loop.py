"""The built-in loop: the function Ray Train runs in every worker process for a ``Task``,
read top to bottom in the order things happen, over the run's parts:

- build them (``worker.builtin_parts``): the data, the model wrapped and its training
  state restored (the position among it), the step (``worker.step``), the step-level
  hooks, the safeguards (watchdog, checkpointer, reclaim watch, limits), rank 0's outputs;
- every epoch left, to ``--epochs`` or ``--max-steps``: passes of the epoch's global order
  (``step.train_segment``), each stopping where a checkpoint is due (``--checkpoint-every``,
  a reclaim notice); then validation and the epoch's end (``worker.epoch``);
- the outputs closed; the summary for the driver.

One worker = one DDP process = one GPU (or a CPU slot): Ray has set up the process group
(NCCL with GPUs, gloo without) and pinned the worker to its device. Rank 0 alone logs and
attaches checkpoints; every rank calls ``ray.train.report`` (a barrier).
"""

from __future__ import annotations

import time
from typing import Any

from ray_ddp.config import TrainConfig
from ray_ddp.data.unreadable import SkipLog
from ray_ddp.io.timeline import mark
from ray_ddp.reliability.retry_policy import note_step
from ray_ddp.task import Task
from ray_ddp.testing import harness as rig
from ray_ddp.testing.harness import Harness
from ray_ddp.worker.builtin_parts import Parts, build_parts
from ray_ddp.worker.epoch import (
    checkpoint_inside_epoch,
    end_epoch,
    epoch_totals,
    explain_oom,
    validate,
)
from ray_ddp.worker.results import EpochTrained, RunSoFar, fresh_sums
from ray_ddp.worker.state import EpochSums
from ray_ddp.worker.step import train_segment


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
    """Build this worker's run and train it; its summary (Ray hands rank 0's to the
    driver)."""
    parts = build_parts(config)
    try:
        return train(parts)
    finally:
        parts.guards.watchdog.stop()


def train(parts: Parts) -> dict[str, Any]:
    """Every epoch left (to ``--epochs`` or ``--max-steps``); the summary for the driver."""
    worker, progress, guards = parts.worker, parts.progress, parts.guards
    epochs = parts.cfg.optim.epochs
    if progress.epoch >= epochs or guards.limits.done(progress.step):
        worker.log(f"nothing to do: {progress.epoch} of {epochs} epochs already done")
    if parts.outputs.profiler is not None:
        parts.outputs.profiler.begin(progress.step)
    so_far, sums = RunSoFar(flops=parts.flops), parts.sums  # the restore point's epoch goes on
    try:
        for epoch in range(progress.epoch, epochs):
            if guards.limits.done(progress.step):
                break
            run_epoch(parts, epoch, sums, so_far)
            sums = fresh_sums(parts.ledger)
            if epoch + 1 < epochs and not guards.limits.done(progress.step):
                guards.reclaims.after_checkpoint(progress.step)
    except Exception as exc:
        note_step(exc, progress.step + 1)  # a restart that fails alike is not retried
        raise
    finally:
        ended = parts.outputs.close()
    mark("training ended, logs closed", f"rank {worker.rank}")
    summary = so_far.summary(worker, progress, parts.ranks, parts.watch.timing.timer)
    asked = {"asked": guards.reclaims.asked, "seconds": round(guards.reclaims.asking_s, 4)}
    return {**summary, "checkpoints": guards.checkpointer.summary(), "preemption_checks": asked,
            **ended}  # fmt: skip


def run_epoch(parts: Parts, epoch: int, sums: EpochSums, so_far: RunSoFar) -> None:
    """Train the epoch from the run's position (its first part's ``sums``), validate,
    then end it (checkpoint, report, log)."""
    progress, counter = parts.progress, parts.counter
    bad_so_far = progress.bad_samples if progress.sample else 0  # inside the epoch: go on
    parts.watch.new_epoch(SkipLog(parts.cfg.data.max_bad_samples, parts.worker.rank, epoch,
                                  total=bad_so_far))  # fmt: skip
    before = (progress.step, counter.syncs if counter else 0)
    trained = train_epoch(parts, sums)
    parts.watch.skips.log.rows += parts.data.train_order.take_unreadable()  # Ray Data's (rank 0)
    evaluated = validate(parts)
    end_epoch(parts, epoch, trained, evaluated, before, so_far)


def train_epoch(parts: Parts, sums: EpochSums) -> EpochTrained:
    """Epoch ``progress.epoch`` from ``progress.sample`` on, in passes that stop where a
    checkpoint is due; the epoch's training over every rank."""
    data, progress, guards = parts.data, parts.progress, parts.guards
    batch_size, global_batch = parts.cfg.optim.batch_size, parts.cfg.global_batch_size
    started, trained, skipped = time.perf_counter(), 0, 0
    while True:
        # A new, reproducible order every epoch, from where a checkpoint left it.
        data.train_order.set_position(progress.epoch, progress.sample)
        if data.order_record is not None:  # its checkpoints name the order they count in
            progress.order = {**data.order_record, "version": data.train_order.plan.version}
        with explain_oom(batch_size, global_batch, parts.worker, "training"):
            segment = train_segment(parts.core, data.train_order, data.train_loader, sums,
                                    parts.watch.hooks, guards.limits)  # fmt: skip
        sums, trained = segment.sums, trained + segment.samples
        skipped += segment.skipped
        if not segment.checkpoint_due:
            break
        checkpoint_inside_epoch(parts, sums)
        guards.reclaims.after_checkpoint(progress.step)
    return epoch_totals(parts, sums, trained, skipped, time.perf_counter() - started)
