"""DataLoaders for one worker: the world-size-independent global order for training
(``ray_ddp.data.order.global_order``), the exact evaluation shards (``order.shards``),
both handed to ``ray.train.torch.prepare_data_loader`` for device placement (host-to-GPU copies on a
side stream when on GPU).

Exact resume, mid-epoch and at another world size included, rests on three things here:
- the batch sampler starts an epoch at a given sample of the epoch's global order (the
  batches before it are not even loaded);
- random augmentation is seeded per sample from (seed, epoch, index), so it does not
  depend on which loader worker process draws it, how many there are, or where the epoch
  was resumed;
- the loader has its own generator, so starting an iterator never draws from the global
  RNG that the training step (dropout) uses.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import ray.train.torch
import torch
from torch.utils.data import DataLoader, Dataset

from ray_ddp.config.sections import BUILTIN_TASK, Data, Optimisation, Scaling, Target
from ray_ddp.data.order.global_order import GlobalOrderBatches
from ray_ddp.data.order.shards import ShardSampler, StreamedShard
from ray_ddp.data.order.streamed_batches import StreamedBatches
from ray_ddp.data.parquet_stream import StreamingParquet
from ray_ddp.data.seeding import sample_seed
from ray_ddp.data.unreadable import SkipUnreadable, SkipUnreadableCollate

if TYPE_CHECKING:
    from ray_ddp.task import Task


class SeededSamples(Dataset):
    """Fetches ``(epoch, index)`` with torch's CPU generator, which torchvision's random
    transforms draw from, seeded from (seed, epoch, index), and restored afterwards.

    Only the CPU generator: with ``--loader-workers 0`` this runs in the training process,
    where ``torch.manual_seed`` would also reseed every GPU's generator, which
    ``fork_rng(devices=[])`` does not restore: dropout on the device would then follow the
    last sample of each batch."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        cpu = torch.default_generator
        saved = cpu.get_state()
        cpu.manual_seed(sample_seed(self.seed, epoch, operator.index(index)))
        try:
            return self.dataset[index]
        finally:
            cpu.set_state(saved)


def loader_workers(data: Data, target: Target, scaling: Scaling) -> int:
    if data.loader_workers is not None:
        return data.loader_workers
    # The built-in dataset is tensors in memory: worker processes would only add IPC.
    in_memory = target.task == BUILTIN_TASK and data.dataset == "synthetic"
    return 0 if in_memory else min(4, int(scaling.cpus_per_worker))


def make_loaders(
    optim: Optimisation,
    data: Data,
    target: Target,
    scaling: Scaling,
    global_batch: int,
    task: Task,
    augmented: bool,
    train_ds: Dataset,
    val_ds: Dataset,
    rank: int,
    world_size: int,
    device: torch.device,
) -> tuple[DataLoader, GlobalOrderBatches, DataLoader]:
    """This worker's training loader (the global order of ``global_batch`` samples per
    optimizer step), its batch sampler, and its evaluation loader. ``augmented``: the
    task's samples draw random numbers (``Task.random_samples``), so each is seeded."""
    workers = loader_workers(data, target, scaling)
    pin = data.pin_memory if data.pin_memory is not None else device.type == "cuda"
    common: dict[str, Any] = {
        "num_workers": workers,
        "pin_memory": pin,
        "persistent_workers": workers > 0,
        # Unreadable samples are left out of their batch and named (ray_ddp.data.unreadable).
        "collate_fn": SkipUnreadableCollate(task.collate),
    }
    # The data order follows --seed, changes every epoch, is the same on a re-run, and
    # does not depend on the world size: every optimizer step trains the same samples at
    # any number of workers, and every sample once per epoch (see ray_ddp.data.order.global_order).
    # FSDP2 all-gathers parameters in every forward and backward: every rank must run as
    # many as the others in each step (a short one's are weight-0 fillers).
    order = {
        "batch_size": optim.batch_size, "global_batch": global_batch,
        "seed": optim.seed,
        "rank": rank, "world_size": world_size, "tag_epoch": augmented,
        "lockstep": scaling.strategy == "fsdp2",
    }  # fmt: skip
    streamed = streamed_split(train_ds)
    train_batches: StreamedBatches | GlobalOrderBatches
    if streamed is not None:  # a streamed Parquet split: the sampler reads the rows
        train_batches = StreamedBatches(streamed, buffer=data.shuffle_buffer, **order)
    else:
        train_batches = GlobalOrderBatches(len(train_ds), **order)  # type: ignore[arg-type]
    train_loader = DataLoader(
        SkipUnreadable(SeededSamples(train_ds, optim.seed) if augmented else train_ds),
        batch_sampler=train_batches,
        generator=torch.Generator().manual_seed(optim.seed),
        **common,
    )
    # No activations kept for backward: twice the batch fits.
    val_loader = eval_loader(
        SkipUnreadable(val_ds), optim.batch_size * 2, rank, world_size, **common
    )
    # Both loaders keep their own samplers (Ray would add a DistributedSampler of seed 0).
    train_loader = ray.train.torch.prepare_data_loader(train_loader, add_dist_sampler=False)
    return train_loader, train_batches, val_loader


def eval_loader(
    dataset: Dataset, batch_size: int, rank: int, world_size: int, **options: Any
) -> DataLoader:
    """The exact evaluation loader of this rank's share of ``dataset`` (every sample on
    exactly one rank), prepared by Ray (device placement)."""
    streamed = streamed_split(dataset)
    if streamed is not None:
        sampler: Any = StreamedShard(streamed, rank, world_size)
    else:
        sampler = ShardSampler(len(dataset), rank, world_size)  # type: ignore[arg-type]
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, **options)
    return ray.train.torch.prepare_data_loader(loader, add_dist_sampler=False)


def streamed_split(dataset: Any) -> StreamingParquet | None:
    """The streamed Parquet split (whose sampler reads its rows) ``dataset`` is or wraps
    (wrappers keep theirs as ``.dataset``); None for a dataset read by index."""
    while dataset is not None:
        if isinstance(dataset, StreamingParquet):
            return dataset
        dataset = getattr(dataset, "dataset", None)
    return None
