"""The epoch's unreadable samples over every rank: gathered at each mid-epoch checkpoint
and at the epoch's end, named in the run's ``bad_samples.csv`` by rank 0, and the run
stopped once the epoch is over ``--max-bad-samples`` (``ray_ddp.data.unreadable`` skips
and records them on each rank)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ray_ddp.data.unreadable import (
    BAD_SAMPLES_CSV,
    SHOWN,
    BadSample,
    BadSamplesError,
    SkipLog,
    append_rows,
    count_text,
    rewind_rows,
    stop_line,
)
from ray_ddp.io.storage import join
from ray_ddp.worker.collectives import all_gather


@dataclass(frozen=True)
class EpochSkips:
    """The epoch's unreadable samples, all ranks: what the epoch line and metrics show."""

    train: int
    val: int
    written: int = 0
    """Rows rank 0 appended to ``bad_samples.csv`` in this call (0 on the other ranks)."""

    @property
    def total(self) -> int:
        return self.train + self.val


def settle(
    run_dir: str,
    log: SkipLog,
    is_main: bool,
    val: Sequence[tuple[int, BadSample]] = (),
) -> EpochSkips:
    """A collective (every rank calls it, at a mid-epoch checkpoint and at the epoch's
    end): gathers the training records not yet gathered, rank 0 appends them and ``val``
    (evaluation's, already gathered: (rank, record)) to ``<run>/bad_samples.csv``; every
    rank raises BadSamplesError when the epoch is over ``log.cap``."""
    parts = all_gather(log.rows[log.gathered :])
    log.gathered = len(log.rows)
    new = [(rank, record) for rank, part in enumerate(parts) for record in part]
    log.total += len(new)
    log.first += new[: max(0, SHOWN - len(log.first))]
    rows = [("train", r, b) for r, b in new] + [("val", r, b) for r, b in val]
    if is_main and rows:
        append_rows(run_dir, log.epoch + 1, rows)
    counts = EpochSkips(log.total, len(val), len(rows) if is_main else 0)
    if log.cap is not None and counts.total > log.cap:
        named = (log.first + list(val))[:SHOWN]
        head = f"{count_text(counts.total)} in epoch {log.epoch + 1}"
        where = join(run_dir, BAD_SAMPLES_CSV)
        raise BadSamplesError(stop_line(head, log.cap, named, counts.total, csv=where))
    return counts


def rewind(run_dir: str, restored: Any, log: Callable[[str], None]) -> int:
    """Rank 0, as an attempt starts: ``bad_samples.csv`` back to the rows written when its
    restore point was saved (the rows after it name samples the attempt reads again, and
    would name twice); no rows before this run's first checkpoint. Returns the rows kept.
    (``restored``: ``resume.Restored`` or None.)"""
    keep: int | None = 0
    if restored is not None and restored.own:
        keep = restored.state["progress"].get("bad_sample_rows")  # None: an older checkpoint
    kept, dropped = rewind_rows(run_dir, keep)
    if dropped:
        log(
            f"{join(run_dir, BAD_SAMPLES_CSV)}: {dropped} rows written after the restore point "
            "dropped (their samples are read again)"
        )
    return kept
