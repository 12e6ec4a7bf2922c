"""One training epoch on one worker: the inner loop of ``loop.train_loop_per_worker``.

Gradient accumulation with DDP's ``no_sync()`` off the boundary micro-steps, autocast and
the GradScaler, gradient clipping on unscaled gradients, the non-finite loss guard,
mid-epoch checkpoints and progress lines. No Ray here (the GPU path check runs it on
machines without Ray); the process group, if any, is torch.distributed's.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ray_ddp import reporting
from ray_ddp.checkpoint import TrainProgress
from ray_ddp.config import TrainConfig
from ray_ddp.numerics import LossGuard
from ray_ddp.optim import optimizer_step
from ray_ddp.precision import autocast
from ray_ddp.step_timing import StepTimer

if TYPE_CHECKING:
    from ray_ddp.run_logs import RunLogs  # tensorboardX: not where the GPU check runs


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


class EpochResult(NamedTuple):
    loss_sum: float
    """Sum of per-sample losses over the whole epoch on this rank (the part before a
    resume included)."""
    seen: int
    """Samples of the whole epoch on this rank."""
    seen_now: int
    """Samples trained in this call (for speed)."""
    skipped: int
    """fp16 steps the GradScaler skipped (overflowed gradients)."""


def train_epoch(
    cfg: TrainConfig,
    model: torch.nn.Module,
    loader: Iterable,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    device: torch.device,
    progress: TrainProgress,
    epoch: int,
    span: tuple[int, int],
    partial: tuple[float, int],
    *,
    timer: StepTimer,
    guard: LossGuard,
    logs: RunLogs | None = None,
    checkpoint: Callable[[int, int, float, int], None] | None = None,
    report_progress: bool = False,
    channels_last: bool = False,
) -> EpochResult:
    """One pass over this rank's shard, from micro-batch ``span[0]`` of ``span[1]``.

    ``loader`` yields (inputs, targets) already on ``device``. ``partial`` is the (loss
    sum, samples) of the part before ``span[0]``, from a checkpoint. ``checkpoint(epoch,
    batch, loss_sum, seen)`` is called every ``cfg.checkpoint_every`` optimizer steps
    inside the epoch (by every rank: it is a collective)."""
    model.train()
    first, batches = span
    # Summed on the device: calling .item() every step would wait for the GPU each time.
    loss_sum = torch.tensor(partial[0], dtype=torch.float64, device=device)
    seen = partial[1]
    seen_now = skipped = window_samples = 0
    started = last_report = time.perf_counter()
    no_sync = getattr(model, "no_sync", None)  # absent with one worker (no DDP wrapper)
    optimizer.zero_grad(set_to_none=True)
    timer.restart()
    for index, (inputs, targets) in enumerate(loader, start=first):
        # Micro-steps are grouped in windows of accum_steps; the last window of an epoch
        # may be shorter, and the loss is divided by the window's real length so every
        # optimizer step averages its micro-batches exactly. Checkpoints fall on window
        # ends, so a resumed epoch starts on a window's first micro-batch.
        window_start = index - index % cfg.accum_steps
        window = min(cfg.accum_steps, batches - window_start)
        boundary = index - window_start == window - 1
        # Only the boundary micro-step all-reduces gradients; the others accumulate
        # locally under no_sync() (the guide's version all-reduced on every micro-step).
        sync_context = (
            no_sync() if (no_sync is not None and not boundary) else contextlib.nullcontext()
        )
        with sync_context:
            with autocast(cfg.amp, device):
                if channels_last:
                    inputs = inputs.contiguous(memory_format=torch.channels_last)
                logits = model(inputs)
                loss = F.cross_entropy(logits.float(), targets)
            loss = _inject_fault(cfg, loss, progress.step + 1, guard.rank)
            guard.observe(loss, progress.step + 1, f"epoch {epoch + 1}, micro-batch {index + 1}")
            scaler.scale(loss / window).backward()
        loss_sum += loss.detach().double() * targets.numel()
        seen += targets.numel()
        seen_now += targets.numel()
        window_samples += targets.numel()
        if boundary:
            if cfg.grad_clip > 0:
                scaler.unscale_(optimizer)  # clip the true gradients, not scaled ones
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if not optimizer_step(optimizer, scaler, scheduler):
                skipped += 1  # fp16 overflow: no update, and the schedule stays put
            optimizer.zero_grad(set_to_none=True)
            progress.step += 1
            timer.step(window_samples)
            window_samples = 0
            guard.maybe_check(progress.step)
            if logs is not None and progress.step % cfg.log_every_steps == 0:
                logs.step(progress.step, loss.item(), optimizer.param_groups[0]["lr"])
            if (
                checkpoint is not None
                and cfg.checkpoint_every
                and progress.step % cfg.checkpoint_every == 0
                and index + 1 < batches  # the epoch's end has its own checkpoint
                and not (cfg.max_steps and progress.step >= cfg.max_steps)
            ):
                checkpoint(epoch, index + 1, loss_sum.item(), seen)
                timer.restart()
        if report_progress and time.perf_counter() - last_report >= cfg.progress_interval_s:
            last_report = time.perf_counter()
            elapsed = last_report - started
            done = index + 1 - first
            sys.stdout.write(
                reporting.progress_line(
                    epoch + 1,
                    cfg.epochs,
                    index + 1,
                    batches,
                    loss_sum.item() / seen,
                    seen_now * world_size() / elapsed,
                    elapsed * (batches - index - 1) / done,
                )
                + "\n"
            )
            sys.stdout.flush()
        if boundary and cfg.max_steps and progress.step >= cfg.max_steps:
            break
    guard.check()
    return EpochResult(loss_sum.item(), seen, seen_now, skipped)


def _inject_fault(cfg: TrainConfig, loss: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    """Testing aid: ``extra["inject_nan"] = {"step": S, "rank": R}`` turns rank R's loss
    at optimizer step S into NaN, the way a diverging model would."""
    fault = cfg.extra.get("inject_nan")
    if not fault or fault["step"] != step:
        return loss
    if fault["rank"] != rank:
        return loss
    return loss * float("nan")
