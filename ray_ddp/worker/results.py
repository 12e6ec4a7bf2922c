"""What an epoch reports (its metrics, the epoch line and the per-rank table, the run
logs' row, a test's ledger) and what a worker's run returns to the driver."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ray_ddp.config.sections import Optimisation
from ray_ddp.io import reporting
from ray_ddp.io.storage import join, write_bytes
from ray_ddp.task import Task
from ray_ddp.worker.collectives import all_gather
from ray_ddp.worker.evaluate import EvalResult
from ray_ddp.worker.flops import FlopRate
from ray_ddp.worker.identity import Worker
from ray_ddp.worker.state import EpochSums, TrainProgress, TrainState
from ray_ddp.worker.timing import StepTimer

if TYPE_CHECKING:
    from ray_ddp.io.run_logs import RunLogs  # tensorboardX: imported on rank 0 only


@dataclass(frozen=True)
class EpochTrained:
    """One epoch's training, summed over all ranks where it says so."""

    loss_sum: float
    """All ranks: sum of per-sample losses over the whole epoch."""
    samples: int
    """All ranks: samples of the whole epoch (a resumed epoch's first part included)."""
    count: float
    """All ranks: what ``loss_sum`` is over (the samples, or a ``Sum`` loss's counts)."""
    all_trained: int
    """All ranks: samples trained by this attempt (for speed)."""
    own_trained: int
    """This rank's samples trained by this attempt."""
    skipped: int
    """This rank's skipped fp16 steps."""
    seconds: float
    own: EpochSums
    """This rank's sums over the epoch so far (what a checkpoint of a partial epoch keeps)."""
    ledger: list[tuple[int, int]] | None
    """This rank's ``(step, index)`` of the whole epoch (a test's sample ledger,
    ``ray_ddp.testing.Harness.sample_ledger``), or None."""


@dataclass
class RunSoFar:
    """What this attempt has done, for the summary the driver prints."""

    history: list[dict[str, Any]] = field(default_factory=list)
    per_rank: list[dict[str, Any]] = field(default_factory=list)
    """Every rank's speed and memory in the latest epoch."""
    train_seconds: float = 0.0
    samples: int = 0
    flops: FlopRate = field(default_factory=FlopRate)

    def add(self, metrics: dict[str, Any], trained: EpochTrained, per_rank: list[dict]) -> None:
        self.history.append(metrics)
        self.per_rank = per_rank
        self.train_seconds += trained.seconds
        self.samples += trained.all_trained

    def summary(
        self, worker: Worker, progress: TrainProgress, ranks: list[dict], timer: StepTimer
    ) -> dict[str, Any]:
        """What ``train_loop_per_worker`` returns (Ray hands rank 0's to the driver)."""
        return {
            "history": self.history,
            "train_seconds": self.train_seconds,
            "samples_seen": self.samples,
            "epochs_completed": progress.epoch,
            "steps": progress.step,
            "world_size": worker.world_size,
            "device": worker.device.type,
            "ranks": ranks,
            "per_rank": self.per_rank,
            "timing": timer.summary(),
            "flops_per_sample": self.flops.per_sample,
            "utilisation": self.flops.of(self.samples / max(self.train_seconds, 1e-9)),
        }


def better(task: Task, best: float | None, metrics: dict[str, Any]) -> float:
    """The best validation score so far, after this epoch's (by the task's mode)."""
    score = metrics[f"val_{task.best_metric}"]
    if best is None:
        return score
    return max(best, score) if task.best_mode == "max" else min(best, score)


def fresh_sums(ledger: bool) -> EpochSums:
    """Zero sums for a new epoch (with an empty ledger for the harness's sample ledger)."""
    return EpochSums(ledger=[] if ledger else None)


def write_ledger(
    run_dir: str, worker: Worker, epoch: int, ledger: list[tuple[int, int]] | None
) -> None:
    """The sample ledger (a test's, ``ray_ddp.testing``): every rank's ``(step, index)`` of
    the finished epoch, gathered to rank 0 and written to ``<run>/ledger/epoch-<N>.csv`` (a
    redone epoch's end overwrites it)."""
    rows = [row for part in all_gather(ledger or []) for row in part]
    if not worker.is_main:
        return
    lines = ["step,index", *(f"{step},{index}" for step, index in sorted(rows))]
    path = join(run_dir, "ledger", f"epoch-{epoch + 1}.csv")  # a local path or a URI
    write_bytes(path, ("\n".join(lines) + "\n").encode())


def epoch_metrics(
    task: Task, state: TrainState, trained: EpochTrained, evaluated: EvalResult, epoch: int
) -> dict[str, Any]:
    """What an epoch reports to Ray, prints and logs: the task's validation metrics (exact
    means of their sums, and what ``summarize`` derives) as ``val_<name>``."""
    metrics: dict[str, Any] = {
        "epoch": epoch,
        "step": state.progress.step,
        "train_loss": trained.loss_sum / max(1.0, trained.count),
        **{f"val_{k}": v for k, v in task.summarize(evaluated.means).items()},
        "evaluated_samples": evaluated.samples,
        "lr": state.lr,
        "train_samples": trained.samples,
        "samples_per_s": trained.all_trained / trained.seconds,
        "epoch_s": trained.seconds,
    }
    if state.scaler.is_enabled():
        metrics["amp_skipped_steps"] = trained.skipped
    return metrics


def log_epoch(
    optim: Optimisation,
    worker: Worker,
    logs: RunLogs | None,
    metrics: dict[str, Any],
    per_rank: list[dict[str, Any]],
    progress: TrainProgress,
    train_size: int,
    ranks: list[dict[str, Any]],
) -> None:
    """The epoch line, stragglers and the per-worker table from rank 0; the run logs'
    epoch row (rank 0's ``logs``). (``ranks``: the rank table's rows, for the stragglers'
    hosts.)"""
    worker.log(reporting.epoch_line(metrics, optim.epochs))
    for line in reporting.straggler_lines(per_rank, ranks):
        worker.log(line)
    if progress.sample:  # stopped inside the epoch
        worker.log(
            f"stopped at --max-steps {optim.max_steps}, sample {progress.sample}/"
            f"{train_size} of epoch {progress.epoch + 1}: a re-run with more steps "
            "continues from there"
        )
    worker.log(reporting.worker_table(per_rank))
    if logs is not None:
        logs.epoch(metrics, per_rank)
