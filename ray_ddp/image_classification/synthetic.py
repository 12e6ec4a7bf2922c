"""The built-in dataset: small colour images generated from the seed, no download.

Each of the 10 classes has a smooth random 3-channel pattern (its prototype). A sample is
its class prototype, shifted by a few pixels (with wrap-around), scaled in contrast, with a
faint second pattern from another class laid over it and Gaussian noise added. A linear
model stays far from perfect (shifts move the pattern), a small CNN gets above 90% within
a few epochs, and accuracy climbs epoch by epoch: learnable, but not trivially.

The same seed gives the same tensors on every worker and every run, so nothing needs to be
shipped or shared between nodes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

NUM_CLASSES = 10
CHANNELS = 3
IMAGE_SIZE = 16
DEFAULT_TRAIN_SAMPLES = 12_000
DEFAULT_VAL_SAMPLES = 2_000

_MAX_SHIFT = 5
_NOISE_STD = 1.1
_DISTRACTOR = 0.6


def _prototypes(generator: torch.Generator) -> torch.Tensor:
    coarse = torch.randn(NUM_CLASSES, CHANNELS, 4, 4, generator=generator)
    smooth = F.interpolate(coarse, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bicubic")
    return smooth / smooth.flatten(1).std(dim=1).view(-1, 1, 1, 1)


_CHUNK = 4096  # samples made at once: bounds the temporary tensors (~12 MB each)


def _rolled(protos: torch.Tensor, labels: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """``torch.roll(protos[labels[i]], shifts=tuple(shifts[i]), dims=(1, 2))`` for every
    i at once, by gathering: row h of the result is row h - shift (mod size)."""
    size = torch.arange(IMAGE_SIZE)
    rows = (size - shifts[:, :1]) % IMAGE_SIZE  # (n, H)
    cols = (size - shifts[:, 1:]) % IMAGE_SIZE  # (n, W)
    n = len(labels)
    return protos[
        labels.view(n, 1, 1, 1),
        torch.arange(CHANNELS).view(1, CHANNELS, 1, 1),
        rows.view(n, 1, IMAGE_SIZE, 1),
        cols.view(n, 1, 1, IMAGE_SIZE),
    ]


def _samples(
    protos: torch.Tensor, count: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(0, NUM_CLASSES, (count,), generator=generator)
    other = (labels + torch.randint(1, NUM_CLASSES, (count,), generator=generator)) % NUM_CLASSES
    shifts = torch.randint(-_MAX_SHIFT, _MAX_SHIFT + 1, (count, 4), generator=generator)
    contrast = 0.6 + 0.8 * torch.rand(count, generator=generator)
    images = torch.empty(count, CHANNELS, IMAGE_SIZE, IMAGE_SIZE)
    for start in range(0, count, _CHUNK):
        part = slice(start, start + _CHUNK)
        main = _rolled(protos, labels[part], shifts[part, :2])
        distractor = _rolled(protos, other[part], shifts[part, 2:])
        images[part] = contrast[part].view(-1, 1, 1, 1) * main + _DISTRACTOR * distractor
    images += _NOISE_STD * torch.randn(images.shape, generator=generator)
    return images, labels


def make_synthetic(
    seed: int, train_samples: int | None = None, val_samples: int | None = None
) -> tuple[TensorDataset, TensorDataset]:
    """The train and validation splits for ``seed`` (same seed, same tensors)."""

    # Separate streams, so the validation split does not change with the train size.
    def stream(k: int) -> torch.Generator:
        return torch.Generator().manual_seed((seed * 3 + k) % 2**64)  # any --seed

    protos = _prototypes(stream(0))
    train = _samples(protos, train_samples or DEFAULT_TRAIN_SAMPLES, stream(1))
    val = _samples(protos, val_samples or DEFAULT_VAL_SAMPLES, stream(2))
    return TensorDataset(*train), TensorDataset(*val)
