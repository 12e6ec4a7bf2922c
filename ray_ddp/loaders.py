"""DataLoaders for one worker: a seeded, resumable DistributedSampler for training, the
exact ShardSampler for evaluation, both handed to ``ray.train.torch.prepare_data_loader``
for device placement (host-to-GPU copies on a side stream when on GPU).

Exact resume, mid-epoch included, rests on three things here:
- the sampler can start an epoch at a given micro-batch (the batches before it are not
  even loaded);
- random augmentation is seeded per sample from (seed, epoch, index), so it does not
  depend on which loader worker process draws it, how many there are, or where the epoch
  was resumed;
- the loader has its own generator, so starting an iterator never draws from the global
  RNG that the training step (dropout) uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ray.train.torch
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ray_ddp.config import BUILTIN_TASK, TrainConfig
from ray_ddp.seeding import sample_seed
from ray_ddp.sharded_eval import ShardSampler
from ray_ddp.task import Task


class ResumableSampler(DistributedSampler):
    """DistributedSampler (seeded, padded to equal length per rank) that can start an
    epoch at micro-batch ``start_batch``, and can tag each index with its epoch for
    :class:`SeededSamples`."""

    def __init__(self, dataset: Dataset, *, batch_size: int, tag_epoch: bool, **kwargs: Any):
        super().__init__(dataset, **kwargs)
        if batch_size > 1 and self.num_samples % batch_size == 1:
            # A last micro-batch of one sample cannot train a BatchNorm layer (its batch
            # statistics need two): every rank takes one more sample, repeated.
            self.num_samples += 1
            self.total_size = self.num_samples * self.num_replicas
        self.batch_size = batch_size
        self.tag_epoch = tag_epoch
        self.start_batch = 0

    def set_position(self, epoch: int, start_batch: int) -> None:
        """The coming pass is epoch ``epoch``, from micro-batch ``start_batch`` on."""
        self.set_epoch(epoch)
        self.start_batch = start_batch

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())[self.start_batch * self.batch_size :]
        if self.tag_epoch:
            return iter([(self.epoch, i) for i in indices])
        return iter(indices)

    def __len__(self) -> int:
        return max(0, super().__len__() - self.start_batch * self.batch_size)


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
        cpu.manual_seed(sample_seed(self.seed, epoch, index))
        try:
            return self.dataset[index]
        finally:
            cpu.set_state(saved)


def loader_workers(cfg: TrainConfig) -> int:
    if cfg.loader_workers is not None:
        return cfg.loader_workers
    # The built-in dataset is tensors in memory: worker processes would only add IPC.
    in_memory = cfg.task == BUILTIN_TASK and cfg.dataset == "synthetic"
    return 0 if in_memory else min(4, int(cfg.cpus_per_worker))


def make_loaders(
    cfg: TrainConfig,
    task: Task,
    train_ds: Dataset,
    val_ds: Dataset,
    rank: int,
    world_size: int,
    device: torch.device,
) -> tuple[DataLoader, ResumableSampler, DataLoader]:
    workers = loader_workers(cfg)
    pin = cfg.pin_memory if cfg.pin_memory is not None else device.type == "cuda"
    common = {
        "num_workers": workers,
        "pin_memory": pin,
        "persistent_workers": workers > 0,
        "collate_fn": task.collate,
    }
    # Our own DistributedSampler (Ray would add one with seed 0): the data order follows
    # --seed, changes every epoch through set_epoch, and is the same on a re-run.
    # drop_last=False on the sampler pads ranks to equal length (repeating at most
    # world_size - 1 samples, plus one per rank to avoid a 1-sample tail), so every rank
    # runs the same number of steps (a rank with fewer would hang the others in
    # all-reduce); drop_last=False on the loader trains every sample every epoch, the last
    # micro-batch being smaller (train_epoch weighs it by its size).
    augmented = task.random_samples(cfg)
    train_sampler = ResumableSampler(
        train_ds,
        batch_size=cfg.batch_size,
        tag_epoch=augmented,
        num_replicas=world_size,
        rank=rank,
        shuffle=True,
        seed=cfg.seed,
    )
    train_loader = DataLoader(
        SeededSamples(train_ds, cfg.seed) if augmented else train_ds,
        batch_size=cfg.batch_size,
        sampler=train_sampler,
        drop_last=False,
        generator=torch.Generator().manual_seed(cfg.seed),
        **common,
    )
    val_loader = DataLoader(
        val_ds,
        batch_size=cfg.batch_size * 2,  # no activations kept for backward: twice fits
        sampler=ShardSampler(len(val_ds), rank, world_size),  # type: ignore[arg-type]
        **common,
    )
    # prepare_data_loader keeps a sampler that is already a DistributedSampler; the
    # evaluation loader must keep its ShardSampler, hence add_dist_sampler=False there.
    train_loader = ray.train.torch.prepare_data_loader(train_loader)
    val_loader = ray.train.torch.prepare_data_loader(val_loader, add_dist_sampler=False)
    return train_loader, train_sampler, val_loader
