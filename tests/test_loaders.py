"""Per-sample seeded augmentation and the global-order batch sampler behind exact
mid-epoch resume, and the seeds every stream of a run is drawn from."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from formats import write_imagefolder
from torch.utils.data import DataLoader, Dataset

from ray_ddp.config import TrainConfig
from ray_ddp.data.loaders import SeededSamples
from ray_ddp.data.order.global_order import GlobalOrderBatches
from ray_ddp.data.seeding import sample_seed, seed_micro_batch
from ray_ddp.image_classification.datasets import build_datasets

LARGE_SEED = 2**62


class Noisy(Dataset):
    """A sample's value is random, as an augmented image is."""

    def __len__(self) -> int:
        return 50

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(()) + index


def _batches(start: int, epoch: int, workers: int) -> list[torch.Tensor]:
    """Rank 1 of 2's micro-batches of 4 (global batch 8) from sample ``start``."""
    order = GlobalOrderBatches(
        50, batch_size=4, global_batch=8, seed=5, rank=1, world_size=2, tag_epoch=True
    )
    order.set_position(epoch, start)
    loader = DataLoader(
        SeededSamples(Noisy(), seed=5),
        batch_sampler=order,
        num_workers=workers,
        generator=torch.Generator().manual_seed(5),
    )
    assert len(loader) == 7 - start // 8  # 7 steps of 8 (the last one 2 samples short)
    return list(loader)


def test_a_resumed_epoch_sees_exactly_the_remaining_batches_with_the_same_randomness():
    whole = _batches(0, epoch=2, workers=0)
    torch.manual_seed(123)  # whatever the global RNG holds, samples do not change
    assert all(torch.equal(a, b) for a, b in zip(whole[4:], _batches(32, 2, 0), strict=True))
    # ... nor with loader worker processes drawing them
    assert all(torch.equal(a, b) for a, b in zip(whole, _batches(0, 2, 2), strict=True))
    # another epoch: another order and other randomness
    assert not torch.equal(torch.cat(whole), torch.cat(_batches(0, 3, 0)))


def test_iterating_does_not_draw_from_the_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    _batches(0, epoch=0, workers=0)
    assert torch.equal(torch.rand(3), expected)


# ----------------------------------------------------------------------------- seeds
def _draws() -> tuple:
    return torch.rand(2).tolist(), random.random(), float(np.random.random_sample())


def test_step_randomness_is_seeded_per_micro_batch_in_torch_python_and_numpy():
    seed_micro_batch(LARGE_SEED, step=3, micro=1)
    drawn = _draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)  # whatever came before
    seed_micro_batch(LARGE_SEED, step=3, micro=1)
    assert _draws() == drawn
    for other in ({"step": 3, "micro": 0}, {"step": 4, "micro": 1}):
        seed_micro_batch(LARGE_SEED, **other)
        assert all(a != b for a, b in zip(_draws(), drawn, strict=True)), other


@pytest.mark.parametrize("seed", [0, 1_844_666, LARGE_SEED, 2**63 - 1])
def test_sample_seeds_are_seeds_torch_takes(seed):
    keys = [(epoch, index) for epoch in (0, 1, 10**6) for index in (0, 1, 10**9)]
    seeds = [sample_seed(seed, epoch, index) for epoch, index in keys]
    assert all(0 <= s < 2**64 for s in seeds)
    # torch's generators keep a seed's low 32 bits: those must differ per sample.
    assert len({s & 0xFFFFFFFF for s in seeds}) == len(keys)
    torch.Generator().manual_seed(max(seeds))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("images"))
    write_imagefolder(root, train=4, val=1)
    return root


def _augmented(folder: str, seed: int) -> SeededSamples:
    cfg = TrainConfig(dataset="imagefolder", data_dir=folder, seed=seed)
    train, _, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    return SeededSamples(train, seed)


def test_a_large_seed_augments_real_images(folder):
    """A --seed of 1,844,666 or more used to overflow torch's 64-bit seed."""
    samples = _augmented(folder, LARGE_SEED)
    first = [samples[(0, i)][0] for i in range(len(samples))]
    torch.manual_seed(123)  # the global RNG does not matter
    assert all(torch.equal(samples[(0, i)][0], x) for i, x in enumerate(first))
    later = [samples[(1, i)][0] for i in range(len(samples))]
    assert not all(torch.equal(a, b) for a, b in zip(first, later, strict=True))


def _gpu_generators() -> list:
    """The GPUs' RNG states, or while CUDA is not started (this machine), the seeds queued
    for it: ``torch.manual_seed`` queues one that CUDA applies when it starts."""
    if torch.cuda.is_initialized():
        return [torch.cuda.get_rng_state(i).tolist() for i in range(torch.cuda.device_count())]
    return list(torch.cuda._lazy_seed_tracker.get_calls())


def test_fetching_a_sample_leaves_the_gpu_generators_alone(folder):
    """With --loader-workers 0 samples are fetched in the training process: seeding one
    must not reseed the generators GPU dropout draws from."""
    samples = _augmented(folder, seed=3)
    expected = samples[(2, 5)][0]
    torch.manual_seed(11)  # whatever the step's seeding does
    gpu, cpu = _gpu_generators(), torch.get_rng_state()
    assert torch.equal(samples[(2, 5)][0], expected)
    assert _gpu_generators() == gpu
    assert torch.equal(torch.get_rng_state(), cpu)


def test_the_built_in_data_takes_any_seed_in_range():
    from ray_ddp.image_classification.synthetic import make_synthetic

    train, _ = make_synthetic(2**63 - 1, 4, 4)
    assert len(train) == 4
