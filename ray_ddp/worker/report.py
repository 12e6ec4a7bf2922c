"""What every worker reports to Ray Train: its metrics (a barrier: every rank reports
the same number of times) and, from rank 0 only, a checkpoint of every rank's state at an
optimizer-step boundary, written to a temporary directory and uploaded by Ray (SYNC)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from typing import Any

import ray.train

from ray_ddp.checkpoint.format import save_state
from ray_ddp.config import TrainConfig
from ray_ddp.io import reporting
from ray_ddp.testing import harness as rig
from ray_ddp.testing.harness import Harness
from ray_ddp.worker.collectives import all_gather
from ray_ddp.worker.identity import Worker, peak_memory
from ray_ddp.worker.state import EpochSums, TrainState
from ray_ddp.worker.step import EpochPosition

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
    checkpoint_and_report(cfg, worker, state, meta, metrics, sums, harness)
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
) -> list[dict[str, Any]]:
    """Every rank reports (a barrier); rank 0 attaches a checkpoint of every rank's state
    at this optimizer-step boundary. Returns every rank's speed, memory and ``timing``
    (its epoch's data wait and ready time, ``EpochTiming.summary``)."""
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
    if not worker.is_main:
        ray.train.report(metrics)
        return per_rank
    directory = tempfile.mkdtemp(prefix="ray_ddp_ckpt_")
    rig.slow_checkpoint(harness)
    try:
        save_state(
            directory,
            state,
            config=cfg.to_dict(),
            task_meta=meta,
            world_size=worker.world_size,
            epoch_partial=[g["sums"] for g in gathered],
        )
        # SYNC upload (the default): the checkpoint is in storage when report returns.
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return per_rank
