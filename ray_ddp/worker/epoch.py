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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ray_ddp.config import TrainConfig
from ray_ddp.data.order.global_order import EpochPlan, GlobalOrderBatches
from ray_ddp.data.seeding import seed_micro_batch
from ray_ddp.data.unreadable import BadSamplesError, SkipLog, take_skipped
from ray_ddp.io import reporting
from ray_ddp.reliability.hangs import watchdog as watch
from ray_ddp.reliability.loss_guard import LossGuard
from ray_ddp.task import Task, map_tensors
from ray_ddp.testing import harness as rig
from ray_ddp.testing.harness import Harness
from ray_ddp.worker.collectives import world_size
from ray_ddp.worker.optim import optimizer_step
from ray_ddp.worker.precision import autocast
from ray_ddp.worker.state import EpochSums, TrainState
from ray_ddp.worker.timing import EpochTiming, StepTimer

if TYPE_CHECKING:
    from ray_ddp.io.run_logs import RunLogs  # tensorboardX: not where the GPU check runs


# What the hang watchdog reports a rank doing (ray_ddp.reliability.hangs.watchdog).
WAITING_FOR_DATA = "training: waiting for data from the loader"
COMPUTING = "training: forward and backward"
GRADIENT_SYNC = "training: backward with DDP's gradient all-reduce"
OPTIMIZER_STEP = "training: after backward, before the optimizer step is done"


@dataclass(frozen=True)
class EpochPosition:
    """Sample ``sample`` of epoch ``epoch``'s global order (both 0-based): how far into
    the epoch training is, the same at every world size (``ray_ddp.data.order.global_order``)."""

    epoch: int
    sample: int


@dataclass
class EpochTools:
    """What the epoch loop uses besides the training state; the same for every epoch."""

    task: Task
    device: torch.device
    timer: StepTimer
    guard: LossGuard
    timing: EpochTiming = field(default_factory=EpochTiming)
    """This rank's data wait and ready times over the current epoch (the caller starts a
    new one every epoch)."""
    logs: RunLogs | None = None
    """Rank 0's TensorBoard writer (None elsewhere)."""
    show_progress: bool = False
    """Print in-epoch progress lines (rank 0, when ``progress_interval_s`` > 0)."""
    channels_last: bool = False
    skips: SkipLog = field(default_factory=SkipLog)
    """This rank's unreadable training samples of the current epoch (the caller starts a
    new one every epoch, with the run's cap)."""
    harness: Harness = rig.NONE
    """A test's faults (``ray_ddp.testing``); none outside ray_ddp's tests."""
    run_dir: str = ""
    """Where a stalled rank writes its marker (a test's stalls only)."""


@dataclass(frozen=True)
class EpochSegment:
    """What one call trained: up to the epoch's end, or to a due checkpoint."""

    end: EpochPosition
    """Where it stopped (``end.sample`` is the epoch's size at its end; earlier at a due
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
    order: GlobalOrderBatches,
    sums: EpochSums,
    tools: EpochTools,
) -> EpochSegment:
    """Train the micro-batches ``order`` holds for this rank (the caller set its position;
    ``loader`` draws from it and yields the task's batches, already on the device), with
    ``sums`` of the epoch's part before that position."""
    model, optimizer, progress = state.model, state.optimizer, state.progress
    task, device, guard = tools.task, tools.device, tools.guard
    plan, slots = order.plan, order.slots
    model.train()
    # Summed on the device: calling .item() every step would wait for the GPU each time.
    loss_sum = torch.tensor(sums.loss_sum, dtype=torch.float64, device=device)
    seen = sums.samples
    ledger = sums.ledger
    trained = skipped = window_samples = 0
    end, checkpoint_due = EpochPosition(plan.epoch, plan.size), False
    started = last_report = time.perf_counter()
    no_sync = getattr(model, "no_sync", None)  # absent with one worker (no DDP wrapper)
    ranks = world_size()  # DDP averages the ranks' gradients: each weighs by its share
    optimizer.zero_grad(set_to_none=True)
    tools.timer.restart()
    timing = tools.timing
    opened = time.perf_counter()
    batches = iter(loader)  # a Ray Data stream starts here: its wait is the data's too
    timing.data_wait_s += time.perf_counter() - opened
    step_started = time.perf_counter()
    micro_in_step = 0
    last_good = None  # this rank's latest micro-batch with a readable sample
    for index, slot in enumerate(slots):
        # An attempt's first step is slow by nature (loader workers start, kernels are
        # chosen, a compile): the watchdog gives it the grace, as it does a pass's first batch.
        first_step = tools.timer.steps == 0
        watch.doing(WAITING_FOR_DATA, slow=first_step or index == 0)
        fetch_started = time.perf_counter()
        batch = next(batches, None)
        timing.data_wait_s += time.perf_counter() - fetch_started
        if batch is None:
            raise RuntimeError(f"the loader ran out after {index} of {len(slots)} micro-batches")
        # Unreadable samples were left out (ray_ddp.data.unreadable): the micro-batch keeps its
        # weight, its loss is the mean over the samples that were read, and only those
        # count. A filler's were counted by the rank that trained them.
        batch, bad = take_skipped(batch)
        if bad and not slot.filler:
            tools.skips.add(bad)  # raises once this rank alone is over the cap
        good = slot.size - (0 if slot.filler else len(bad))
        weight = slot.size * ranks / slot.step_samples
        if batch is None:  # nothing in it was readable: still one backward, weighing 0
            batch, weight = _stand_in(last_good, bad, guard.rank), 0.0
        else:
            last_good = batch
        watch.doing(COMPUTING, slow=first_step)
        micro_in_step += 1
        if slot.boundary:
            rig.slow_down(tools.harness, guard.rank)  # part of the rank's own work, like a slow GPU
        # Only the boundary micro-step all-reduces gradients; the others accumulate
        # locally under no_sync() (the guide's version all-reduced on every micro-step).
        sync_context = (
            no_sync() if (no_sync is not None and not slot.boundary) else contextlib.nullcontext()
        )
        with sync_context:
            if tools.channels_last:
                batch = map_tensors(batch, _channels_last)
            # Dropout and the like follow the micro-batch, whichever rank trains it.
            seed_micro_batch(cfg.seed, progress.step + 1, slot.micro, device)
            with autocast(cfg.amp, device):
                loss = task.loss(model, batch).float()
            loss = rig.poison_loss(tools.harness, loss, progress.step + 1, guard.rank)
            where = f"epoch {plan.epoch + 1}, step {plan.first_step + slot.step + 1} of the epoch"
            guard.observe(loss, progress.step + 1, where)
            if slot.boundary:
                timing.ready.append((micro_in_step, time.perf_counter() - step_started))
                if no_sync is not None:
                    watch.doing(GRADIENT_SYNC, collective=True, slow=first_step)
            # The step's gradient is the mean over all its samples, however the ranks and
            # micro-batches split them (a filler weighs 0): each micro-batch's mean loss
            # weighs by its share of the step's samples, times the ranks DDP divides by.
            state.scaler.scale(loss * weight).backward()
        if not slot.filler:
            loss_sum += loss.detach().double() * good
            seen += good
            trained += good
            window_samples += good
            if ledger is not None:
                unread = {b.index for b in bad}
                ledger.extend((progress.step + 1, i) for i in slot.indices if i not in unread)
        if slot.boundary:
            watch.doing(OPTIMIZER_STEP, slow=first_step)
            rig.stall(tools.harness, tools.run_dir, guard.rank, progress.step + 1)
            if first_step:
                rig.slow_start(tools.harness)
            if cfg.grad_clip > 0:
                state.scaler.unscale_(optimizer)  # clip the true gradients, not scaled ones
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if not optimizer_step(optimizer, state.scaler, state.scheduler):
                skipped += 1  # fp16 overflow: no update, and the schedule stays put
            optimizer.zero_grad(set_to_none=True)
            progress.step += 1
            watch.progress("optimizer step", progress.step)
            tools.timer.step(window_samples)
            window_samples = micro_in_step = 0
            step_started = time.perf_counter()
            guard.maybe_check(progress.step)
            if tools.logs is not None and progress.step % cfg.log_every_steps == 0:
                tools.logs.step(progress.step, loss.item(), state.lr)
        if tools.show_progress and time.perf_counter() - last_report >= cfg.progress_interval_s:
            last_report = time.perf_counter()
            _print_progress(
                cfg, plan, index, len(slots), loss_sum.item() / max(1, seen), trained,
                last_report - started,
            )  # fmt: skip
        if not slot.boundary:
            continue
        if max_steps_reached(cfg, progress.step):
            # Where a re-run with more steps resumes.
            end = EpochPosition(plan.epoch, plan.step_start(slot.step + 1))
            break
        if _checkpoint_due(cfg, progress.step) and slot.step + 1 < plan.steps:
            # The epoch's end has its own checkpoint; this one is inside the epoch.
            end = EpochPosition(plan.epoch, plan.step_start(slot.step + 1))
            checkpoint_due = True
            break
    guard.check()
    sums = EpochSums(loss_sum.item(), seen, ledger)
    return EpochSegment(end, sums, trained, skipped, checkpoint_due)


def _stand_in(last_good, bad: list, rank: int):
    """What a micro-batch of nothing but unreadable samples trains with weight 0, since
    every rank must take part in the step's backward (as the epoch's fillers do): this
    rank's previous micro-batch. Its first one of an attempt has none: the run stops."""
    if last_good is None:
        names = ", ".join(f"{b.name} ({b.error})" for b in bad[:3])
        raise BadSamplesError(
            f"every sample of rank {rank}'s first micro-batch was unreadable: {names}. Fix "
            "or remove them"
        )
    return last_good


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
    cfg: TrainConfig, plan: EpochPlan, index: int, slots: int, loss: float, trained: int,
    elapsed: float,
) -> None:  # fmt: skip
    """Progress through the epoch in samples of its order (the same at any world size)."""
    done = index + 1
    position = plan.start + trained * world_size()
    sys.stdout.write(
        reporting.progress_line(
            plan.epoch + 1,
            cfg.epochs,
            min(position, plan.size),
            plan.size,
            loss,
            trained * world_size() / elapsed,
            elapsed * (slots - done) / done,
        )
        + "\n"
    )
    sys.stdout.flush()
