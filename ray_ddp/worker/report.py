"""What the built-in loop reports to Ray Train at a checkpoint (:class:`Reports`): its
metrics (a barrier: every rank reports the same number of times), the balance table
gathered from every rank, and rank 0's state of the whole ``TrainState`` at an
optimizer-step boundary, handed to the run's one
:class:`~ray_ddp.worker.checkpointer.Checkpointer` (sync, async or sharded)."""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass
from typing import Any

import ray.train

from ray_ddp.checkpoint.format import is_fsdp, state_of
from ray_ddp.io import reporting
from ray_ddp.worker.checkpointer import Checkpointer
from ray_ddp.worker.collectives import all_gather, broadcast_buffers
from ray_ddp.worker.identity import Worker, peak_memory
from ray_ddp.worker.sharding import save_shards
from ray_ddp.worker.state import EpochSums, TrainState

UNSCORED = -sys.float_info.max
"""The score of a mid-epoch checkpoint where higher is better (negated where lower is)."""


@dataclass(frozen=True)
class Reports:
    """What the built-in loop's reports and checkpoints are made of, fixed for the run:
    its config (the flat dict a resume and ``load_model`` read), the worker, the training
    state (its ``progress``: the position a checkpoint is taken at), the task's meta,
    what ranks checkpoints (``val_<metric>`` and its mode) and the one checkpointer."""

    config: dict[str, Any]
    worker: Worker
    state: TrainState
    meta: dict[str, Any]
    score: tuple[str, str]
    checkpointer: Checkpointer

    def inside_epoch(self, sums: EpochSums) -> None:
        """A checkpoint inside the epoch (``--checkpoint-every``, a reclaim notice), at
        the position the pass stopped at: no validation, so unscored."""
        progress = self.state.progress
        metrics = {
            "epoch": progress.epoch,
            "step": progress.step,
            "sample": progress.sample,
            "mid_epoch": True,
            **unscored(*self.score),
            "lr": self.state.lr,
        }
        self.checkpoint_and_report(metrics, sums)
        self.worker.log(
            f"checkpoint: step {progress.step} (epoch {progress.epoch + 1}, sample "
            f"{progress.sample})"
        )

    def checkpoint_and_report(
        self, metrics: dict[str, Any], sums: EpochSums, samples_per_s: float = 0.0,
        timing: dict[str, Any] | None = None, before_report: Any = None,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """Every rank reports (a barrier); rank 0 attaches a checkpoint of every rank's
        state at this optimizer-step boundary through the checkpointer (a sharded model's:
        every rank attaches its shard, and rank 0 the rest). Returns every rank's speed,
        memory and ``timing`` (its epoch's data wait and ready time,
        ``EpochTiming.summary``). ``before_report(metrics)``: rank 0's, with the metrics
        complete, before Ray has them (after the report, a Tune trial may be stopped)."""
        started, worker, state = time.perf_counter(), self.worker, self.state
        peak_mb, memory_kind = peak_memory(worker.device)
        stats = {
            "rank": worker.rank,
            "samples_per_s": samples_per_s,
            "peak_memory_mb": peak_mb,
            "memory_kind": memory_kind,
            **(timing or {}),
        }
        # One collective for all of it: every rank's partial sums (for the checkpoint) and
        # its speed and memory (for the balance table). No RNG states: the step's randomness
        # is seeded per micro-batch (ray_ddp.data.seeding), so a resume needs none.
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
            saved = state_of(state, config=self.config, task_meta=self.meta,
                             world_size=worker.world_size, epoch_partial=partial)  # fmt: skip
        shards = functools.partial(_write_shards, state=state) if sharded else None
        self.checkpointer.save(metrics, saved, shards, started)
        return per_rank


def unscored(metric: str, mode: str) -> dict[str, float]:
    """The score of a checkpoint that was not validated: worse than any validated one (so
    Ray keeps it only while it is the latest); not NaN, which Ray's saved state turns to
    null."""
    return {metric: UNSCORED if mode == "max" else -UNSCORED}


def _write_shards(directory: str, state: TrainState) -> None:
    """``--strategy fsdp2``: this rank's shard of the model and the optimizer (DCP, a
    collective) into ``directory``; rank 0's ``state.pt`` (``checkpoint.format``) holds
    everything else. Written synchronously, whatever ``--checkpoint-mode`` says."""
    # BatchNorm statistics are not sharded, and DCP saves one rank's copy of them, not
    # necessarily rank 0's: every rank takes rank 0's first (what DDP saves, and what
    # every rank evaluates with).
    broadcast_buffers(state.model)
    save_shards(directory, state.model, state.optimizer)
