"""Delivery off the training thread: a queue the training loop puts into without ever
waiting, and a background thread that sends what has gathered as one batch every
interval, retrying with backoff.

A batch that still fails after its retries is kept (up to ``capacity`` items, the oldest
dropped beyond it) and tried again once each interval, so a server that comes back gets
the history it missed; the first such failure is said in one line, and nothing more is
said however long the server stays away. What the sink rejects as invalid
(:class:`Rejected`) is dropped at once. ``close`` gives the backlog until its deadline,
then gives up: the run finishes whatever the server does. No Ray, no torch, no tracker.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

Item = tuple[Any, ...]
"""``("metric", key, value, step, ms)``, ``("param", key, value)``, ``("tag", key, value)``."""


class Rejected(Exception):
    """The tracker refused a batch as invalid: sending it again cannot help."""


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
        self.lock = threading.Lock()
        self.wake, self.stop = threading.Event(), threading.Event()
        self.deadline = float("inf")
        self.failing = False
        self.warned = False
        self.sent = self.dropped = 0
        self.thread = threading.Thread(target=self._run, name="ray_ddp-tracking", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------- the training thread
    def put(self, *items: Item) -> None:
        """Queue ``items`` (a full queue drops its oldest); returns at once."""
        with self.lock:
            self.items.extend(items)
            while len(self.items) > self.capacity:
                self.items.popleft()
                self.dropped += 1

    def flush(self) -> None:
        """Send what is queued now rather than at the next interval (does not wait)."""
        self.wake.set()

    def drain(self, timeout_s: float) -> bool:
        """Send what is queued now and wait until it went, for at most ``timeout_s`` (not
        at all while the server is failing); whether it went."""
        self.wake.set()
        end = time.monotonic() + timeout_s
        while self.items and not self.failing and time.monotonic() < end:
            time.sleep(0.02)
        return not self.items

    def close(self, timeout_s: float = 30.0) -> bool:
        """Send what is left, for at most ``timeout_s`` (one try where the server is
        failing already); whether everything went."""
        self.deadline = time.monotonic() + timeout_s
        self.stop.set()
        self.wake.set()
        self.thread.join(timeout=timeout_s + 1.0)
        with self.lock:
            left = len(self.items)
        self.dropped += left
        return left == 0 and not self.thread.is_alive()

    # ------------------------------------------------------------- the sending thread
    def _run(self) -> None:
        while True:
            self.wake.wait(self.interval_s)
            self.wake.clear()
            stopping = self.stop.is_set()
            with self.lock:
                batch = list(self.items)
            if batch and self._send(batch):
                with self.lock:  # what came in meanwhile stays
                    for _ in batch:
                        self.items.popleft()
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
                self.dropped += len(batch)
                return True
            except Exception as exc:  # noqa: BLE001 - a tracker's failure never stops training
                error = exc
                continue
            self.sent += len(batch)
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
