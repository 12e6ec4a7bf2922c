"""An epoch's stages around its training passes, in the built-in loop (``worker.loop``),
each over the run's parts (``worker.builtin_parts.Parts``): the epoch's sums over every
rank, a checkpoint inside the epoch (``--checkpoint-every``, a reclaim notice), the exact
validation, and the epoch's end (its unreadable samples, the position, the metrics, the
checkpoint with every rank's report, rank 0's lines); and what an out-of-memory error
says to change."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ray_ddp.checkpoint.format import unwrap
from ray_ddp.data.unreadable import skipped_line
from ray_ddp.reliability.hangs.watchdog import watched
from ray_ddp.worker.builtin_parts import Parts
from ray_ddp.worker.collectives import broadcast_buffers, sum_over_ranks
from ray_ddp.worker.evaluate import EvalResult, evaluate
from ray_ddp.worker.identity import Worker
from ray_ddp.worker.results import (
    EpochTrained,
    RunSoFar,
    better,
    epoch_metrics,
    fresh_sums,
    log_epoch,
    write_ledger,
)
from ray_ddp.worker.state import EpochSums
from ray_ddp.worker.unreadable import EpochSkips, settle


def epoch_totals(
    parts: Parts, sums: EpochSums, trained: int, skipped: int, seconds: float
) -> EpochTrained:
    """The epoch's training over every rank (a collective), from this rank's ``sums`` of
    the whole epoch and what this attempt's passes did: ``trained`` samples, ``skipped``
    fp16 steps, in ``seconds``."""
    parts.guards.watchdog.doing("epoch end: all-reduce of the epoch's sums", collective=True)
    local: dict[str, float | torch.Tensor] = {
        "loss_sum": sums.loss_sum, "samples": sums.samples, "trained": trained,
        "count": sums.count,
    }  # fmt: skip
    totals = sum_over_ranks(local, parts.worker.device)
    return EpochTrained(
        loss_sum=totals["loss_sum"], samples=int(totals["samples"]), count=totals["count"],
        all_trained=int(totals["trained"]), own_trained=trained, skipped=skipped,
        seconds=seconds, own=sums, ledger=sums.ledger,
    )  # fmt: skip


def checkpoint_inside_epoch(parts: Parts, sums: EpochSums) -> None:
    """A checkpoint where a pass stopped inside the epoch: the epoch's unreadable samples
    so far named first (before a crash can lose them), no validation."""
    progress, watchdog = parts.progress, parts.guards.watchdog
    watchdog.doing("checkpoint inside the epoch", slow=True)
    run_dir = parts.cfg.checkpointing.run_dir
    skips = settle(run_dir, parts.watch.skips.log, parts.worker.is_main)
    progress.bad_samples = skips.train  # the epoch's so far, carried in the checkpoint
    progress.bad_sample_rows = (progress.bad_sample_rows or 0) + skips.written
    _keep_tracker_run(parts)
    parts.reports.inside_epoch(sums)
    watchdog.progress(f"checkpoint at step {progress.step}")


def validate(parts: Parts) -> EvalResult:
    """Exact sharded evaluation of the weights and buffers the checkpoint will hold.

    DDP copies rank 0's buffers (BatchNorm running statistics) to the other ranks only
    at the start of a synchronised forward, so after the epoch's last step every rank
    holds its own. Rank 0's are what gets saved: every rank evaluates with those."""
    model, watchdog = unwrap(parts.state.model), parts.guards.watchdog
    watchdog.doing("evaluation: broadcast of rank 0's buffers", collective=True)
    broadcast_buffers(model)
    then = "evaluation: all-reduce of the sums"
    batches = watched(parts.data.val_loader, "evaluation", watchdog, then=then)
    cfg = parts.cfg
    with explain_oom(cfg.optim.batch_size, cfg.global_batch_size, parts.worker, "evaluation"):
        return evaluate(model, batches, parts.worker.device, parts.task, parts.core.amp,
                        stand_in=parts.core.stand_in)  # fmt: skip


def end_epoch(
    parts: Parts, epoch: int, trained: EpochTrained, evaluated: EvalResult,
    before: tuple[int, int], so_far: RunSoFar,
) -> None:  # fmt: skip
    """Count the unreadable samples (may stop the run), then the position, the metrics,
    the checkpoint with every rank's report, and rank 0's lines; the epoch added to
    ``so_far``. ``before``: the step and the all-reduce count at the epoch's start."""
    cfg, worker, progress, data = parts.cfg, parts.worker, parts.progress, parts.data
    skips = count_unreadable(parts, epoch, evaluated)
    # A --max-steps stop inside the epoch is saved as that position, so a re-run with
    # more steps trains the rest of the epoch instead of skipping it.
    finished = progress.sample >= data.train_size
    if finished:
        progress.end_epoch()
    progress.bad_samples = 0 if finished else skips.train
    progress.bad_sample_rows = (progress.bad_sample_rows or 0) + skips.written
    if finished and parts.ledger:
        write_ledger(cfg.checkpointing.run_dir, worker, epoch, trained.ledger)
    metrics = epoch_metrics(parts.task, parts.state, trained, evaluated, epoch + 1)
    metrics.update(world_size=worker.world_size, accum_steps=data.accumulation)
    metrics.update(parts.flops.of(metrics["samples_per_s"]), bad_samples=skips.total)
    progress.best_score = better(parts.task, progress.best_score, metrics)
    if parts.counter is not None:
        steps = max(1, progress.step - before[0])
        metrics["allreduces_per_step"] = (parts.counter.syncs - before[1]) / steps
    own = fresh_sums(parts.ledger) if finished else trained.own
    timing = parts.watch.timing.epoch.summary(trained.seconds)
    speed = trained.own_trained / trained.seconds
    parts.guards.watchdog.doing("epoch end: checkpoint and report", slow=True)
    _keep_tracker_run(parts)
    per_rank = parts.reports.checkpoint_and_report(
        metrics, own, speed, timing, lambda values: _track_epoch(parts, values)
    )
    log_epoch(cfg.optim, worker, parts.outputs.logs, metrics, per_rank, progress,
              data.train_size, parts.ranks)  # fmt: skip
    parts.guards.watchdog.progress("epoch end")
    so_far.add(metrics, trained, per_rank)


def count_unreadable(parts: Parts, epoch: int, evaluated: EvalResult) -> EpochSkips:
    """The epoch's unreadable samples, all ranks (a collective): named in the run's
    ``bad_samples.csv`` and said by rank 0; over ``--max-bad-samples`` every rank raises
    BadSamplesError here, before the epoch is checkpointed."""
    parts.guards.watchdog.doing("epoch end: gathering the unreadable samples", collective=True)
    run_dir, worker = parts.cfg.checkpointing.run_dir, parts.worker
    skips = settle(run_dir, parts.watch.skips.log, worker.is_main, evaluated.skipped)
    if skips.total:
        worker.log(skipped_line(epoch, skips.train, skips.val, evaluated.samples,
                                parts.data.val_size, run_dir))  # fmt: skip
    return skips


def _track_epoch(parts: Parts, metrics: dict[str, Any]) -> None:
    """The epoch's metrics to the tracker (``worker.run_tracking``), rank 0's, before Ray
    has them."""
    tracker, progress = parts.outputs.tracker, parts.progress
    if tracker is not None:
        last = progress.epoch >= parts.cfg.optim.epochs or parts.guards.limits.done(progress.step)
        tracker.reported(progress.step, metrics, last)


def _keep_tracker_run(parts: Parts) -> None:
    """The tracker's run id into the next checkpoint, once the tracker has one."""
    tracker = parts.outputs.tracker
    if tracker is not None and tracker.run_id is not None:
        parts.progress.tracking_run = tracker.run_id


@contextlib.contextmanager
def explain_oom(batch_size: int, global_batch: int, worker: Worker, phase: str) -> Iterator[None]:
    """Turn an out-of-memory error into what to change: the per-worker batch
    (``--batch-size``), keeping the run's ``global_batch``."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        size = (
            f"batches of 2 x --batch-size = {2 * batch_size}"
            if phase == "evaluation"  # no activations kept for backward: twice the batch
            else f"--batch-size {batch_size}"
        )
        raise RuntimeError(
            f"out of memory on rank {worker.rank} ({worker.device}) during {phase} with {size} "
            f"per worker: lower --batch-size and raise --accum-steps to keep the global batch "
            f"of {global_batch}"
        ) from exc
