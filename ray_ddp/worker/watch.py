"""What watches and records a run's steps, built one way for both loops (the built-in
``worker.loop`` and an own loop's ``worker.own_loop.Run``): the chain of step-level hooks
(``worker.hooks``) in its order, which is load-bearing; the ``--profile-steps`` profiler;
and the run's outputs besides its checkpoints (rank 0's run logs and tracker run, every
rank's profile), closed at the end into what the worker's summary adds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray_ddp.config.sections import Logging, step_range
from ray_ddp.reliability.hangs.watchdog import NullWatchdog, Watchdog
from ray_ddp.reliability.loss_guard import LossGuard
from ray_ddp.testing.harness import Harness
from ray_ddp.worker import hooks as hooked
from ray_ddp.worker.identity import Worker
from ray_ddp.worker.profile import StepProfiler
from ray_ddp.worker.run_tracking import RunTracking

if TYPE_CHECKING:
    from ray_ddp.io.run_logs import RunLogs  # tensorboardX: rank 0's alone


def step_profiler(
    logging: Logging, run_dir: str, attempt: int, worker: Worker
) -> StepProfiler | None:
    """The rank's profiler over ``--profile-steps`` (None without the flag), writing into
    ``run_dir``'s folder of attempt ``attempt``."""
    steps = step_range(logging.profile_steps)
    if not steps:
        return None
    return StepProfiler(steps, run_dir, attempt, worker.rank, worker.device, worker.log)


def step_hooks(
    logging: Logging, run_dir: str, epochs: int, worker: Worker,
    watchdog: Watchdog | NullWatchdog, harness: Harness, timing: hooked.Timing, *,
    between: Sequence[hooked.StepHook] = (), tracker: RunTracking | None = None,
    profiler: StepProfiler | None = None,
) -> hooked.Hooks:  # fmt: skip
    """What watches every step, in this order: the watchdog, a test's faults (after the
    watchdog is told, before the loss guard sees the loss), ``timing``, the loss guard,
    then ``between`` (the built-in loop's unreadable samples, ledger and TensorBoard), rank
    0's progress line (of ``epochs``), the tracker's points, the profiler. ``run_dir``:
    where a test's faults leave their marks."""
    every = logging.log_every_steps
    chain: list[hooked.StepHook] = [
        hooked.WatchdogSteps(watchdog),
        hooked.Faults(harness, run_dir, worker.rank),
        timing,
        hooked.Guard(LossGuard(worker.device, worker.rank, check_every=every)),
        *between,
    ]
    if worker.is_main and logging.progress_interval_s > 0:
        chain.append(hooked.Progress(logging.progress_interval_s, epochs))
    if tracker is not None:
        chain.append(tracker.hook(every))
    if profiler is not None:
        chain.append(hooked.Profiled(profiler))
    return hooked.Hooks(*chain)


@dataclass
class Outputs:
    """What a run writes besides checkpoints: rank 0's run logs (TensorBoard,
    ``metrics.csv``: the built-in loop's), rank 0's tracker run (``--tracking``), the
    rank's profiler (``--profile-steps``). None: not written here."""

    logs: RunLogs | None = None
    tracker: RunTracking | None = None
    profiler: StepProfiler | None = None

    def close(self) -> dict[str, Any]:
        """The logs flushed (curves.png rendered from metrics.csv), the profiler stopped,
        what the tracker holds sent (for a while: the run ends); returns what the worker's
        summary adds: the profile's and the tracker's results."""
        ended: dict[str, Any] = {}
        if self.logs is not None:
            self.logs.close()
            self.logs = None
        if self.profiler is not None:
            self.profiler.close()
            if self.profiler.result:
                ended["profile"] = self.profiler.result
        if self.tracker is not None:
            ended["tracking"] = self.tracker.close()
            self.tracker = None
        return ended
