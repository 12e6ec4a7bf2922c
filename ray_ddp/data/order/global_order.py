"""The order an epoch trains its samples in, the same whatever the world size.

This is what makes a run exact across a change in the number of workers (a lost node, a
grown group, a resume on fewer GPUs). The unit is the optimizer step, not the worker:

- each epoch is one keyed permutation of the whole training set (``permutation``, keyed by
  ``(seed, epoch)``), the same on every rank and at every world size, each position's
  sample computed when read: a plan, and a new position, cost O(1), and a rank holds its
  micro-batches one block at a time (:class:`RankSlots`), a billion samples or a thousand;
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

No Ray, no DataLoader and (but for the first order version's ``torch.randperm``) no torch here:
:class:`GlobalOrderBatches` is the batch sampler a DataLoader draws from, and the training
loop reads the same :class:`Slot` list to weigh each micro-batch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ray_ddp.config.batch import accumulation
from ray_ddp.data.order.permutation import KeyedPermutation, PositionOrder
from ray_ddp.data.order.streaming import STREAMED_VERSION, StreamedOrder, streaming_order

RANDPERM_VERSION = 1
"""The first order: ``torch.randperm(size)`` seeded by ``seed + epoch``, held whole (O(N)
memory a rank, remade at every position). Checkpoints without an order version have it."""
ORDER_VERSION = 2
"""Today's order: ``permutation.KeyedPermutation`` of ``(seed, epoch)``, each position
computed when read (O(1) memory). A streamed split's order (``streaming``) was the same in
versions 1 and 2, and is ``streaming.STREAMED_VERSION`` (3) today: its plans default to it."""


def today_version(streamed: bool) -> int:
    """The order version a new epoch takes: a streamed split's or a split read by index's."""
    return STREAMED_VERSION if streamed else ORDER_VERSION


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
    version: int | None = None
    """How the order is made (:func:`today_version` where None): a checkpoint taken inside
    an epoch of an older version finishes that epoch in it (``worker.resume.continue_epoch``)."""

    def __post_init__(self) -> None:
        if self.version is None:
            object.__setattr__(self, "version", today_version(self.pieces is not None))

    @property
    def micro_per_step(self) -> int:
        return self.global_batch // self.batch_size

    @property
    def micro_batches(self) -> int:
        """Micro-batches from ``start`` to the epoch's end (:func:`micro_batch_count`)."""
        return micro_batch_count(self.size - self.start, self.batch_size)

    def bounds(self) -> Bounds:
        """Each micro-batch's [begin, end) in the epoch's order, from ``start`` on
        (:func:`micro_batch_count`'s rule), computed when asked."""
        return Bounds(self)

    @property
    def first_step(self) -> int:
        """The number (0-based, counted from the epoch's start) of the plan's first step."""
        return self.start // self.global_batch

    @property
    def steps(self) -> int:
        """Optimizer steps from ``start`` to the epoch's end."""
        return -(-self.micro_batches // self.micro_per_step)

    def step_start(self, step: int) -> int:
        """The position (samples of the order) where step ``step`` (counted from
        ``start``) begins; the epoch's size past its last step."""
        first = step * self.micro_per_step
        return self.start + first * self.batch_size if first < self.micro_batches else self.size

    def order(self) -> Sequence[int]:
        """The epoch's order: ``order()[position]`` is the sample trained there."""
        return self._order

    @functools.cached_property
    def _order(self) -> Sequence[int]:
        if self.pieces is not None:
            made = StreamedOrder if self.version == STREAMED_VERSION else streaming_order
            return made(
                self.pieces, self.buffer, self.seed, self.epoch, self.micro_per_step,
                self.batch_size,
            )  # fmt: skip
        if self.version == RANDPERM_VERSION:
            import torch  # here: the config checks import this module, and not torch

            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            return torch.randperm(self.size, generator=generator).tolist()
        return KeyedPermutation(self.size, self.seed, self.epoch)

    def slots(self, rank: int, world_size: int, lockstep: bool = False) -> RankSlots:
        """What rank ``rank`` of ``world_size`` trains, step by step: micro-batches
        ``rank``, ``rank + world_size``, ... of each step (where ``world_size`` does not
        divide them, some ranks train one more), or a filler where a short last step
        leaves it none. ``lockstep`` (FSDP2): a rank with fewer than the step's most
        trains fillers after its own, so that every rank runs as many passes. Computed
        slot by slot as they are read (:class:`RankSlots`)."""
        accumulation(self.global_batch, self.batch_size, world_size)  # refuses too many ranks
        return RankSlots(self, rank, world_size, lockstep)


class _Computed(Sequence[Any]):
    """A sequence whose items are computed when read, equal to any sequence (a list) of
    the same items."""

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)[:4]}... of {len(self)})"


class Bounds(_Computed):
    """An :class:`EpochPlan`'s micro-batches as (begin, end) positions in its order."""

    def __init__(self, plan: EpochPlan) -> None:
        self.plan, self.length = plan, plan.micro_batches

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return [self[k] for k in range(self.length)[key]]
        k = range(self.length)[key]  # negative numbers and IndexError as a list's
        begin = self.plan.start + k * self.plan.batch_size
        return (begin, self.plan.size if k == self.length - 1 else begin + self.plan.batch_size)


_BLOCK = 8192
"""Samples of the order computed at once while a rank's slots are iterated (a whole
permutation call costs as much as a few thousand of its positions)."""


class RankSlots(_Computed):
    """One rank's :class:`Slot` list of an :class:`EpochPlan` (see ``EpochPlan.slots``),
    each slot computed when read: O(1) to make, O(batch) to hold. Every step but the last
    gives a rank the same number of slots (its *turns*), so slot ``i`` is turn
    ``i % turns`` of step ``i // turns``."""

    def __init__(self, plan: EpochPlan, rank: int, world_size: int, lockstep: bool) -> None:
        self.plan, self.rank, self.world_size, self.lockstep = plan, rank, world_size, lockstep
        self.micro_batches, self.per_step = plan.micro_batches, plan.micro_per_step
        self.steps = steps = plan.steps
        self.last_micro = self.micro_batches - (steps - 1) * self.per_step  # the last step's
        self.full, self.last_turns = self.turns(self.per_step), self.turns(self.last_micro)
        self.length = (steps - 1) * self.full + self.last_turns if steps else 0

    def turns(self, micro: int) -> int:
        """Slots this rank trains in a step of ``micro`` micro-batches: its own (``rank``,
        ``rank + world_size``, ...), else one filler; in lockstep, the step's most."""
        mine = len(range(self.rank, micro, self.world_size))
        return max(mine, -(-micro // self.world_size) if self.lockstep else 1)

    def __len__(self) -> int:
        return self.length

    def _slots(self, numbers: range) -> list[Slot]:
        """Slots ``numbers`` (consecutive), computed as arrays and their indices taken
        from the order at once."""
        import numpy as np  # here: the config checks import this module, and not numpy

        if not numbers:
            return []
        steps, per_step, world = self.steps, self.per_step, self.world_size
        i = np.arange(numbers.start, numbers.stop, dtype=np.int64)
        step = np.minimum(i // self.full, steps - 1)
        last = step == steps - 1
        turn, first = i - step * self.full, step * per_step
        micro = np.where(last, self.last_micro, per_step)
        mine = np.maximum(0, -(-(micro - self.rank) // world))  # len(range(rank, micro, world))
        # A filler's number is past the step's last micro-batch (its dropout seed).
        number = np.where(turn < mine, self.rank + turn * world, micro + turn - mine)
        filler = number >= micro
        samples = self._end(first + micro - 1) - self._begin(first)
        boundary = turn == np.where(last, self.last_turns, self.full) - 1
        k = first + np.where(filler, 0, number)
        taken = _take(self.plan.order(), self._begin(k), self._end(k))
        rest = zip(
            step.tolist(), number.tolist(), boundary.tolist(), samples.tolist(),
            filler.tolist(), strict=True,
        )  # fmt: skip
        return [Slot(indices, *r) for r, indices in zip(rest, taken, strict=True)]

    def _begin(self, k: Any) -> Any:
        return self.plan.start + k * self.plan.batch_size

    def _end(self, k: Any) -> Any:
        """Micro-batch ``k``'s end: the next one's start, the epoch's size for the last
        (``k`` an array of numbers)."""
        import numpy as np

        return np.where(k == self.micro_batches - 1, self.plan.size, self._begin(k + 1))

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return self._slots(range(self.length)[key])
        return self._slots(range(self.length)[key : key + 1 or None])[0]

    def __iter__(self) -> Iterator[Slot]:
        per_block = max(1, _BLOCK // self.plan.batch_size)  # slots of ~_BLOCK samples
        for begin in range(0, self.length, per_block):
            yield from self._slots(range(begin, min(begin + per_block, self.length)))


def _take(order: Sequence[int], begins: Any, ends: Any) -> list[list[int]]:
    """``[order[begin:end] for begin, end in zip(begins, ends)]`` (arrays of positions),
    an order computed by position (``permutation.PositionOrder``) in one call."""
    import numpy as np

    if not isinstance(order, PositionOrder):
        return [list(order[b:e]) for b, e in zip(begins.tolist(), ends.tolist(), strict=True)]
    lengths = ends - begins
    cuts = np.cumsum(lengths)
    # Every position of every span, in order: a running count shifted to each span's begin.
    shift = np.repeat(begins - cuts + lengths, lengths)
    positions = np.arange(int(cuts[-1]), dtype=np.int64) + shift
    values = order.at(positions).tolist()
    return [values[a:b] for a, b in zip([0, *cuts[:-1].tolist()], cuts.tolist(), strict=True)]


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
    older: tuple[int, int] | None = None
    """``(epoch, version)``: an epoch that a checkpoint of an older order version stopped
    inside, finished in that version's order (:meth:`finish_in`)."""

    def finish_in(self, epoch: int, version: int) -> None:
        """Epoch ``epoch`` is trained in order version ``version`` (the later ones in
        today's): a checkpoint's position counts in the order it was taken in."""
        self.older = (epoch, version)

    def set_position(self, epoch: int, start: int) -> None:
        """The coming pass is epoch ``epoch`` from sample ``start`` of its order: O(1)."""
        today = today_version(self.pieces is not None)
        version = self.older[1] if self.older and self.older[0] == epoch else today
        self.plan = EpochPlan(
            self.size, self.batch_size, self.global_batch, self.seed, epoch, start,
            self.pieces, self.buffer, version,
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
