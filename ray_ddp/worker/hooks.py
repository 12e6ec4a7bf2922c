"""What happens around an optimizer step besides the step itself, as a few step-level
hooks: the hang watchdog told what the rank does, the steady step timer, and a test's
faults (``ray_ddp.testing.harness``: a stall, a killed rank, a slow step, the log of the
steps applied), which attach here like any other hook, not through an argument of the
production code. An own loop's steps call them (``worker.micro``); three calls per step,
never one per micro-batch.
"""

from __future__ import annotations

from ray_ddp.compat import notices
from ray_ddp.reliability.hangs.watchdog import NullWatchdog, Watchdog
from ray_ddp.testing import harness as rig
from ray_ddp.worker.position import Position
from ray_ddp.worker.timing import StepTimer

WAITING_FOR_DATA = "training: waiting for data from the loader"
STEPPING = "training: the loop's own step (forward, backward, all-reduce, update)"


class StepHook:
    """The hooks of a step, in the order they are called; all no-ops here."""

    def fetching(self, position: Position, first: bool) -> None:
        """The step's micro-batches are about to be read (``first``: the attempt's first
        step, slow by nature)."""

    def stepping(self, position: Position, first: bool) -> None:
        """They are read; the loop's own work on them begins."""

    def ended(self, step: int, samples: int) -> None:
        """Optimizer step ``step`` (counted over the run) is done, after ``samples`` of
        this rank's samples; the position is not advanced yet (a fault here loses it)."""


class Hooks(StepHook):
    """Several hooks, called in turn."""

    def __init__(self, *hooks: StepHook) -> None:
        self.all = list(hooks)

    def fetching(self, position, first):
        for hook in self.all:
            hook.fetching(position, first)

    def stepping(self, position, first):
        for hook in self.all:
            hook.stepping(position, first)

    def ended(self, step, samples):
        for hook in self.all:
            hook.ended(step, samples)


class Watched(StepHook):
    """The rank's watchdog (``reliability.hangs``): what it is doing, and each step done."""

    def __init__(self, watchdog: Watchdog | NullWatchdog) -> None:
        self.watchdog = watchdog

    def fetching(self, position, first):
        self.watchdog.doing(WAITING_FOR_DATA, slow=first)

    def stepping(self, position, first):
        self.watchdog.doing(STEPPING, collective=True, slow=first)

    def ended(self, step, samples):
        self.watchdog.progress("optimizer step", step)


class Timed(StepHook):
    """The steady step time and samples per second (``worker.timing``)."""

    def __init__(self, timer: StepTimer) -> None:
        self.timer = timer

    def ended(self, step, samples):
        self.timer.step(samples)


class Faults(StepHook):
    """A test's faults at a step's end (``ray_ddp.testing.harness``)."""

    def __init__(self, harness: rig.Harness, run_dir: str, rank: int) -> None:
        self.harness, self.run_dir, self.rank = harness, run_dir, rank
        self.first = True

    def stepping(self, position, first):
        rig.slow_down(self.harness, self.rank)

    def ended(self, step, samples):
        rig.stall(self.harness, self.run_dir, self.rank, step, notices.arrived_here)
        rig.log_step(self.harness, self.run_dir, self.rank, step)
        if self.first:
            rig.slow_start(self.harness)
        self.first = False
