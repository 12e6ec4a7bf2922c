"""Steady-state speed of the optimizer steps, as one worker sees it.

The epoch figures include start-up, evaluation and checkpoint writes; these do not. Each
optimizer step is timed from the end of the one before it (data loading included), the
first ``WARMUP_STEPS`` of a run and every interval broken by something else (an epoch
boundary, a checkpoint) are left out. Only host clocks: no device synchronisation is added,
so on a GPU single intervals show when the CPU waited, and the totals are what counts.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ray_ddp.io.timeline import mark

WARMUP_STEPS = 10


class StepTimer:
    def __init__(self, warmup_steps: int = WARMUP_STEPS, who: str = "worker") -> None:
        self.warmup_steps = warmup_steps
        self.who = who  # for the timeline's mark of the first step
        self.steps = 0
        self.first_step_unix: float | None = None
        self.durations: list[float] = []
        self.samples_timed = 0
        self._mark: float | None = None

    def restart(self) -> None:
        """The next interval starts now (after an epoch boundary or a checkpoint)."""
        self._mark = time.perf_counter()

    def pause(self) -> None:
        """The next interval is not a step's own time: leave it out."""
        self._mark = None

    def step(self, samples: int) -> None:
        """An optimizer step has just finished, after ``samples`` samples on this worker."""
        now = time.perf_counter()
        self.steps += 1
        if self.first_step_unix is None:
            self.first_step_unix = time.time()
            mark("first optimizer step", self.who)
        if self.steps > self.warmup_steps and self._mark is not None:
            self.durations.append(now - self._mark)
            self.samples_timed += samples
        self._mark = now

    def summary(self) -> dict[str, Any]:
        timed = sum(self.durations)
        return {
            "warmup_steps": self.warmup_steps,
            "steps_timed": len(self.durations),
            "first_step_unix": self.first_step_unix,
            "step_time_median_s": statistics.median(self.durations) if self.durations else None,
            "steady_samples_per_s_per_worker": self.samples_timed / timed if timed else None,
        }


class EpochTiming:
    """One rank's timing over an epoch, for the data-wait and straggler figures.

    - ``data_wait_s``: time spent waiting for the next batch from the loader;
    - per optimizer step, the time from the step's start (the end of the previous step)
      until the rank is ready for the gradient all-reduce (data, forwards, the backwards
      under ``no_sync``, the last forward): its own work, without the time it then waits
      for slower ranks. DDP steps start together on every rank, so the rank whose
      ready time is longest is the one the others wait for.
    """

    def __init__(self) -> None:
        self.data_wait_s = 0.0
        self.ready: list[tuple[int, float]] = []
        """``(micro-batches this rank trained in the step, seconds until ready)``."""

    def summary(self, train_seconds: float) -> dict[str, Any]:
        """``data_wait`` (fraction of the training time), ``data_wait_ms`` (per optimizer
        step), ``ready_ms`` (median over the steps with this rank's usual number of
        micro-batches) and that number."""
        out: dict[str, Any] = {
            "data_wait": self.data_wait_s / train_seconds if train_seconds else 0.0
        }
        if self.ready:
            out["data_wait_ms"] = 1000 * self.data_wait_s / len(self.ready)
            usual = statistics.mode(count for count, _ in self.ready)
            times = [seconds for count, seconds in self.ready if count == usual]
            out.update(ready_ms=1000 * statistics.median(times), micro_per_step=usual)
        return out
