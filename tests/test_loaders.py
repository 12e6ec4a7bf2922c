"""The resumable sampler and per-sample seeded augmentation behind exact mid-epoch resume."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from ray_ddp.loaders import ResumableSampler, SeededSamples


class Noisy(Dataset):
    """A sample's value is random, as an augmented image is."""

    def __len__(self) -> int:
        return 50

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(()) + index


def _batches(start: int, epoch: int, workers: int) -> list[torch.Tensor]:
    sampler = ResumableSampler(
        Noisy(), batch_size=4, tag_epoch=True, num_replicas=2, rank=1, shuffle=True, seed=5
    )
    sampler.set_position(epoch, start)
    loader = DataLoader(
        SeededSamples(Noisy(), seed=5),
        batch_size=4,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(5),
    )
    assert len(loader) == 6 - start  # 25 samples for this rank -> 6 full batches
    return list(loader)


def test_a_resumed_epoch_sees_exactly_the_remaining_batches_with_the_same_randomness():
    whole = _batches(0, epoch=2, workers=0)
    torch.manual_seed(123)  # whatever the global RNG holds, samples do not change
    assert all(torch.equal(a, b) for a, b in zip(whole[4:], _batches(4, 2, 0), strict=True))
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
