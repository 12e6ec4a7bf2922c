"""The epoch's unreadable samples over every rank: gathered at each mid-epoch checkpoint
and at the epoch's end, named in the run's ``bad_samples.csv`` by rank 0, and the run
stopped once the epoch is over ``--max-bad-samples`` (``ray_ddp.data.unreadable`` skips
and records them on each rank)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ray_ddp.data.unreadable import (
    BAD_SAMPLES_CSV,
    SHOWN,
    BadSample,
    BadSamplesError,
    SkipLog,
    append_rows,
    count_text,
    stop_line,
)
from ray_ddp.io.storage import join
from ray_ddp.worker.collectives import all_gather


@dataclass(frozen=True)
class EpochSkips:
    """The epoch's unreadable samples, all ranks: what the epoch line and metrics show."""

    train: int
    val: int

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
    counts = EpochSkips(log.total, len(val))
    if log.cap is not None and counts.total > log.cap:
        named = (log.first + list(val))[:SHOWN]
        head = f"{count_text(counts.total)} in epoch {log.epoch + 1}"
        where = join(run_dir, BAD_SAMPLES_CSV)
        raise BadSamplesError(stop_line(head, log.cap, named, counts.total, csv=where))
    return counts
