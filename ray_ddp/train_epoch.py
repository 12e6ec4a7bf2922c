"""One pass over a worker's shard: the inner loop of ``train_worker``.

Gradient accumulation with DDP's ``no_sync()`` off the boundary micro-steps, autocast and
the GradScaler, gradient clipping on unscaled gradients, the non-finite loss guard and
progress lines. It returns at the end of the epoch, or early at an optimizer-step boundary
where a mid-epoch checkpoint is due (the caller writes it and calls again from there).
No Ray here (the GPU path check runs it on machines without Ray); the process group, if
any, is torch.distributed's.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ray_ddp import reporting
from ray_ddp.collectives import world_size
from ray_ddp.config import TrainConfig
from ray_ddp.loss_guard import LossGuard
from ray_ddp.optim import optimizer_step
from ray_ddp.precision import autocast
from ray_ddp.step_timing import StepTimer
from ray_ddp.task import Task, map_tensors
from ray_ddp.train_state import EpochSums, TrainState

if TYPE_CHECKING:
    from ray_ddp.run_logs import RunLogs  # tensorboardX: not where the GPU check runs


@dataclass(frozen=True)
class EpochPosition:
    """Micro-batch ``batch`` (0-based) of ``batches`` in epoch ``epoch`` (0-based)."""

    epoch: int
    batch: int
    batches: int
    samples: int | None = None
    """This rank's samples in the whole epoch, when the last micro-batch may be short
    (None: every micro-batch is full)."""


@dataclass
class EpochTools:
    """What the epoch loop uses besides the training state; the same for every epoch."""

    task: Task
    device: torch.device
    timer: StepTimer
    guard: LossGuard
    logs: RunLogs | None = None
    """Rank 0's TensorBoard writer (None elsewhere)."""
    show_progress: bool = False
    """Print in-epoch progress lines (rank 0, when ``progress_interval_s`` > 0)."""
    channels_last: bool = False


@dataclass(frozen=True)
class EpochSegment:
    """What one call trained: up to the epoch's end, or to a due checkpoint."""

    end: EpochPosition
    """Where it stopped (``end.batch == end.batches`` at the epoch's end; earlier at a due
    checkpoint or at ``--max-steps``)."""
    sums: EpochSums
    """This rank's sums over the whole epoch so far (earlier segments included)."""
    samples: int
    """Samples trained in this call (for speed)."""
    skipped: int
    """fp16 steps the GradScaler skipped (overflowed gradients)."""
    checkpoint_due: bool
    """Stopped early because ``--checkpoint-every`` steps were reached."""


def train_epoch(
    cfg: TrainConfig,
    state: TrainState,
    loader: Iterable,
    start: EpochPosition,
    sums: EpochSums,
    tools: EpochTools,
) -> EpochSegment:
    """Train from ``start`` (whose sampler position the caller set) with ``sums`` of the
    part before it. ``loader`` yields the task's batches, already on the device."""
    model, optimizer, progress = state.model, state.optimizer, state.progress
    task, device, guard = tools.task, tools.device, tools.guard
    model.train()
    batches = start.batches
    # Summed on the device: calling .item() every step would wait for the GPU each time.
    loss_sum = torch.tensor(sums.loss_sum, dtype=torch.float64, device=device)
    seen = sums.samples
    trained = skipped = window_samples = 0
    end, checkpoint_due = replace(start, batch=batches), False
    started = last_report = time.perf_counter()
    no_sync = getattr(model, "no_sync", None)  # absent with one worker (no DDP wrapper)
    optimizer.zero_grad(set_to_none=True)
    tools.timer.restart()
    for index, batch in enumerate(loader, start=start.batch):
        size = task.batch_size(batch)
        # Micro-steps are grouped in windows of accum_steps; the last window of an epoch
        # may be shorter, and the loss is divided by the window's real length so every
        # optimizer step averages its samples exactly. Checkpoints fall on window ends, so
        # a resumed epoch starts on a window's first micro-batch.
        window_start = index - index % cfg.accum_steps
        window = min(cfg.accum_steps, batches - window_start)
        boundary = index - window_start == window - 1
        # The step averages over the window's samples: a short last micro-batch of the
        # epoch weighs by its size (full windows keep the plain division by their length).
        full = cfg.batch_size * window
        planned = (
            full
            if start.samples is None
            else min(full, start.samples - window_start * cfg.batch_size)
        )
        # Only the boundary micro-step all-reduces gradients; the others accumulate
        # locally under no_sync() (the guide's version all-reduced on every micro-step).
        sync_context = (
            no_sync() if (no_sync is not None and not boundary) else contextlib.nullcontext()
        )
        with sync_context:
            if tools.channels_last:
                batch = map_tensors(batch, _channels_last)
            with autocast(cfg.amp, device):
                loss = task.loss(model, batch).float()
            loss = _inject_fault(cfg, loss, progress.step + 1, guard.rank)
            guard.observe(
                loss, progress.step + 1, f"epoch {start.epoch + 1}, micro-batch {index + 1}"
            )
            weighted = loss / window if planned == full else loss * (size / planned)
            state.scaler.scale(weighted).backward()
        loss_sum += loss.detach().double() * size
        seen += size
        trained += size
        window_samples += size
        if boundary:
            if cfg.grad_clip > 0:
                state.scaler.unscale_(optimizer)  # clip the true gradients, not scaled ones
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if not optimizer_step(optimizer, state.scaler, state.scheduler):
                skipped += 1  # fp16 overflow: no update, and the schedule stays put
            optimizer.zero_grad(set_to_none=True)
            progress.step += 1
            tools.timer.step(window_samples)
            window_samples = 0
            guard.maybe_check(progress.step)
            if tools.logs is not None and progress.step % cfg.log_every_steps == 0:
                tools.logs.step(progress.step, loss.item(), state.lr)
        if tools.show_progress and time.perf_counter() - last_report >= cfg.progress_interval_s:
            last_report = time.perf_counter()
            _print_progress(
                cfg, start, index, loss_sum.item() / seen, trained, last_report - started
            )
        if boundary and max_steps_reached(cfg, progress.step):
            end = replace(start, batch=index + 1)  # where a re-run with more steps resumes
            break
        if boundary and _checkpoint_due(cfg, progress.step) and index + 1 < batches:
            # The epoch's end has its own checkpoint; this one is inside the epoch.
            end, checkpoint_due = replace(start, batch=index + 1), True
            break
    guard.check()
    return EpochSegment(end, EpochSums(loss_sum.item(), seen), trained, skipped, checkpoint_due)


def _channels_last(tensor: torch.Tensor) -> torch.Tensor:
    """An image tensor (4-d floating point) in NHWC memory, like the weights; others as
    they are."""
    if tensor.dim() == 4 and tensor.is_floating_point():
        return tensor.contiguous(memory_format=torch.channels_last)
    return tensor


def max_steps_reached(cfg: TrainConfig, step: int) -> bool:
    """``--max-steps`` optimizer steps have been taken (the run stops there)."""
    return bool(cfg.max_steps) and step >= cfg.max_steps  # type: ignore[operator]


def _checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    return bool(cfg.checkpoint_every) and step % cfg.checkpoint_every == 0  # type: ignore[operator]


def _print_progress(
    cfg: TrainConfig, start: EpochPosition, index: int, loss: float, trained: int, elapsed: float
) -> None:
    done = index + 1 - start.batch
    sys.stdout.write(
        reporting.progress_line(
            start.epoch + 1,
            cfg.epochs,
            index + 1,
            start.batches,
            loss,
            trained * world_size() / elapsed,
            elapsed * (start.batches - index - 1) / done,
        )
        + "\n"
    )
    sys.stdout.flush()


def _inject_fault(cfg: TrainConfig, loss: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    """Testing aid (``TrainConfig.inject_nan_step``/``inject_nan_rank``): turn one rank's
    loss at one optimizer step into NaN, the way a diverging model would."""
    if cfg.inject_nan_step != step or cfg.inject_nan_rank != rank:
        return loss
    return loss * float("nan")
