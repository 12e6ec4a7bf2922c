"""One rank's micro-batches of a streamed Parquet split (``ray_ddp.data.parquet_stream``):
the ``global_order`` batch sampler with the streamed order (``streaming``), which reads the
rows it hands out, so a DataLoader's worker processes receive each row's bytes with its
number and only decode. Every rank reads only the row groups of its own micro-batches,
planned a few steps ahead (``horizon``), never the whole pass."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ray_ddp.data.order.global_order import GlobalOrderBatches
from ray_ddp.data.parquet_stream import READ_AHEAD, StreamingParquet


class StreamedBatches(GlobalOrderBatches):
    """One rank's micro-batches of a streamed split, as lists of :class:`FetchedRow` (or
    ``(epoch, row)`` pairs with ``tag_epoch``, for seeded augmentation)."""

    def __init__(self, dataset: StreamingParquet, *, buffer: int, **kwargs: Any) -> None:
        self.dataset = dataset
        self.pieces, self.buffer = dataset.piece_sizes(), buffer
        super().__init__(len(dataset), **kwargs)

    @property
    def window(self) -> int:
        """The shuffle window in rows: the buffer rounded up to whole micro-batches."""
        return -(-self.buffer // self.batch_size) * self.batch_size

    @property
    def horizon(self) -> int:
        """Slots the row stream looks past the current one. In a lane a row group's rows
        lie in the windows its rows were cut into (a window's order moves rows only within
        it), so two uses of a group in a lane are less than two windows apart, and its use
        in the epoch's last step, the lanes' tails, at most a step or two after; this rank
        trains ``slots.full`` micro-batches a step. A group is then read once a pass, but
        one cut by a boundary between two lanes this rank trains (world size below the
        micro-batches per step): it is read at both lanes' turns, at the epoch's start and
        near its end, not held between."""
        return self.slots.full * (2 * self.window // self.batch_size + 4)

    def held_bound(self) -> int:
        """docs/data.md's bound on row groups held at once, ``(ceil(M / W) + 2) * (n + 2)
        + READ_AHEAD``, where ``n`` is the most whole row groups one window can hold (the
        smallest ones: ``floor(B / g)`` where every group has ``g`` rows)."""
        sizes = np.cumsum(np.sort(np.asarray(self.pieces, dtype=np.int64)))
        inner = int(np.searchsorted(sizes, self.window, side="right"))
        lanes = -(-self.plan.micro_per_step // self.world_size)
        return (lanes + 2) * (inner + 2) + READ_AHEAD

    def describe(self) -> str:
        """One line for the log: the split's files and groups, and the bound on row groups
        a worker holds at once (:meth:`held_bound`; rank 0's, the others' are alike)."""
        layout, pieces = self.dataset.layout, self.dataset.pieces
        held = min(self.held_bound(), len(pieces) + READ_AHEAD)
        largest = sorted((layout.group_bytes[(p.file, p.group)] for p in pieces), reverse=True)
        return (
            f"parquet: streamed from {len(layout.files)} file(s), {len(pieces)} row groups of "
            f"{len(self.dataset) // max(1, len(pieces))} rows on average; shuffle buffer "
            f"{self.buffer} rows; at most {held} row groups held per worker "
            f"(<= {sum(largest[:held]) / 2**20:.0f} MB uncompressed)"
        )

    def __iter__(self) -> Iterator[list[Any]]:
        epoch = self.plan.epoch
        stream = self.dataset.stream((slot.indices for slot in self.slots), self.horizon)
        for rows in stream:
            yield [(epoch, row) for row in rows] if self.tag_epoch else rows
