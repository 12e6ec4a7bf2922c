"""What tests wait on: a process that should go (:func:`gone`), and time a test places
instead of waiting for it (:class:`Clock`, for code that takes its clock and sleep)."""

from __future__ import annotations

import time

from ray_ddp.cluster.connect import _process


def gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process ``pid`` has gone (or is a zombie) within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while _process(pid) != () and time.monotonic() < deadline:
        time.sleep(0.05)
    return _process(pid) == ()


class Clock:
    """Time the test places: the code under test reads it (``clock=``), and its waits move
    it on (``sleep=``): nothing sleeps, and no other process's share of the CPU changes
    what the code decides."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
