"""Evaluation shards: every sample of a split on exactly one rank, so sums added over the
ranks equal one process's (``ray_ddp.worker.evaluate``). ``DistributedSampler`` pads the
split with repeated samples so every rank gets the same count, which counts them twice.

- :class:`ShardSampler`: a split read by index, rank ``r`` takes ``r, r + W, ...``;
- :class:`StreamedShard`: a streamed Parquet split (``ray_ddp.data.parquet_stream``), a
  contiguous block of rows per rank, read once, in file order (the metric sums are the
  same as any other exact split of the rows gives).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Sampler

from ray_ddp.data.parquet_stream import FetchedRow, StreamingParquet

EVAL_READ_ROWS = 256
"""Rows an evaluation stream asks for at a time (it reads whole row groups regardless)."""


class ShardSampler(Sampler[int]):
    """Indices rank, rank + world_size, ...: every sample on exactly one rank, in order."""

    def __init__(self, size: int, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.size, self.rank, self.world_size = size, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.size, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world_size))

    def global_index(self, position: int) -> int:
        """The dataset index of this rank's ``position``-th sample."""
        return self.rank + position * self.world_size


class StreamedShard(Sampler[FetchedRow]):
    """Rows ``[rank * size // world_size, (rank + 1) * size // world_size)``, read in
    order; ``global_index`` maps a position back to the row number, as
    ``ShardSampler`` (above) does."""

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
