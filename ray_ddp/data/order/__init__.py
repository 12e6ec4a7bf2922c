"""The order an epoch trains its samples in, for one rank: one interface
(:class:`EpochOrder`), three implementations.

- ``global_order.GlobalOrderBatches``: a split read by index (in memory, files); one
  seeded permutation per epoch, the same at any world size, resumable at any step;
- ``streamed_batches.StreamedBatches``: a streamed Parquet split, in the two-level shuffle
  of ``streaming`` (row groups, then a buffer), with the same promises;
- ``ray_ddp.data.ray_data.worker.StreamOrder``: Ray Data's stream (equal shares, shuffled
  but not reproducible; an epoch restarts on resume).

``shards`` holds the evaluation side: every sample of a split on exactly one rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sized
from typing import Any, Protocol


class Slots(Sized, Iterable[Any], Protocol):
    """A rank's micro-batches of an epoch (``global_order.Slot``), in training order."""


class EpochOrder(Protocol):
    """What the training step reads an epoch's order through (``ray_ddp.worker.step``)."""

    plan: Any
    """The epoch's plan from the position set: ``epoch``, ``size`` (samples), ``start``,
    ``first_step``, ``steps`` and ``step_start(step)`` (``global_order.EpochPlan``)."""
    slots: Slots

    def set_position(self, epoch: int, start: int) -> None:
        """The coming pass is epoch ``epoch`` from sample ``start`` of its order."""

    def describe(self) -> str | None:
        """A line for the log on how it reads its data, or None."""

    def take_unreadable(self) -> list[Any]:
        """Records of rows that could not be read outside the loader since the last call
        (rank 0's; empty where the loader's collate names them)."""
