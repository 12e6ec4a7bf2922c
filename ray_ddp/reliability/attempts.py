"""The run's attempts, numbered: rank 0 adds a row to ``<run>/attempts.csv`` as soon as the
workers start (the first start, a restart after a failure, a resize, a re-run of the
name), before anything that can fail, so that what an attempt leaves behind
(``<run>/hangs/attempt-<N>/``) is found by its number and is never taken for a later
attempt's, and a user sees when the run restarted, on how many workers and from which
checkpoint."""

from __future__ import annotations

import csv
import io
import time

from ray_ddp.io.storage import join, read_text, write_bytes

ATTEMPTS_CSV = "attempts.csv"
HEADER = "attempt,started,world_size,checkpoint\n"


def record_attempt(run_dir: str, world_size: int, checkpoint: str) -> int:
    """Add this attempt's row (rank 0 only; ``checkpoint``: the name of the one Ray resumes
    it from, or empty); returns its number, 1 for the first."""
    path = join(run_dir, ATTEMPTS_CSV)
    text = read_text(path) or HEADER
    number = len(attempts_in(text)) + 1
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    write_bytes(path, f"{text}{number},{started},{world_size},{checkpoint}\n".encode())
    return number


def last_attempt(run_dir: str) -> dict[str, str] | None:
    """The latest attempt's row (``attempt``, ``started``, ``world_size``, ``checkpoint``)."""
    text = read_text(join(run_dir, ATTEMPTS_CSV))
    rows = attempts_in(text) if text else []
    return rows[-1] if rows else None


def attempts_in(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))
