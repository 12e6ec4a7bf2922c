"""The training step, and one pass of a worker over its micro-batches.

``StepCore`` is the machine-learning core, in one place: each micro-batch's forward under
autocast and its backward weighted by its share of the step's samples, under DDP's
``no_sync`` (FSDP2's ``set_requires_gradient_sync(False)``) but on the rank's last
micro-batch of the step; then clipping the true
(unscaled) gradients, the optimizer step through the GradScaler, and zeroing.

``train_segment`` feeds it the micro-batches the epoch's order gives this rank, from a
position to the epoch's end, or to a step boundary where a checkpoint is due or
``--max-steps`` is reached (the caller checkpoints and calls again). Everything else that
happens around a step (the hang watchdog, timing, the loss guard, the ledger, unreadable
samples, TensorBoard, progress lines, a test's faults) is a step-level hook it calls
(``ray_ddp.worker.hooks``, which an own loop's steps call too). No Ray here: the GPU
path check runs it on machines without Ray; the process group, if any, is
torch.distributed's.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from ray_ddp.checkpoint.format import is_fsdp
from ray_ddp.data.order.global_order import GlobalOrderBatches, Slot
from ray_ddp.data.seeding import seed_micro_batch
from ray_ddp.data.unreadable import BadSamplesError, take_skipped
from ray_ddp.task import Sum, Task, map_tensors
from ray_ddp.worker.collectives import world_size
from ray_ddp.worker.hooks import Pass, StepHook, observed_loss
from ray_ddp.worker.optim import Stepper
from ray_ddp.worker.position import Position
from ray_ddp.worker.precision import autocast
from ray_ddp.worker.sharding import no_gradient_sync
from ray_ddp.worker.state import EpochSums, TrainState


@dataclass
class StepCore:
    """What one optimizer step computes, on this rank."""

    state: TrainState
    task: Task
    amp: str
    """``off``, ``bf16`` or ``fp16`` (autocast; fp16's GradScaler is ``state.scaler``)."""
    device: torch.device
    seed: int
    grad_clip: float
    """Clip the global gradient norm to this; 0: no clipping."""
    channels_last: bool = False
    rank: int = 0
    """This rank (for messages)."""
    stand_in: Any = None
    """A readable batch of this attempt, trained with weight 0 where a micro-batch has
    nothing readable: the example the FLOPs were counted on, then the rank's latest
    readable micro-batch (kept across passes and epochs, so a checkpoint or an epoch's
    start does not forget it)."""

    def __post_init__(self) -> None:
        # DDP's no_sync(); none with one worker (no DDP)
        self.no_sync: Callable[[], AbstractContextManager[Any]] | None = getattr(
            self.state.model, "no_sync", None
        )
        if is_fsdp(self.state.model):  # FSDP2's own switch, the same idea
            self.no_sync = functools.partial(no_gradient_sync, self.state.model)
        self.stepper = Stepper(self.state.scaler, world_size(), self.device)

    def backward(self, batch, slot: Slot, share: float, step: int, hooks: StepHook):
        """Forward and backward of one micro-batch of optimizer step ``step`` (counted over
        the run), its loss weighted by ``share`` (see ``train_segment``); returns
        ``(loss, total, count)``: the loss as one number (the mean over its samples, or a
        ``Sum``'s total / count), and what it adds to the epoch's training loss."""
        # Only the boundary micro-step all-reduces gradients; the others accumulate locally
        # under no_sync() (the guide's version all-reduced on every micro-step).
        local = None if slot.boundary else self.no_sync
        with local() if local is not None else contextlib.nullcontext():
            if self.channels_last:
                batch = map_tensors(batch, _channels_last)
            # Dropout and the like follow the micro-batch, whichever rank trains it.
            seed_micro_batch(self.seed, step, slot.micro, self.device)
            with autocast(self.amp, self.device):
                loss = self.task.loss(self.state.model, batch)
            loss, total, count = observed_loss(loss, slot, step, hooks)
            if slot.boundary:
                hooks.syncing(slot, distributed=self.no_sync is not None)
            self.stepper.backward(loss if count is None else Sum(total, count), share)
        return loss, None if total is None else total.detach(), count

    def update(self) -> bool:
        """Clip, step and zero the gradients; whether the step was applied (an fp16 step
        whose gradients overflowed is skipped, and the schedule stays put)."""
        state = self.state
        return self.stepper.step((state.optimizer,), (state.scheduler,), self.grad_clip)


@dataclass(frozen=True)
class Limits:
    """Where a pass stops early, at an optimizer-step boundary."""

    max_steps: int | None = None
    """``--max-steps``: the run's last step."""
    checkpoint_every: int | None = None
    """``--checkpoint-every``: a checkpoint is due every this many steps (inside the epoch:
    its end has its own)."""
    notice: Callable[[int], bool] | None = None
    """Asked at every step boundary (every rank alike): a checkpoint is due here, out of
    turn (``worker.preemption``: a node is about to be reclaimed)."""

    def done(self, step: int) -> bool:
        return bool(self.max_steps) and step >= self.max_steps  # type: ignore[operator]

    def checkpoint_due(self, step: int) -> bool:
        noticed = self.notice is not None and self.notice(step)  # asked at every boundary
        periodic = bool(self.checkpoint_every) and step % self.checkpoint_every == 0  # type: ignore[operator]
        return noticed or periodic


@dataclass(frozen=True)
class EpochSegment:
    """What one pass trained: up to the epoch's end, or to a due checkpoint."""

    end: Position
    """Where it stopped, as the run's position (``state.progress``) now says: ``sample``
    is the epoch's size at its end; earlier at a due checkpoint or at ``--max-steps``."""
    sums: EpochSums
    """This rank's sums over the whole epoch so far (earlier passes included)."""
    samples: int
    """Samples trained in this pass (for speed)."""
    skipped: int
    """fp16 steps the GradScaler skipped (overflowed gradients)."""
    checkpoint_due: bool
    """Stopped early because ``--checkpoint-every`` steps were reached."""


def train_segment(
    core: StepCore,
    order: GlobalOrderBatches,
    loader: Iterable,
    sums: EpochSums,
    hooks: StepHook,
    limits: Limits,
) -> EpochSegment:
    """Train the micro-batches ``order`` holds for this rank (the caller set its position;
    ``loader`` draws from it and yields the task's batches, on the device), continuing the
    epoch's ``sums``; stops at the epoch's end or where ``limits`` say."""
    progress, plan, slots = core.state.progress, order.plan, order.slots
    now = Pass(plan, len(slots), seen=sums.samples, ledger=sums.ledger)
    now.loss_sum = torch.tensor(sums.loss_sum, dtype=torch.float64, device=core.device)
    now.loss_count = torch.tensor(sums.count, dtype=torch.float64, device=core.device)
    due, stopped, skipped = False, False, 0
    core.state.model.train()
    core.state.optimizer.zero_grad(set_to_none=True)
    hooks.pass_started(now)
    opened = time.perf_counter()
    batches = iter(loader)  # a Ray Data stream starts here: its wait is the data's too
    hooks.fetched(now, time.perf_counter() - opened)
    for now.index, slot in enumerate(slots):
        now.step = progress.step + 1
        batch = _fetch(batches, now, hooks)
        batch, good, stand_in = _readable(batch, slot, core.stand_in, hooks, now, core.rank)
        # The step's gradient is the mean over all its samples, however the ranks and
        # micro-batches split them (a filler weighs 0): each micro-batch's mean loss
        # weighs by its share of the step's samples (``optim.Stepper``).
        share = 0.0 if stand_in else slot.size / slot.step_samples
        core.stand_in = core.stand_in if stand_in else batch
        hooks.computing(slot, now)
        loss, total, count = core.backward(batch, slot, share, now.step, hooks)
        if not slot.filler:
            now.loss_sum += loss.detach().double() * good if total is None else total.double()
            now.loss_count += good if count is None else count
            now.seen, now.trained = now.seen + good, now.trained + good
        if slot.boundary:
            hooks.updating(now)
            skipped += 0 if core.update() else 1
            progress.advance(plan.step_start(slot.step + 1))  # the run's one position
            hooks.stepped(now, loss, core.state.lr)
        hooks.trained(slot, now)
        if slot.boundary and (
            limits.done(progress.step)
            or (limits.checkpoint_due(progress.step) and slot.step + 1 < plan.steps)
        ):  # where a re-run, or the resume from the checkpoint now due, continues
            due, stopped = not limits.done(progress.step), True
            break
    if not stopped:  # the epoch's order is done (a stream may end a step early)
        progress.sample = plan.size
    hooks.pass_ended(now)
    sums = EpochSums(now.loss_sum.item(), now.seen, sums.ledger, now.loss_count.item())
    end = Position(progress.epoch, progress.step, progress.sample)
    return EpochSegment(end, sums, now.trained, skipped, due)


def _fetch(batches, now: Pass, hooks: StepHook):
    hooks.fetching(now)
    waited = time.perf_counter()
    batch = next(batches, None)
    hooks.fetched(now, time.perf_counter() - waited)
    if batch is None:
        raise RuntimeError(
            f"the loader ran out after {now.index} of {now.micro_batches} micro-batches"
        )
    return batch


def _readable(batch, slot: Slot, last_good, hooks: StepHook, now: Pass, rank: int):
    """``(batch, samples that count, whether it stands in)``: where nothing of the
    micro-batch was readable, the latest readable one stands in (trained with weight 0). Unreadable
    samples were left out (``ray_ddp.data.unreadable``): the micro-batch keeps its weight,
    its loss is the mean over the samples that were read, and only those count. A filler's
    were counted by the rank that trained them. A micro-batch of nothing readable still
    takes part in the step's backward, with weight 0 (as the epoch's fillers do), on the
    core's stand-in; a rank that has none (no validation sample to count FLOPs on, and
    nothing read yet) stops the run."""
    batch, bad = take_skipped(batch)
    now.unread = frozenset(b.index for b in bad)
    if bad and not slot.filler:
        hooks.unreadable(bad, now)  # raises once this rank alone is over the cap
    good = slot.size - (0 if slot.filler else len(bad))
    if batch is not None:
        return batch, good, False
    if last_good is None:
        names = ", ".join(f"{b.name} ({b.error})" for b in bad[:3])
        raise BadSamplesError(
            f"every sample of rank {rank}'s first micro-batch was unreadable, and it has no "
            f"readable batch to stand in for it: {names}. Fix or remove them"
        )
    return last_good, good, True


def _channels_last(tensor: torch.Tensor) -> torch.Tensor:
    """An image tensor (4-d floating point) in NHWC memory, like the weights; others as
    they are."""
    if tensor.dim() == 4 and tensor.is_floating_point():
        return tensor.contiguous(memory_format=torch.channels_last)
    return tensor
