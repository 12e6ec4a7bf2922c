"""``--data-engine ray`` in a training worker: its shards of Ray Data's stream become an
epoch order (``StreamOrder``, a ``ray_ddp.data.order.EpochOrder``) whose slots are made
from the batches Ray delivers, a step at a time, and the loaders that yield them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any

import numpy as np

from ray_ddp.config.sections import Data, Optimisation
from ray_ddp.data.order.global_order import Slot, micro_batch_count
from ray_ddp.data.ray_data.decode import split_items, split_size, unreadable_actor

if TYPE_CHECKING:
    from ray_ddp.data.unreadable import BadSample


@dataclass(frozen=True)
class StreamSlot(Slot):
    """A micro-batch of Ray Data's stream: its rows are counted, not indexed."""

    rows: int = 0

    @property
    def size(self) -> int:
        return 0 if self.filler else self.rows


@dataclass(frozen=True)
class StreamPlan:
    """``global_order.EpochPlan``'s interface for a streamed epoch (always from its start)."""

    size: int
    """Training rows of the split (what the epoch's end position is)."""
    batch_size: int
    global_batch: int
    epoch: int
    steps: int
    """Optimizer steps expected (fewer where rows could not be read)."""
    start: int = 0
    first_step: int = 0

    def step_start(self, step: int) -> int:
        """A position for step ``step`` (the epoch's size past its last): a streamed epoch
        is only ever resumed from its start, so this only tells done from not done."""
        return self.size if step >= self.steps else min(self.size - 1, step * self.global_batch)


def expected_steps(size: int, world_size: int, batch_size: int, per_rank: int) -> int:
    """Optimizer steps of an epoch of ``size`` rows cut into equal shares, each into
    micro-batches by the in-memory order's rule (``global_order.micro_batch_count``: a last
    one of a single row joins the one before), ``per_rank`` a step."""
    return -(-micro_batch_count(size // world_size, batch_size) // per_rank)


class _Slots:
    """An epoch's slots, made as the stream delivers batches; ``len`` is the expected
    count (for the progress line's estimate)."""

    def __init__(self, order: StreamOrder, expected: int) -> None:
        self.order, self.expected = order, expected

    def __iter__(self) -> Iterator[StreamSlot]:
        return self.order._slots()

    def __len__(self) -> int:
        return self.expected


class StreamOrder:
    """``train_epoch``'s order over Ray Data's stream: the interface of
    ``global_order.GlobalOrderBatches``. Each step's batches are fetched before its first
    slot is handed out, so the slots carry the sizes Ray delivered: every rank receives the
    same rows (an equal split), hence the same batches and steps."""

    def __init__(
        self, shard: Any, *, size: int, batch_size: int, global_batch: int, seed: int,
        rank: int, world_size: int, shuffle_buffer: int, pin_memory: bool, take_bad: Any,
        waiting: Callable[[bool], None] = lambda first: None,
    ) -> None:  # fmt: skip
        self.waiting = waiting
        """Called before each step's batches are fetched (``True`` for the epoch's first,
        slow by nature: Ray Data starts): the worker tells its hang watchdog."""
        self.shard, self.size, self.batch_size = shard, size, batch_size
        self.global_batch, self.seed = global_batch, seed
        self.rank, self.world_size = rank, world_size
        self.shuffle_buffer, self.pin_memory, self.take_bad = shuffle_buffer, pin_memory, take_bad
        self.per_rank = global_batch // batch_size // world_size
        self.steps = expected_steps(size, world_size, batch_size, self.per_rank)
        self.ready: deque = deque()
        self.unreadable: list[BadSample] = []
        self.set_position(0, 0)

    def set_position(self, epoch: int, start: int) -> None:
        if start:
            raise ValueError("a Ray Data epoch starts from its first sample")
        self.plan = StreamPlan(self.size, self.batch_size, self.global_batch, epoch, self.steps)
        expected = expected_steps(self.size, self.world_size, self.batch_size, 1)
        self.slots = _Slots(self, expected)

    def describe(self) -> str:
        rows = self.size // self.world_size
        left = self.size - rows * self.world_size
        dropped = f"; {left} of the {self.size} left out each epoch, which varies" if left else ""
        return (
            f"data engine: Ray Data, {rows} rows per worker per epoch (equal shares{dropped}), "
            f"shuffled by row group or file and a {self.shuffle_buffer}-row buffer, not "
            "reproducibly; a resume restarts its epoch"
        )

    def take_unreadable(self) -> list[BadSample]:
        """The training rows the last pass could not read (rank 0; empty elsewhere)."""
        rows, self.unreadable = self.unreadable, []
        return rows

    def _batches(self) -> Iterator[tuple]:
        """This rank's batches of the epoch, as many as ``global_order.micro_batch_count``
        makes of the rows delivered (Ray Data's are full but the last: a last one of a
        single row joins the one before)."""
        import torch

        if self.take_bad is not None:
            self.take_bad("train")  # an earlier attempt's, not this pass's
        seed = _words(self.seed, self.plan.epoch, self.rank)
        stream = self.shard.iter_torch_batches(
            batch_size=self.batch_size,
            local_shuffle_buffer_size=max(self.shuffle_buffer, self.batch_size),
            local_shuffle_seed=seed,
            pin_memory=self.pin_memory,
        )
        held: list[tuple] = []
        rows = batches = 0
        for item in stream:
            held.append((item["input"], item["label"]))
            rows, batches = rows + len(item["label"]), batches + 1
            if len(held) == 3:
                yield held.pop(0)
        if len(held) == 2 and batches > micro_batch_count(rows, self.batch_size):
            (x1, y1), (x2, y2) = held
            held = [(torch.cat([x1, x2]), torch.cat([y1, y2]))]
        yield from held
        if self.take_bad is not None:
            self.unreadable += self.take_bad("train")

    def _slots(self) -> Iterator[StreamSlot]:
        self.ready.clear()
        batches = self._batches()
        step = 0
        while True:
            # A step's batches are fetched before its first slot (the first: Ray Data starts).
            self.waiting(step == 0)
            group = list(islice(batches, self.per_rank))
            if not group:
                break
            sizes = [len(labels) for _, labels in group]
            total = sum(sizes) * self.world_size  # every rank's batches are the same sizes
            for turn, (batch, rows) in enumerate(zip(group, sizes, strict=True)):
                self.ready.append(batch)
                yield StreamSlot(
                    indices=[],
                    step=step,
                    micro=turn * self.world_size + self.rank,
                    boundary=turn == len(group) - 1,
                    step_samples=total,
                    rows=rows,
                )
            step += 1


class TrainBatches:
    """The training loader: the batches of the slots ``order`` hands out, in turn."""

    def __init__(self, order: StreamOrder) -> None:
        self.order = order

    def __iter__(self) -> Iterator[tuple[Any, ...] | None]:
        ready = self.order.ready
        while True:
            yield ready.popleft() if ready else None


class EvalBatches:
    """The evaluation loader: this rank's share of the validation split; rank 0 adds the
    rows the pass could not read (as ``bad_samples`` records, which ``evaluate`` counts)."""

    def __init__(self, shard: Any, batch_size: int, pin_memory: bool, take_bad: Any) -> None:
        self.shard, self.batch_size, self.pin_memory = shard, batch_size, pin_memory
        self.take_bad = take_bad

    def __iter__(self) -> Iterator[Any]:
        from ray_ddp.data.unreadable import BATCH, SKIPPED

        if self.take_bad is not None:
            self.take_bad("val")  # an earlier attempt's
        for item in self.shard.iter_torch_batches(
            batch_size=self.batch_size, pin_memory=self.pin_memory
        ):
            yield item["input"], item["label"]
        if self.take_bad is not None:
            bad = self.take_bad("val")
            if bad:
                yield {SKIPPED: bad, BATCH: None}


def _words(seed: int, epoch: int, rank: int) -> int:
    """The local shuffle's seed of (seed, epoch, rank)."""
    return int(np.random.SeedSequence(seed, spawn_key=(3, epoch, rank)).generate_state(1)[0])


def worker_data(
    data: Data, optim: Optimisation, global_batch: int, run_dir: str, worker: Any,
    waiting: Callable[[bool], None],
) -> dict[str, Any]:  # fmt: skip
    """``ray_ddp.worker.data.WorkerData``'s fields for this worker: its Ray Data shards
    (every worker calls this: getting a shard is a barrier) of the run's ``global_batch``
    (samples per optimizer step) and ``run_dir`` (where its unreadable rows are
    collected); ``waiting``: see :class:`StreamOrder`."""
    import ray.train

    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("val")
    sizes = [split_size(*split_items(data, split)) for split in ("train", "val")]
    take_bad = None
    if worker.is_main:
        actor = unreadable_actor(run_dir)
        take_bad = lambda split: ray.get(actor.take.remote(split))  # noqa: E731
    pin = bool(data.pin_memory) if data.pin_memory is not None else worker.device.type == "cuda"
    order = StreamOrder(
        train_shard,
        size=sizes[0],
        batch_size=optim.batch_size,
        global_batch=global_batch,
        seed=optim.seed,
        rank=worker.rank,
        world_size=worker.world_size,
        shuffle_buffer=data.shuffle_buffer,
        pin_memory=pin,
        take_bad=take_bad,
        waiting=waiting,
    )
    return {
        "train_loader": TrainBatches(order),
        "train_order": order,
        "val_loader": EvalBatches(val_shard, optim.batch_size * 2, pin, take_bad),
        "train_size": sizes[0],
        "val_size": sizes[1],
        "steps_per_epoch": order.steps,
        "accumulation": order.per_rank,
    }
