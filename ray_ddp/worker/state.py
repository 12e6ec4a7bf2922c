"""What training carries from step to step, and what a checkpoint saves of it (no Ray)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ray_ddp.worker.position import Position


@dataclass
class TrainProgress(Position):
    """Where training stands; what a resumed run continues from: the run's
    :class:`~ray_ddp.worker.position.Position` (epochs done, optimizer steps taken, samples
    of the epoch's order trained: 0 at an epoch boundary, more inside an epoch, as at a
    ``--checkpoint-every`` checkpoint or a ``--max-steps`` stop; a resumed run, at any world
    size, starts the epoch there), advanced by the pass alone (``worker.step``), and what
    else a checkpoint carries of the run."""

    best_score: float | None = None
    """The best ``val_<best_metric>`` so far (None before the first validation)."""
    order: dict | None = None
    """What decides the epoch order ``sample`` counts in (``data.order.continuation``):
    a resume inside an epoch continues only on the same order."""
    bad_samples: int = 0
    """Unreadable training samples of the epoch before ``sample`` (all ranks): a resumed
    epoch's count, and its ``--max-bad-samples`` cap, go on from there."""
    bad_sample_rows: int | None = None
    """Rows of the run's ``bad_samples.csv`` when this was saved (rank 0's): a resume drops
    the rows written after it, whose samples are read again. None: not known."""
    tracking_run: str | None = None
    """The experiment tracker's run this run logs to (``--tracking``; also kept in
    ``<run>/tracking.json``): a resume from this run's own checkpoint continues it."""
    tracked_since: int = 0
    """When this run's training last went back over steps the tracker has (ms since 1970,
    rank 0's clock): a restarted epoch (``--restart-epoch``, a Ray Data stream) trains
    them again, on another order. The tracker's points from before it belong to the steps
    trained then, not to this line of training: they do not stop the steps trained again
    from being logged (``tracking.mlflow_sink``)."""

    @classmethod
    def from_saved(cls, saved: dict) -> TrainProgress:
        """From a checkpoint's ``progress`` (fields of other versions dropped)."""
        return cls(**{k: v for k, v in saved.items() if k in cls.__dataclass_fields__})


@dataclass
class EpochSums:
    """One rank's running sums over the current epoch (a mid-epoch checkpoint keeps every
    rank's, so the resumed epoch reports the same training loss at any world size)."""

    loss_sum: float = 0.0
    """Sum of per-sample training losses (of a ``Sum`` loss's totals)."""
    samples: int = 0
    ledger: list[tuple[int, int]] | None = None
    """``(optimizer step, sample index)`` of every sample trained, where a
    test's harness asks for the sample ledger (``ray_ddp.testing``); None otherwise."""
    count: float = 0.0
    """What ``loss_sum`` is over: the samples, or a ``Sum`` loss's counts (tokens, say)."""


@dataclass
class TrainState:
    """The objects an optimizer step changes: everything a checkpoint must hold."""

    model: torch.nn.Module
    """As trained: wrapped in DDP when there is more than one worker."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    """Warm-up then cosine (``build_scheduler``): a resume sets its step (``set_schedule_step``)."""
    scaler: torch.amp.GradScaler
    progress: TrainProgress = field(default_factory=TrainProgress)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]
