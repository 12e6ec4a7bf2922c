"""One rank's micro-batches of a streamed Parquet split (``ray_ddp.data.parquet_stream``):
the ``global_order`` batch sampler with the streamed order (``streaming``), which reads the
rows it hands out, so a DataLoader's worker processes receive each row's bytes with its
number and only decode. Every rank reads only the row groups of its own micro-batches."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ray_ddp.data.order.global_order import GlobalOrderBatches
from ray_ddp.data.parquet_stream import StreamingParquet


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
