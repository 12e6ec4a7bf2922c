"""Samplers over a streamed Parquet split (``ray_ddp.data.parquet_stream``): they read the
rows they hand out, so a DataLoader's worker processes receive each row's bytes with its
number and only decode.

- :class:`StreamedBatches`: training, the ``ray_ddp.data.order.global_order`` batch sampler with the
  streamed order (``ray_ddp.data.order.streamed``); every rank reads only the row groups of its
  own micro-batches.
- :class:`StreamedShard`: evaluation, a contiguous block of rows per rank (every row on
  exactly one rank, read once, in file order); the metric sums are the same as any other
  exact split of the rows gives.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler

from ray_ddp.data.order.global_order import GlobalOrderBatches
from ray_ddp.data.parquet_stream import FetchedRow, StreamingParquet

EVAL_READ_ROWS = 256
"""Rows an evaluation stream asks for at a time (it reads whole row groups regardless)."""


class StreamedBatches(GlobalOrderBatches):
    """One rank's micro-batches of a streamed split, as lists of :class:`FetchedRow` (or
    ``(epoch, row)`` pairs with ``tag_epoch``, for seeded augmentation)."""

    def __init__(self, dataset: StreamingParquet, *, buffer: int, **kwargs: Any) -> None:
        self.dataset = dataset
        self.pieces, self.buffer = dataset.piece_sizes(), buffer
        super().__init__(len(dataset), **kwargs)

    def describe(self) -> str:
        """One line for the log: the split's files and groups, and this rank's bound on
        row groups held at once in the coming pass (rank 0's; others' are alike)."""
        layout, pieces = self.dataset.layout, self.dataset.pieces
        held = self.dataset.stream([slot.indices for slot in self.slots]).capacity
        largest = sorted((layout.group_bytes[(p.file, p.group)] for p in pieces), reverse=True)
        return (
            f"parquet: streamed from {len(layout.files)} file(s), {len(pieces)} row groups of "
            f"{len(self.dataset) // max(1, len(pieces))} rows on average; shuffle buffer "
            f"{self.buffer} rows; at most {held} row groups held per worker "
            f"(<= {sum(largest[:held]) / 2**20:.0f} MB uncompressed)"
        )

    def __iter__(self) -> Iterator[list[Any]]:
        epoch = self.plan.epoch
        stream = self.dataset.stream([slot.indices for slot in self.slots])
        for rows in stream:
            yield [(epoch, row) for row in rows] if self.tag_epoch else rows


class StreamedShard(Sampler[FetchedRow]):
    """Rows ``[rank * size // world_size, (rank + 1) * size // world_size)``, read in
    order; ``global_index`` maps a position back to the row number, as
    ``sharded_eval.ShardSampler``'s does."""

    def __init__(self, dataset: StreamingParquet, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.dataset = dataset
        self.begin = rank * len(dataset) // world_size
        self.end = (rank + 1) * len(dataset) // world_size

    def __iter__(self) -> Iterator[FetchedRow]:
        reads = [
            list(range(start, min(start + EVAL_READ_ROWS, self.end)))
            for start in range(self.begin, self.end, EVAL_READ_ROWS)
        ]
        for rows in self.dataset.stream(reads):
            yield from rows

    def __len__(self) -> int:
        return self.end - self.begin

    def global_index(self, position: int) -> int:
        return self.begin + position
