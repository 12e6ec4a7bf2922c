"""What every worker reports to Ray Train: its metrics (a barrier: every rank reports
the same number of times) and, from rank 0 only, a checkpoint of every rank's state at an
optimizer-step boundary.

``--checkpoint-mode sync`` writes it to a temporary directory and Ray uploads it before
``report`` returns: every rank waits for the upload. ``async`` (:class:`CheckpointWriter`)
only takes a snapshot of the state in host memory; Ray's upload thread writes and uploads
it while training goes on, and registers it once it is complete in storage (a crash
before that leaves the previous checkpoint the latest). At most one is in flight: the next
checkpoint waits for the previous upload, and says so. A snapshot's memory is its own until
its upload finally succeeds or finally fails (``compat.checkpoint_upload`` retries it)."""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import ray.train

from ray_ddp.checkpoint.format import Snapshots, is_fsdp, state_of, write_state
from ray_ddp.compat.checkpoint_upload import async_upload_supported, report_async, report_sync
from ray_ddp.config import TrainConfig
from ray_ddp.io import reporting
from ray_ddp.testing import harness as rig
from ray_ddp.testing.harness import Harness
from ray_ddp.worker.collectives import all_gather, broadcast_buffers
from ray_ddp.worker.identity import Worker, peak_memory
from ray_ddp.worker.sharding import save_shards
from ray_ddp.worker.state import EpochSums, TrainState
from ray_ddp.worker.step import EpochPosition


class CheckpointWriter:
    """Rank 0's checkpoints in ``--checkpoint-mode async``: the snapshot's host memory
    (reused), the one upload in flight, and what each checkpoint blocked training for."""

    def __init__(self, mode: str, log: Any) -> None:
        self.log = log
        self.asynchronous = mode == "async" and async_upload_supported()
        if mode == "async" and not self.asynchronous:
            log("--checkpoint-mode async needs Ray's asynchronous upload (Ray 2.60): "
                "checkpoints are synchronous")  # fmt: skip
        self.snapshots = Snapshots()
        self.idle = threading.Event()
        self.idle.set()
        self.blocked_s: list[float] = []
        """Seconds each checkpoint held rank 0's training thread (the gather, the snapshot
        or the write and upload, any wait, the report's barrier); in either mode."""

    def summary(self) -> dict[str, Any]:
        """For the run's summary: the mode, what each checkpoint blocked for, and the
        snapshot's host memory (0 when synchronous)."""
        return {
            "mode": "async" if self.asynchronous else "sync",
            "blocked_s": [round(s, 4) for s in self.blocked_s],
            "snapshot_bytes": self.snapshots.nbytes,
        }

    def write(
        self, metrics: dict[str, Any], saved: dict[str, Any], harness: Harness, run_dir: str
    ) -> None:
        """Report ``metrics`` with the checkpoint of ``saved`` (``state_of``'s live state):
        wait for the previous upload, snapshot, and hand the rest to Ray's upload thread."""
        started = time.perf_counter()
        if not self.idle.is_set():
            self.idle.wait()
            self.log(f"checkpoint: waited {time.perf_counter() - started:.1f} s for the "
                     "previous one to reach storage")  # fmt: skip
        first = not self.snapshots.buffers
        copy = self.snapshots.take(saved)
        if first:
            size = self.snapshots.nbytes / 2**20
            self.log(f"checkpoints are asynchronous: each takes a {size:.0f} MB snapshot in "
                     "host memory; training goes on while it is written and uploaded")  # fmt: skip
        self.idle.clear()

        step = saved["progress"]["step"]

        def write(directory: str) -> None:
            rig.hold_upload(harness, run_dir, step)
            rig.slow_checkpoint(harness)
            write_state(directory, copy)

        try:
            report_async(metrics, write, self.idle.set, self.log)
        except BaseException:
            self.idle.set()
            raise


UNSCORED = -sys.float_info.max
"""The score of a mid-epoch checkpoint where higher is better (negated where lower is)."""


def write_mid_epoch_checkpoint(
    cfg: TrainConfig,
    worker: Worker,
    state: TrainState,
    meta: dict[str, Any],
    position: EpochPosition,
    sums: EpochSums,
    score: tuple[str, str],
    harness: Harness,
    writer: CheckpointWriter | None = None,
) -> None:
    """A checkpoint inside the epoch (``--checkpoint-every``): no validation. ``score`` is
    the (metric, mode) that ranks checkpoints."""
    progress = state.progress
    progress.sample = position.sample
    metrics = {
        "epoch": progress.epoch,
        "step": progress.step,
        "sample": position.sample,
        "mid_epoch": True,
        # Not validated. Scored worse than any epoch checkpoint (so Ray keeps it only while
        # it is the latest); not NaN, which Ray's saved state turns to null.
        score[0]: UNSCORED if score[1] == "max" else -UNSCORED,
        "lr": state.lr,
    }
    checkpoint_and_report(cfg, worker, state, meta, metrics, sums, harness, writer=writer)
    progress.sample = 0
    worker.log(
        f"checkpoint: step {progress.step} (epoch {position.epoch + 1}, sample {position.sample})"
    )


def checkpoint_and_report(
    cfg: TrainConfig,
    worker: Worker,
    state: TrainState,
    meta: dict[str, Any],
    metrics: dict[str, Any],
    sums: EpochSums,
    harness: Harness,
    samples_per_s: float = 0.0,
    timing: dict[str, Any] | None = None,
    writer: CheckpointWriter | None = None,
    before_report: Any = None,
) -> list[dict[str, Any]]:
    """Every rank reports (a barrier); rank 0 attaches a checkpoint of every rank's state
    at this optimizer-step boundary, synchronously or through ``writer`` (a sharded
    model's: every rank attaches its shard, and rank 0 the rest, synchronously). Returns every
    rank's speed, memory and ``timing`` (its epoch's data wait and ready time,
    ``EpochTiming.summary``). ``before_report(metrics)``: rank 0's, with the metrics
    complete, before Ray has them (after the report, a Tune trial may be stopped)."""
    started = time.perf_counter()
    peak_mb, memory_kind = peak_memory(worker.device)
    stats = {
        "rank": worker.rank,
        "samples_per_s": samples_per_s,
        "peak_memory_mb": peak_mb,
        "memory_kind": memory_kind,
        **(timing or {}),
    }
    # One collective for all of it: every rank's partial sums (for the checkpoint) and its
    # speed and memory (for the balance table). No RNG states: the step's randomness is
    # seeded per micro-batch (ray_ddp.data.seeding), so a resume needs none.
    gathered = all_gather({"sums": sums, "stats": stats})
    per_rank = [g["stats"] for g in gathered]
    if not metrics.get("mid_epoch"):
        metrics.update(reporting.balance(per_rank), **reporting.rank_timing(per_rank))
    sharded = is_fsdp(state.model)  # --strategy fsdp2: every rank writes its shard
    if not worker.is_main and not sharded:
        ray.train.report(metrics)
        return per_rank
    saved = None
    if worker.is_main:
        if before_report is not None:
            before_report(metrics)
        partial = [g["sums"] for g in gathered]
        saved = state_of(state, config=cfg.to_dict(), task_meta=meta,
                         world_size=worker.world_size, epoch_partial=partial)  # fmt: skip
    if writer is not None and writer.asynchronous:  # never sharded (WorkerRun)
        writer.write(metrics, saved, harness, cfg.run_dir)
    else:
        directory = tempfile.mkdtemp(prefix="ray_ddp_ckpt_")
        try:
            if sharded:
                _write_shards(directory, state)
            if saved is not None:
                rig.slow_checkpoint(harness)
                write_state(directory, saved)
            # SYNC upload: the checkpoint is in storage when report returns. Sharded: Ray
            # copies every rank's files into the one checkpoint and registers it only once
            # every rank's report is in (never a checkpoint with a shard missing).
            if sharded:
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))
            else:
                report_sync(metrics, directory, worker.log)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    if writer is not None:
        writer.blocked_s.append(time.perf_counter() - started)
    return per_rank


def _write_shards(directory: str, state: TrainState) -> None:
    """``--strategy fsdp2``: this rank's shard of the model and the optimizer (DCP, a
    collective) into ``directory``; rank 0's ``state.pt`` (``checkpoint.format``) holds
    everything else. Written synchronously, whatever ``--checkpoint-mode`` says."""
    # BatchNorm statistics are not sharded, and DCP saves one rank's copy of them, not
    # necessarily rank 0's: every rank takes rank 0's first (what DDP saves, and what
    # every rank evaluates with).
    broadcast_buffers(state.model)
    save_shards(directory, state.model, state.optimizer)
