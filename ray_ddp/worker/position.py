"""Where a run stands: one :class:`Position`, owned by the run and advanced in one place.

Every part reads it (the batches start the epoch there, the checkpointer saves it, the
reports and hooks name it); only the iterator of an epoch's steps (``worker.micro``)
advances it, once per optimizer step of the global order, and once at the epoch's end. A
user's loop can call ``optimizer.step`` as often as it likes (a GAN's two updates per
step): the position counts the steps of the data order, not the optimizers' steps. No Ray,
no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Position:
    """Epoch ``epoch`` (0-based; epochs done), ``step`` optimizer steps of the data order
    taken over the run, ``sample`` samples of the epoch's global order trained (a step
    boundary; 0 at an epoch's start). The same numbers at any world size
    (``data.order.global_order``): a run resumed on another number of workers continues
    at exactly this sample."""

    epoch: int = 0
    step: int = 0
    sample: int = 0

    def advance(self, sample: int) -> None:
        """One optimizer step done; the epoch's order continues at ``sample``."""
        self.step += 1
        self.sample = sample

    def end_epoch(self) -> None:
        """Every sample of the epoch trained: the next epoch starts at its first."""
        self.epoch += 1
        self.sample = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> Position:
        """From a checkpoint's ``progress`` (its other fields left out)."""
        return cls(int(saved["epoch"]), int(saved["step"]), int(saved.get("sample", 0)))
