"""Where a run's seconds go: time stamps of its stages, from the driver and every worker.

Off unless ``RAY_DDP_TIMELINE`` names a file; then each stage appends one JSON line
``{"t": unix time, "stage": ..., "who": "driver" | "rank N", "pid": ...}`` to it.
``benchmarks/startup.py`` sets it, adds the Ray processes it sees start, and prints the
timeline. A local Ray's workers inherit the driver's environment, so one variable reaches
them all; on a cluster they would need it set on their nodes too.
"""

from __future__ import annotations

import json
import os
import time

ENV = "RAY_DDP_TIMELINE"
TEST_STARTED = "test started"
"""A test suite's mark of each of its tests (``who``: the test's id), by which
``benchmarks/suite_timeline.py`` tells which test started each worker group."""


def mark(stage: str, who: str = "driver") -> None:
    """Note that ``stage`` ended now (a no-op unless ``RAY_DDP_TIMELINE`` is set)."""
    path = os.environ.get(ENV)
    if not path:
        return
    line = json.dumps({"t": time.time(), "stage": stage, "who": who, "pid": os.getpid()})
    # One short append per line: lines from several processes do not interleave.
    with open(path, "a") as file:
        file.write(line + "\n")


def read(path: str) -> list[dict]:
    """The marks in ``path``, oldest first."""
    with open(path) as file:
        marks = [json.loads(line) for line in file if line.strip()]
    return sorted(marks, key=lambda m: m["t"])
