"""An own loop's batches: any map-style dataset in the global order
(``data.order.global_order``), as the optimizer steps of an epoch, each holding this
rank's micro-batches, from the run's position on.

What a micro-batch carries besides its data: the dataset indices of its samples (what the
seeded draws key on), how many samples it counts, its share of the step's samples (its
weight in a mean loss), whether it closes the step on this rank (its backward
all-reduces), and whether it is a filler (an empty slot of a short last step, trained with
weight 0 so that every rank joins the all-reduce). Before each micro-batch is handed out,
the run sets every model's gradient sync to whether it closes the step (nanoGPT's
``require_backward_grad_sync``) and seeds the step's randomness (``data.seeding``), so a
loop needs no ``no_sync`` block and a step's dropout does not depend on the split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import ray.train.torch
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ray_ddp.config.sections import Data, Optimisation, Scaling
from ray_ddp.data.loaders import SeededSamples
from ray_ddp.data.order.global_order import GlobalOrderBatches, Slot


@dataclass(frozen=True)
class Micro:
    """One micro-batch of a step, on this rank's device."""

    data: Any
    """What the dataset's samples collate to (tensors on the device)."""
    slot: Slot
    epoch: int
    step: int
    """The optimizer step it belongs to, counted over the run (1-based)."""

    @property
    def indices(self) -> list[int]:
        """Its samples' dataset indices (a filler's are its step's first micro-batch's)."""
        return self.slot.indices

    @property
    def samples(self) -> int:
        """Samples it counts (0 for a filler)."""
        return self.slot.size

    @property
    def weight(self) -> float:
        """Its share of the step's samples, all ranks together (0 for a filler): what its
        mean loss weighs in the step's gradient."""
        return self.slot.size / self.slot.step_samples

    @property
    def closes_step(self) -> bool:
        """This rank's last micro-batch of the step: its backward all-reduces."""
        return self.slot.boundary

    @property
    def filler(self) -> bool:
        return self.slot.filler


@dataclass
class Step:
    """This rank's micro-batches of one optimizer step. Iterate it as often as the loop
    needs (a GAN goes over them once for the discriminator, once for the generator): each
    micro-batch is prepared (sync, seeds) as it is handed out."""

    number: int
    """The optimizer step, counted over the run (1-based)."""
    epoch: int
    micro: list[Micro]
    prepare: Callable[[Micro], None] = field(repr=False, default=lambda micro: None)

    def __iter__(self) -> Iterator[Micro]:
        for micro in self.micro:
            self.prepare(micro)
            yield micro

    def __len__(self) -> int:
        return len(self.micro)

    @property
    def samples(self) -> int:
        """This rank's samples in the step."""
        return sum(m.samples for m in self.micro)


@dataclass
class OrderedData:
    """A dataset's loader over this rank's micro-batches of the global order."""

    loader: DataLoader
    order: GlobalOrderBatches
    size: int


def ordered_data(
    optim: Optimisation, data: Data, scaling: Scaling, global_batch: int, dataset: Dataset,
    rank: int, world_size: int, collate: Callable[[list[Any]], Any] | None,
    random_samples: bool,
) -> OrderedData:  # fmt: skip
    """The loader of ``dataset`` in the global order of the run's batch (``global_batch``
    samples per optimizer step) and seed, for this rank: every step the same samples at
    any world size. ``random_samples``: each sample's own randomness (augmentation)
    seeded from (seed, epoch, index)."""
    size = len(dataset)  # type: ignore[arg-type]
    order = GlobalOrderBatches(
        size, batch_size=optim.batch_size, global_batch=global_batch, seed=optim.seed,
        rank=rank, world_size=world_size, tag_epoch=random_samples,
        lockstep=scaling.strategy == "fsdp2",  # FSDP2: every rank as many passes per step
    )  # fmt: skip
    workers = data.loader_workers or 0
    loader = DataLoader(
        SeededSamples(dataset, optim.seed) if random_samples else dataset,
        batch_sampler=order,
        collate_fn=collate or default_collate,
        num_workers=workers,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(optim.seed),
    )
    # Ray moves each batch to the device (its own sampler kept: no DistributedSampler).
    loader = ray.train.torch.prepare_data_loader(loader, add_dist_sampler=False)
    return OrderedData(loader, order, size)


def epoch_steps(data: OrderedData, first_step: int) -> Iterator[Step]:
    """The steps of the epoch from where the caller put ``data.order``
    (``set_position``), as this rank trains them (``first_step``: the run's number of the
    first). The caller advances the run's position after each (``Step`` has no say)."""
    epoch = data.order.plan.epoch
    batches = iter(data.loader)
    group: list[Micro] = []
    number = first_step
    for slot in data.order.slots:
        batch = next(batches, None)
        if batch is None:
            raise RuntimeError(f"the loader ran out at step {number} of epoch {epoch + 1}")
        group.append(Micro(batch, slot, epoch, number))
        if slot.boundary:
            yield Step(number, epoch, group)
            group, number = [], number + 1


def step_end(data: OrderedData, slot: Slot) -> int:
    """Where the epoch's order continues after the step of ``slot``."""
    return data.order.plan.step_start(slot.step + 1)
