"""The order an epoch trains its samples in, the same whatever the world size.

This is what makes a run exact across a change in the number of workers (a lost node, a
grown group, a resume on fewer GPUs). The unit is the optimizer step, not the worker:

- each epoch is one seeded permutation of the whole training set (``seed + epoch``, as
  DistributedSampler seeds it), the same on every rank and at every world size;
- the permutation is cut into micro-batches of ``--batch-size`` consecutive samples (a
  last micro-batch of one sample joins the one before it: BatchNorm cannot train on one);
- every ``global_batch / batch_size`` consecutive micro-batches make one optimizer step,
  whatever the world size: at ``W`` workers rank ``r`` trains micro-batches ``r, r + W,
  ...`` of it (its accumulation; where ``W`` does not divide them some ranks train one
  more, and the others wait for them in the all-reduce);
- a position in the epoch is a number of samples of the permutation (a step boundary), so
  any world size resumes from exactly there, every remaining sample once.

The step's gradient is the mean over its samples however they are spread: each micro-batch
weighs by its share of the step's samples. The epoch's last step may hold fewer
micro-batches than there are ranks; a rank left without one trains a *filler* (the
step's first micro-batch again) with weight 0, because every rank must take part in the
gradient all-reduce. Ranks training different numbers of micro-batches in a step is safe
for DDP: each still runs exactly one synchronised backward per step (the others are under
``no_sync``), and DDP broadcasts buffers once per step, at a rank's first forward after a
synchronised one. It is not for FSDP2, whose every forward and backward all-gathers the
parameters (a collective, ``no_sync`` or not): there (``lockstep``) a rank short of
micro-batches in a step trains fillers up to the step's most, so every rank runs the same
number of forward and backward passes. Micro-batch contents do not depend on the world
size either, so BatchNorm's batch statistics in training do not; its running statistics
(buffers, not weights) follow the micro-batches rank 0 sees, which do.

No Ray, no DataLoader and (but for the permutation) no torch here:
:class:`GlobalOrderBatches` is the batch sampler a DataLoader draws from, and the training
loop reads the same :class:`Slot` list to weigh each micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ray_ddp.config.batch import accumulation


def micro_batch_count(samples: int, batch_size: int) -> int:
    """The micro-batches ``samples`` consecutive samples are cut into, the one rule of
    every engine: ``batch_size`` each, and a last one of a single sample joins the one
    before it (BatchNorm cannot train on one sample), at ``--batch-size 1`` too, where
    every micro-batch is one sample; a lone sample stays one."""
    count = -(-samples // batch_size)
    if count > 1 and samples - (count - 1) * batch_size == 1:
        count -= 1
    return count


@dataclass(frozen=True)
class Slot:
    """One micro-batch a rank trains, in the order it trains them."""

    indices: list[int]
    """Dataset indices (a filler's are its step's first micro-batch's)."""
    step: int
    """The optimizer step of the epoch it belongs to (0-based from the epoch's start)."""
    micro: int
    """Its micro-batch number within the step (the same at any world size; a filler's is
    past the step's last)."""
    boundary: bool
    """This rank's last micro-batch of the step: its backward all-reduces the gradients."""
    step_samples: int
    """Samples of the whole step, all ranks together."""
    filler: bool = False
    """Trained with weight 0 (an empty slot of the epoch's last step)."""

    @property
    def size(self) -> int:
        """Samples it contributes (0 for a filler)."""
        return 0 if self.filler else len(self.indices)


@dataclass(frozen=True)
class EpochPlan:
    """Epoch ``epoch``'s micro-batches and steps from sample ``start`` of its order."""

    size: int
    """Training samples."""
    batch_size: int
    global_batch: int
    seed: int
    epoch: int
    start: int = 0
    pieces: tuple[int, ...] | None = None
    """A streamed split's row groups (their row counts, in the split's numbering): the
    order is then ``ray_ddp.data.order.streaming``'s two-level shuffle instead of a permutation."""
    buffer: int = 0
    """The streamed order's shuffle window, in rows (``--shuffle-buffer``)."""

    @property
    def micro_per_step(self) -> int:
        return self.global_batch // self.batch_size

    def bounds(self) -> list[tuple[int, int]]:
        """Each micro-batch's [begin, end) in the epoch's order, from ``start`` on
        (:func:`micro_batch_count`'s rule)."""
        count = micro_batch_count(self.size - self.start, self.batch_size)
        starts = [self.start + i * self.batch_size for i in range(count)]
        return list(zip(starts, [*starts[1:], self.size][: len(starts)], strict=True))

    @property
    def first_step(self) -> int:
        """The number (0-based, counted from the epoch's start) of the plan's first step."""
        return self.start // self.global_batch

    @property
    def steps(self) -> int:
        """Optimizer steps from ``start`` to the epoch's end."""
        return -(-len(self.bounds()) // self.micro_per_step)

    def step_start(self, step: int) -> int:
        """The position (samples of the order) where step ``step`` begins; the epoch's size
        past its last step."""
        bounds = self.bounds()
        first = step * self.micro_per_step
        return bounds[first][0] if first < len(bounds) else self.size

    def order(self) -> list[int]:
        if self.pieces is not None:
            from ray_ddp.data.order.streaming import streaming_order

            return streaming_order(
                self.pieces, self.buffer, self.seed, self.epoch, self.micro_per_step,
                self.batch_size,
            )  # fmt: skip
        import torch  # here: the config checks import this module, and not torch

        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def slots(self, rank: int, world_size: int, lockstep: bool = False) -> list[Slot]:
        """What rank ``rank`` of ``world_size`` trains, step by step: micro-batches
        ``rank``, ``rank + world_size``, ... of each step (where ``world_size`` does not
        divide them, some ranks train one more), or a filler where a short last step
        leaves it none. ``lockstep`` (FSDP2): a rank with fewer than the step's most
        trains fillers after its own, so that every rank runs as many passes."""
        accumulation(self.global_batch, self.batch_size, world_size)  # refuses too many ranks
        order, bounds, per_step = self.order(), self.bounds(), self.micro_per_step
        slots = []
        for step in range(self.steps):
            micro = bounds[step * per_step : (step + 1) * per_step]
            samples = micro[-1][1] - micro[0][0]
            mine = list(range(rank, len(micro), world_size))
            most = -(-len(micro) // world_size) if lockstep else 1
            # A filler's number is past the step's last micro-batch (its dropout seed).
            numbers = mine + list(range(len(micro), len(micro) + most - len(mine)))
            for turn, number in enumerate(numbers):
                filler = number >= len(micro)
                begin, end = micro[0] if filler else micro[number]
                slots.append(
                    Slot(
                        indices=order[begin:end],
                        step=step,
                        micro=number,
                        boundary=turn == len(numbers) - 1,
                        step_samples=samples,
                        filler=filler,
                    )
                )
        return slots


class GlobalOrderBatches:
    """A DataLoader ``batch_sampler`` yielding one rank's micro-batches of an
    :class:`EpochPlan`; ``tag_epoch`` makes each index ``(epoch, index)`` for seeded
    augmentation (``loaders.SeededSamples``)."""

    def __init__(
        self, size: int, *, batch_size: int, global_batch: int, seed: int, rank: int,
        world_size: int, tag_epoch: bool, lockstep: bool = False,
    ) -> None:  # fmt: skip
        self.size, self.batch_size, self.global_batch = size, batch_size, global_batch
        self.seed, self.rank, self.world_size, self.tag_epoch = seed, rank, world_size, tag_epoch
        self.lockstep = lockstep
        """Every rank the same number of micro-batches per step (FSDP2; ``EpochPlan.slots``)."""
        self.set_position(0, 0)

    pieces: tuple[int, ...] | None = None  # a streamed split's row groups (see EpochPlan)
    buffer = 0

    def set_position(self, epoch: int, start: int) -> None:
        """The coming pass is epoch ``epoch`` from sample ``start`` of its order."""
        self.plan = EpochPlan(
            self.size, self.batch_size, self.global_batch, self.seed, epoch, start,
            self.pieces, self.buffer,
        )  # fmt: skip
        self.slots = self.plan.slots(self.rank, self.world_size, self.lockstep)

    def describe(self) -> str | None:
        """A line for the log about how the order reads its data (none: read by index)."""
        return None

    def take_unreadable(self) -> list[Any]:
        """Rows an engine could not read outside the loader (none here: the loader's
        collate names them)."""
        return []

    def __iter__(self) -> Iterator[list[Any]]:
        epoch = self.plan.epoch
        for slot in self.slots:
            yield [(epoch, i) for i in slot.indices] if self.tag_epoch else list(slot.indices)

    def __len__(self) -> int:
        return len(self.slots)
