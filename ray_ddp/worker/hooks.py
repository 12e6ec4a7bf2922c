"""What happens around a training step besides the step itself, as step-level hooks: one
mechanism for both loops. The built-in loop's pass (``worker.step.train_segment``) and an
own loop's verbs (``worker.own_loop.Run``: its steps, ``backward`` and ``step``) call the
same events on the same hooks, in this order:

- ``WatchdogSteps``: tells the rank's hang watchdog what the rank is doing (waiting for
  data, computing, in the gradient all-reduce, stepping) and when a step finished;
- ``Faults``: a test's injected faults (``ray_ddp.testing``: a slow step, a stall, a NaN),
  after the watchdog is told (a stalled rank is found in the phase it stalled in) and
  before the loss guard (which must see a poisoned loss): the test harness attaches here,
  not through an argument of the production code;
- ``Timing``: the wait for data, each step's ready time, the steady step timer;
- ``Guard``: the non-finite loss check (``ray_ddp.reliability.loss_guard``);
- ``Skips``: unreadable samples, counted against ``--max-bad-samples``;
- ``Ledger``: a test's sample ledger;
- ``StepLogs``: the training loss and lr to TensorBoard every ``--log-every-steps``;
- ``Tracked``: the same and the speed since the last, to the experiment tracker
  (``--tracking``: put on its queue, never waited for);
- ``Profiled``: ``--profile-steps``'s profiler told of each step (``worker.profile``);
- ``Progress``: rank 0's in-epoch progress line.

A hook that a hook class does not need is the base class's no-op. The built-in loop calls
the per-micro-batch events for each micro-batch; an own loop, whose function owns its
micro-batches, calls ``computing`` and ``updating`` once per step, ``loss`` and
``syncing`` from its ``backward``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ray_ddp.compat import notices
from ray_ddp.data.order.global_order import EpochPlan, Slot
from ray_ddp.data.unreadable import BadSample, SkipLog
from ray_ddp.io import reporting
from ray_ddp.reliability.hangs.watchdog import NullWatchdog, Watchdog
from ray_ddp.reliability.loss_guard import LossGuard
from ray_ddp.task import Sum
from ray_ddp.testing import harness as rig
from ray_ddp.worker.collectives import world_size
from ray_ddp.worker.timing import EpochTiming, StepTimer

if TYPE_CHECKING:
    from ray_ddp.io.run_logs import RunLogs  # tensorboardX: not where the GPU check runs
    from ray_ddp.tracking.tracker import Tracker
    from ray_ddp.worker.profile import StepProfiler

# What the hang watchdog reports a rank doing (ray_ddp.reliability.hangs).
WAITING_FOR_DATA = "training: waiting for data from the loader"
COMPUTING = "training: forward and backward"
GRADIENT_SYNC = "training: backward with DDP's gradient all-reduce"
OPTIMIZER_STEP = "training: after backward, before the optimizer step is done"


@dataclass
class Pass:
    """A pass in progress, as the step-level hooks see it."""

    plan: EpochPlan
    """The epoch's plan, from the position the pass started at."""
    micro_batches: int
    """This rank's micro-batches in the pass (its slots)."""
    index: int = 0
    """The micro-batch being trained (0-based)."""
    step: int = 0
    """The optimizer step being trained, counted over the run (1-based)."""
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    """This rank's sum of per-sample losses over the epoch so far, on the device: an
    ``.item()`` every step would wait for the GPU each time."""
    loss_count: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    """What ``loss_sum`` is over: samples, or a ``Sum`` loss's counts (tokens, say)."""
    seen: int = 0
    """This rank's samples of the epoch so far (the part before the pass included)."""
    trained: int = 0
    """This rank's samples trained in this pass."""
    started: float = field(default_factory=time.perf_counter)
    unread: frozenset[int] = frozenset()
    """The dataset indices of the micro-batch's unreadable samples."""
    ledger: list[tuple[int, int]] | None = None
    """A test's sample ledger of the epoch (``EpochSums.ledger``), or None."""


class StepHook:
    """The events of a pass over an epoch's steps, in the order they come; all no-ops
    here."""

    def pass_started(self, now: Pass) -> None:
        """A pass over the epoch's micro-batches begins (the first, or after a checkpoint)."""

    def fetching(self, now: Pass) -> None:
        """About to wait for micro-batch ``now.index`` from the loader."""

    def fetched(self, now: Pass, waited_s: float) -> None:
        """The loader gave it (or started the pass) after ``waited_s``."""

    def unreadable(self, bad: list[BadSample], now: Pass) -> None:
        """Samples of the micro-batch that could not be read (left out of it)."""

    def computing(self, slot: Slot, now: Pass) -> None:
        """Its forward and backward begin."""

    def loss(self, loss: torch.Tensor, slot: Slot, step: int) -> torch.Tensor:
        """Its loss, before the backward: returned as it is, or as a test's fault makes it."""
        return loss

    def syncing(self, slot: Slot, distributed: bool) -> None:
        """The step's last micro-batch on this rank: its backward all-reduces (with DDP)."""

    def updating(self, now: Pass) -> None:
        """The backward of the step is done; clipping and the optimizer step follow."""

    def stepped(self, now: Pass, loss: torch.Tensor, lr: float) -> None:
        """Optimizer step ``now.step`` is done (``loss``: its last micro-batch's)."""

    def trained(self, slot: Slot, now: Pass) -> None:
        """Micro-batch ``now.index`` is done (and the step, where it was the last)."""

    def pass_ended(self, now: Pass) -> None:
        """The pass stops: at the epoch's end, a due checkpoint or ``--max-steps``."""


class Hooks(StepHook):
    """Several hooks, called in turn (a loss passes through each)."""

    def __init__(self, *hooks: StepHook) -> None:
        self.all = hooks

    def pass_started(self, now):
        for o in self.all:
            o.pass_started(now)

    def fetching(self, now):
        for o in self.all:
            o.fetching(now)

    def fetched(self, now, waited_s):
        for o in self.all:
            o.fetched(now, waited_s)

    def unreadable(self, bad, now):
        for o in self.all:
            o.unreadable(bad, now)

    def computing(self, slot, now):
        for o in self.all:
            o.computing(slot, now)

    def loss(self, loss, slot, step):
        for o in self.all:
            loss = o.loss(loss, slot, step)
        return loss

    def syncing(self, slot, distributed):
        for o in self.all:
            o.syncing(slot, distributed)

    def updating(self, now):
        for o in self.all:
            o.updating(now)

    def stepped(self, now, loss, lr):
        for o in self.all:
            o.stepped(now, loss, lr)

    def trained(self, slot, now):
        for o in self.all:
            o.trained(slot, now)

    def pass_ended(self, now):
        for o in self.all:
            o.pass_ended(now)


class Faults(StepHook):
    """A test's faults (``ray_ddp.testing.harness``): a slow step before its last forward
    (the rank's own work, like a slow GPU's), a NaN loss, a stall before the update, a slow
    first step."""

    def __init__(self, harness: rig.Harness, run_dir: str, rank: int) -> None:
        self.harness, self.run_dir, self.rank = harness, run_dir, rank
        self.first = True

    def computing(self, slot, now):
        if slot.boundary:
            rig.slow_down(self.harness, self.rank)

    def loss(self, loss, slot, step):
        return rig.poison_loss(self.harness, loss, step, self.rank)

    def updating(self, now):
        rig.stall(self.harness, self.run_dir, self.rank, now.step, notices.arrived_here)
        rig.log_step(self.harness, self.run_dir, self.rank, now.step)
        if self.first:
            rig.slow_start(self.harness)
        self.first = False


class WatchdogSteps(StepHook):
    """The rank's watchdog told what the step is doing. An attempt's first step is slow by
    nature (loader workers start, kernels are chosen, a compile): it gets the grace, as a
    pass's first batch does."""

    def __init__(self, watchdog: Watchdog | NullWatchdog) -> None:
        self.watchdog = watchdog
        self.first = True

    def fetching(self, now):
        self.watchdog.doing(WAITING_FOR_DATA, slow=self.first or now.index == 0)

    def computing(self, slot, now):
        self.watchdog.doing(COMPUTING, slow=self.first)

    def syncing(self, slot, distributed):
        if distributed:
            self.watchdog.doing(GRADIENT_SYNC, collective=True, slow=self.first)

    def updating(self, now):
        self.watchdog.doing(OPTIMIZER_STEP, slow=self.first)

    def stepped(self, now, loss, lr):
        self.watchdog.progress("optimizer step", now.step)
        self.first = False


class Timing(StepHook):
    """This rank's data wait and ready times over the epoch (``epoch``, a new one each
    epoch) and its steady step times over the attempt (``timer``)."""

    def __init__(self, timer: StepTimer) -> None:
        self.timer, self.epoch = timer, EpochTiming()
        self.micro = self.counted = 0
        self.step_started = time.perf_counter()

    def new_epoch(self) -> None:
        self.epoch = EpochTiming()

    def pass_started(self, now):
        self.timer.restart()
        self.micro, self.counted, self.step_started = 0, now.trained, time.perf_counter()

    def fetched(self, now, waited_s):
        self.epoch.data_wait_s += waited_s

    def computing(self, slot, now):
        self.micro += 1

    def syncing(self, slot, distributed):
        self.epoch.ready.append((self.micro, time.perf_counter() - self.step_started))

    def stepped(self, now, loss, lr):
        self.timer.step(now.trained - self.counted)
        self.micro, self.counted, self.step_started = 0, now.trained, time.perf_counter()


class Guard(StepHook):
    """Stops the run on a non-finite loss, naming the step and the rank."""

    def __init__(self, guard: LossGuard) -> None:
        self.guard = guard
        self.plan_at = (0, 0)  # (epoch, the pass's first step in the epoch), for messages

    def pass_started(self, now):
        self.plan_at = (now.plan.epoch, now.plan.first_step)

    def loss(self, loss, slot, step):
        epoch, first = self.plan_at
        where = f"epoch {epoch + 1}, step {first + slot.step + 1} of the epoch"
        self.guard.observe(loss, step, where)
        return loss

    def stepped(self, now, loss, lr):
        self.guard.maybe_check(now.step)

    def pass_ended(self, now):
        self.guard.check()


class Skips(StepHook):
    """This rank's unreadable training samples of the epoch (``log``, a new one each
    epoch, with the run's cap)."""

    def __init__(self, log: SkipLog) -> None:
        self.log = log

    def unreadable(self, bad, now):
        self.log.add(bad)  # raises once this rank alone is over the cap


class Ledger(StepHook):
    """A test's sample ledger: ``(step, index)`` of every sample this rank trained, into
    the epoch's sums (``now.ledger``: carried across passes and in mid-epoch checkpoints)."""

    def trained(self, slot, now):
        if now.ledger is not None and not slot.filler:
            now.ledger.extend((now.step, i) for i in slot.indices if i not in now.unread)


class StepLogs(StepHook):
    """Rank 0's TensorBoard: the training loss and lr every ``every`` optimizer steps."""

    def __init__(self, logs: RunLogs, every: int) -> None:
        self.logs, self.every = logs, every

    def stepped(self, now, loss, lr):
        if now.step % self.every == 0:
            self.logs.step(now.step, loss.item(), lr)


class Tracked(StepHook):
    """Rank 0's tracker: the training loss, lr and samples/s (all ranks, since the last
    log) every ``every`` optimizer steps, at the optimizer step."""

    def __init__(self, tracker: Tracker, every: int) -> None:
        self.tracker, self.every = tracker, every
        self.since, self.counted = time.perf_counter(), 0

    def pass_started(self, now):
        self.since, self.counted = time.perf_counter(), 0

    def stepped(self, now, loss, lr):
        if now.step % self.every:
            return
        seconds = time.perf_counter() - self.since
        values = {"train_loss": loss.item(), "lr": lr}
        if seconds > 0 and now.trained > self.counted:
            values["samples_per_s"] = (now.trained - self.counted) * world_size() / seconds
        self.tracker.points(now.step, values)
        self.since, self.counted = time.perf_counter(), now.trained


class Profiled(StepHook):
    """``--profile-steps``: the rank's profiler told where each optimizer step ends."""

    def __init__(self, profiler: StepProfiler) -> None:
        self.profiler = profiler

    def stepped(self, now, loss, lr):
        self.profiler.stepped(now.step)


class Progress(StepHook):
    """Rank 0's in-epoch progress line every ``interval_s`` (in samples of the epoch's
    order, the same at any world size)."""

    def __init__(self, interval_s: float, epochs: int) -> None:
        self.interval_s, self.epochs = interval_s, epochs
        self.last = time.perf_counter()

    def pass_started(self, now):
        self.last = now.started

    def trained(self, slot, now):
        if time.perf_counter() - self.last < self.interval_s:
            return
        self.last = time.perf_counter()
        done, elapsed, ranks = now.index + 1, self.last - now.started, world_size()
        counted = now.loss_count.item()  # nothing where an own loop's losses are its own
        line = reporting.progress_line(
            now.plan.epoch + 1,
            self.epochs,
            min(now.plan.start + now.trained * ranks, now.plan.size),
            now.plan.size,
            now.loss_sum.item() / counted if counted else None,
            now.trained * ranks / elapsed,
            elapsed * (now.micro_batches - done) / done,
        )
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def observed_loss(loss: torch.Tensor | Sum, slot: Slot, step: int, hook: StepHook):
    """``(loss, total, count)`` of a micro-batch's loss: the loss as the hooks see it (a
    test's fault may poison it; the loss guard checks it), as one number (a ``Sum``'s
    total / count), and for a ``Sum`` its total and count (the total follows a poisoned
    loss). A mean loss has no total and count (None)."""
    if not isinstance(loss, Sum):
        return hook.loss(loss.float(), slot, step), None, None
    total, count = torch.as_tensor(loss.total).float(), loss.count
    mean = total / torch.as_tensor(count, dtype=total.dtype, device=total.device).clamp(min=1)
    seen = hook.loss(mean, slot, step)
    return seen, total if seen is mean else seen * count, count
