"""DataLoaders for one worker: a seeded DistributedSampler for training, the exact
ShardSampler for evaluation, both handed to ``ray.train.torch.prepare_data_loader`` for
device placement (host-to-GPU copies on a side stream when on GPU)."""

from __future__ import annotations

import ray.train.torch
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ray_ddp.config import TrainConfig
from ray_ddp.evaluation import ShardSampler


def loader_workers(cfg: TrainConfig) -> int:
    if cfg.loader_workers is not None:
        return cfg.loader_workers
    # The built-in dataset is tensors in memory: worker processes would only add IPC.
    return 0 if cfg.dataset == "synthetic" else min(4, int(cfg.cpus_per_worker))


def make_loaders(
    cfg: TrainConfig,
    train_ds: Dataset,
    val_ds: Dataset,
    rank: int,
    world_size: int,
    device: torch.device,
) -> tuple[DataLoader, DistributedSampler, DataLoader]:
    workers = loader_workers(cfg)
    pin = cfg.pin_memory if cfg.pin_memory is not None else device.type == "cuda"
    common = {
        "num_workers": workers,
        "pin_memory": pin,
        "persistent_workers": workers > 0,
    }
    # Our own DistributedSampler (Ray would add one with seed 0): the data order follows
    # --seed, changes every epoch through set_epoch, and is the same on a re-run.
    # drop_last=False on the sampler pads ranks to equal length, so every rank runs the
    # same number of steps (a rank with fewer would hang the others in all-reduce);
    # drop_last=True on the loader keeps every micro-batch full-size.
    train_sampler = DistributedSampler(
        train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed
    )
    train_loader = DataLoader(
        train_ds, batch_size=cfg.batch_size, sampler=train_sampler, drop_last=True, **common
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
