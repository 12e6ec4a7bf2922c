"""A rank's hang watchdog: a daemon thread that notices when the rank stops making progress.

The worker's run holds its watchdog (``NullWatchdog`` with ``--hang-timeout 0``) and
says what the rank is doing (:meth:`Watchdog.doing`: a phase, whether it
is a collective every rank must join, whether it is slow by nature) and when something
finished (:meth:`Watchdog.progress`: an optimizer step, an evaluation batch, a checkpoint).
Both are a few attribute writes, nothing next to a step. The thread wakes every
``check_s``; once the time since the last progress exceeds the current phase's allowance it
calls ``on_hang`` once with what it knew (:class:`Stall`), from the watchdog thread, while
the training thread is still stuck. No Ray and no torch here.

Allowances (``--hang-timeout``, ``--hang-grace``):

- steady phases (a training step, an evaluation batch, waiting for data):
  ``--hang-timeout``; auto: 20 x the median of the last 50 step intervals, at least
  ``AUTO_FLOOR_S`` (120 s) and at most the grace; the grace until 5 intervals are known;
- phases slow by nature (an attempt's start and first step, the first batch of a pass over
  a loader, checkpoints and reports): ``--hang-grace`` (at least the steady allowance).

A rank in a slow phase that the others are waiting on is seen by the others in their
steady phases. ``peer_check`` (optional) lets a rank notice that another rank found a hang
while it is itself still inside a longer allowance, so that every rank writes its stacks.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

AUTO_FACTOR = 20
"""Auto ``--hang-timeout``: this many median step times without a step is a hang."""
AUTO_FLOOR_S = 120.0
"""Auto ``--hang-timeout`` is never shorter: a garbage collection, a slow filesystem or a
page-cache miss can stall one step of a fast loop for seconds."""
AUTO_MIN_INTERVALS = 5


@dataclass(frozen=True)
class Stall:
    """What the watchdog knew when it gave up on its rank."""

    idle_s: float
    """Seconds since the last progress."""
    allowed_s: float
    """The allowance of the phase the rank was in."""
    phase: str
    """What the rank was doing (``Watchdog.doing``)."""
    collective: bool
    """The phase waits for every rank (an all-reduce, a barrier)."""
    last_progress: str
    """What finished last, e.g. ``optimizer step 13``."""
    thread_id: int
    """The training thread (for its stack)."""
    by_peer: bool = False
    """Found through ``peer_check`` (another rank's hang) rather than by this rank's own
    allowance."""


class Watchdog:
    def __init__(
        self,
        on_hang: Callable[[Stall], None],
        steady_s: float | None,
        grace_s: float,
        peer_check: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``steady_s``: ``--hang-timeout`` (None: auto); ``grace_s``: ``--hang-grace``;
        ``clock``: seconds, monotonic (a test's own, to place time rather than sleep)."""
        self.clock = clock
        self.on_hang = on_hang
        self.steady_s = steady_s
        self.grace_s = max(grace_s, steady_s or 0.0)
        self.peer_check = peer_check
        # Wake often enough that a hang is seen within ~10% of its allowance past it.
        self.check_s = min(5.0, max(0.1, (steady_s or AUTO_FLOOR_S) / 10))
        self.phase, self.collective, self.slow = "starting", False, True
        self.last_progress = "nothing yet"
        self.last_step: int | None = None
        self._last_time = self.clock()
        self._step_time: float | None = None
        self._intervals: deque[float] = deque(maxlen=50)
        self._thread_id = threading.get_ident()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ray_ddp-watchdog", daemon=True)

    # ------------------------------------------------------------- the loop's side
    def start(self) -> Watchdog:
        """Watch the calling thread from now on."""
        self._thread_id = threading.get_ident()
        self._last_time = self.clock()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def doing(self, phase: str, collective: bool = False, slow: bool = False) -> None:
        """The rank is now in ``phase`` (no progress: the clock keeps running)."""
        self.phase, self.collective, self.slow = phase, collective, slow

    def progress(self, what: str, step: int | None = None) -> None:
        """Something finished (``step``: an optimizer step, whose interval feeds the auto
        allowance when the one before it was a step too)."""
        now = self.clock()
        if step is not None:
            if self._step_time is not None and self.last_step == step - 1:
                self._intervals.append(now - self._step_time)
            self._step_time, self.last_step = now, step
        else:
            self._step_time = None  # the next step's interval includes this: not a step's
        self.last_progress = what if step is None else f"{what} {step}"
        self._last_time = now

    # ---------------------------------------------------------- the thread's side
    def steady_allowance(self) -> float:
        if self.steady_s is not None:
            return self.steady_s
        if len(self._intervals) < AUTO_MIN_INTERVALS:
            return self.grace_s
        typical = AUTO_FACTOR * statistics.median(self._intervals)
        return min(self.grace_s, max(AUTO_FLOOR_S, typical))

    def allowance(self) -> float:
        return self.grace_s if self.slow else self.steady_allowance()

    def idle_s(self) -> float:
        return self.clock() - self._last_time

    def check(self) -> Stall | None:
        """A :class:`Stall` if the rank is hung now (or a peer found a hang), else None."""
        idle, allowed = self.idle_s(), self.allowance()
        by_peer = False
        if idle <= allowed:
            # Inside a longer allowance but idle past the steady one: ask whether another
            # rank has found a hang (cheap, and only while this rank is not progressing).
            if not (self.peer_check and idle > self.steady_allowance() and self.peer_check()):
                return None
            by_peer = True
        return Stall(
            idle_s=idle,
            allowed_s=allowed,
            phase=self.phase,
            collective=self.collective,
            last_progress=self.last_progress,
            thread_id=self._thread_id,
            by_peer=by_peer,
        )

    def _watch(self) -> None:
        while not self._stopped.wait(self.check_s):
            stall = self.check()
            if stall is not None:
                self._stopped.set()
                self.on_hang(stall)
                return


class NullWatchdog:
    """What a run without a watchdog (``--hang-timeout 0``) tells: nothing is watched."""

    def doing(self, phase: str, collective: bool = False, slow: bool = False) -> None:
        pass

    def progress(self, what: str, step: int | None = None) -> None:
        pass

    def stop(self) -> None:
        pass


def watched(
    batches: Iterable[T], what: str, watchdog: Watchdog | NullWatchdog, then: str | None = None
) -> Iterator[T]:
    """``batches``, with ``watchdog`` told about each: the first is slow by nature (the
    loader's workers start), each batch finished is progress; ``then``: the phase after
    the last (say, the all-reduce that follows an evaluation)."""
    watchdog.doing(f"{what}: first batch", slow=True)
    for batch in batches:
        watchdog.doing(what)
        yield batch
        watchdog.progress(f"{what} batch")
        watchdog.doing(f"{what}: waiting for data")
    if then is not None:
        watchdog.doing(then, collective=True)
