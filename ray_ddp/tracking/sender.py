"""Delivery off the training thread: a queue the training loop puts into without ever
waiting, and a background thread that sends what has gathered as one batch every
interval, retrying with backoff.

What a user needs of a run is never dropped: params, tags, metrics (an epoch's figures)
and artifacts wait as long as the run lasts. Only step points (``"point"`` items: the
loss, lr and speed every ``--log-every-steps``) give way: when more than ``capacity`` of
them wait (a server slower than the run, or away), every other step of those waiting is
dropped, the newest kept: the curve keeps its whole span, coarser the longer the server
lags; each dropped point is counted. The batch being sent is out of the queue (``flight``): nothing
put meanwhile touches it, and it goes back to the queue's head only if its send failed.

A batch that still fails after its retries is tried again once each interval, so a
server that comes back gets the history it missed; the first such failure is said in
one line, and nothing more is said however long the server stays away. What the sink
rejects as invalid (:class:`Rejected`) is dropped at once. ``close`` gives the backlog
until its deadline, then gives up: the run finishes whatever the server does, and
:meth:`Sender.line` says exactly what did not reach the tracker. No Ray, no torch, no
tracker.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

Item = tuple[Any, ...]
"""``("point", key, value, step, ms)`` (a step's figure: may be thinned),
``("metric", key, value, step, ms)`` (never dropped), ``("param", key, value)``,
``("tag", key, value)``, ``("artifact", path, folder)``, ``("end", status)``,
``("open",)`` (only makes the sink open its run)."""

POINT = "point"
METRICS = (POINT, "metric")
"""The kinds a sink logs as metrics."""
LABELS = {POINT: "step point", "metric": "metric", "param": "param", "tag": "tag",
          "artifact": "artifact", "end": "run status"}  # fmt: skip
"""What each kind is called in :meth:`Sender.line` (``open`` is not counted)."""


class Rejected(Exception):
    """The tracker refused a batch as invalid: sending it again cannot help."""


def counted(items: Iterable[Item]) -> Counter[str]:
    """``items`` by kind (``open`` left out)."""
    return Counter(item[0] for item in items if item[0] in LABELS)


def thin(items: deque[Item]) -> tuple[deque[Item], int]:
    """``items`` without every other step's points (counted from the newest, which is
    kept; a step's points are the consecutive ones of one step), and how many went."""
    kept: deque[Item] = deque()
    group, last, dropped = -1, None, 0
    for item in reversed(items):
        if item[0] == POINT:
            if item[3] != last:
                group, last = group + 1, item[3]
            if group % 2:
                dropped += 1
                continue
        kept.appendleft(item)
    return kept, dropped


def _listed(counts: Counter[str]) -> str:
    """``counts`` as words, in the order of ``LABELS``: ``"16 step points, 1 metric"``."""
    return ", ".join(
        f"{n:,} {label}{'' if n == 1 else 'es' if label.endswith('s') else 's'}"
        for kind, label in LABELS.items() if (n := counts[kind])
    )  # fmt: skip


class Sender:
    """``deliver(items)`` called from a thread of its own; ``put`` never blocks."""

    def __init__(
        self,
        deliver: Callable[[list[Item]], None],
        warn: Callable[[str], None],
        what: str,
        interval_s: float = 1.0,
        backoff_s: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0),
        capacity: int = 100_000,
    ) -> None:
        self.deliver, self.warn, self.what = deliver, warn, what
        self.interval_s, self.backoff_s, self.capacity = interval_s, backoff_s, capacity
        self.items: deque[Item] = deque()
        self.points = 0
        """Step points in ``items``."""
        self.flight: list[Item] = []
        """The batch being sent (out of ``items``)."""
        self.lock = threading.Lock()
        self.wake, self.stop = threading.Event(), threading.Event()
        self.deadline = float("inf")
        self.failing = False
        self.warned = False
        self.delivered: Counter[str] = Counter()
        self.thinned = 0
        """Step points dropped because too many waited."""
        self.rejected: Counter[str] = Counter()
        self.unsent: Counter[str] = Counter()
        """Still queued when ``close`` gave up."""
        self.unconfirmed: Counter[str] = Counter()
        """Being sent when ``close`` gave up: whether they arrived is not known."""
        self.thread = threading.Thread(target=self._run, name="ray_ddp-tracking", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------- the training thread
    def put(self, *items: Item) -> None:
        """Queue ``items`` (too many step points waiting: every other step thinned out);
        returns at once."""
        with self.lock:
            self.items.extend(items)
            self.points += sum(item[0] == POINT for item in items)
            self._keep_within_capacity()

    def flush(self) -> None:
        """Send what is queued now rather than at the next interval (does not wait)."""
        self.wake.set()

    def drain(self, timeout_s: float) -> bool:
        """Send what is queued now and wait until it went, for at most ``timeout_s`` (not
        at all while the server is failing); whether it went."""
        self.wake.set()
        end = time.monotonic() + timeout_s
        while self._waiting() and not self.failing and time.monotonic() < end:
            time.sleep(0.02)
        return not self._waiting()

    def close(self, timeout_s: float = 30.0) -> bool:
        """Send what is left, for at most ``timeout_s`` (one try where the server is
        failing already); whether everything put reached the tracker."""
        self.deadline = time.monotonic() + timeout_s
        self.stop.set()
        self.wake.set()
        self.thread.join(timeout=timeout_s + 1.0)
        with self.lock:
            self.unsent = counted(self.items)
            self.items.clear()
            self.points = 0
            if self.thread.is_alive():  # still inside deliver: its batch's fate unknown
                self.unconfirmed = counted(self.flight)
        return self.dropped == 0

    # ------------------------------------------------------------- what reached it
    @property
    def sent(self) -> int:
        return sum(self.delivered.values())

    @property
    def dropped(self) -> int:
        """Items put that did not (or may not have) reached the tracker."""
        lost = self.rejected + self.unsent + self.unconfirmed
        return self.thinned + sum(lost.values())

    def line(self) -> str:
        """One line: everything arrived, or exactly what did not (after ``close``)."""
        has = _listed(self.delivered) or "nothing"
        if not self.dropped:
            return f"{self.what}: everything reached the tracker ({has})"
        lost = [
            f"{_listed(counts)} {why}"
            for counts, why in (
                (Counter({POINT: self.thinned}), "thinned out while the tracker lagged behind "
                 "(every other step waiting, the newest kept)"),
                (self.rejected, "rejected as invalid"),
                (self.unsent, "still unsent when the run ended"),
                (self.unconfirmed, "being sent when the run ended (not confirmed)"),
            )
            if sum(counts.values())
        ]  # fmt: skip
        return f"{self.what}: not everything reached the tracker: {'; '.join(lost)}; it has {has}"

    def report(self) -> dict[str, Any]:
        """What was sent and what was not, by kind (for the run's summary)."""
        return {"sent": self.sent, "dropped": self.dropped, "delivered": dict(self.delivered),
                "thinned_points": self.thinned, "rejected": dict(self.rejected),
                "unsent": dict(self.unsent), "unconfirmed": dict(self.unconfirmed)}  # fmt: skip

    # ------------------------------------------------------------- the sending thread
    def _waiting(self) -> bool:
        return bool(self.items or self.flight)

    def _keep_within_capacity(self) -> None:
        """Under the lock: thin the waiting step points where too many wait."""
        if self.points > self.capacity:
            self.items, dropped = thin(self.items)
            self.thinned += dropped
            self.points -= dropped

    def _run(self) -> None:
        while True:
            self.wake.wait(self.interval_s)
            self.wake.clear()
            stopping = self.stop.is_set()
            with self.lock:
                batch = self.flight = list(self.items)
                self.items.clear()
                self.points = 0
            went = not batch or self._send(batch)
            with self.lock:
                if not went:  # back at the head: older than what came in meanwhile
                    self.items.extendleft(reversed(batch))
                    self.points += sum(item[0] == POINT for item in batch)
                    self._keep_within_capacity()
                self.flight = []
            # Closing: once more where the server is failing (it was tried), else until
            # the deadline.
            if stopping and (not self.items or self.failing or time.monotonic() >= self.deadline):
                return

    def _send(self, batch: list[Item]) -> bool:
        """Deliver ``batch``, retrying with backoff (once while the server is failing);
        whether it left the queue (sent, or rejected as invalid)."""
        delays = () if self.failing else self.backoff_s
        error: BaseException | None = None
        for delay in (0.0, *delays):
            wait = min(delay, self.deadline - time.monotonic())
            if delay and (wait <= 0 or self._stopped_in(wait)):
                break
            try:
                self.deliver(batch)
            except Rejected as exc:
                self._say(f"rejected {len(batch)} items ({exc}); they are dropped")
                self.rejected += counted(batch)
                return True
            except Exception as exc:  # noqa: BLE001 - a tracker's failure never stops training
                error = exc
                continue
            self.delivered += counted(batch)
            self.failing = False
            return True
        self.failing = True
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        self._say(
            f"failed ({type(error).__name__}: {first_line[:200]}); training goes on, and "
            "what is not sent is tried again until the run ends"
        )
        return False

    def _stopped_in(self, seconds: float) -> bool:
        """Wait ``seconds``, or less once closing has passed its deadline."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self.stop.is_set() and time.monotonic() >= self.deadline:
                return True
            time.sleep(min(left, 0.05))
        return False

    def _say(self, text: str) -> None:
        if not self.warned:
            self.warned = True
            self.warn(f"warning: {self.what} {text}")
