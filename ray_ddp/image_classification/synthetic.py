"""The built-in dataset: small colour images generated from the seed, no download.

Each of the 10 classes has a smooth random 3-channel pattern (its prototype). A sample is
its class prototype, shifted by a few pixels (with wrap-around), scaled in contrast, with a
faint second pattern from another class laid over it and Gaussian noise added. A linear
model stays far from perfect (shifts move the pattern), a small CNN gets above 90% within
a few epochs, and accuracy climbs epoch by epoch: learnable, but not trivially.

Sample ``i`` is made when it is read, from ``(seed, split, i)`` alone: its draws (class,
shifts, contrast, noise) are counter-based (SplitMix64 of the sample's number and the
draw's), so a split of a billion samples costs its 10 prototypes, the same seed gives the
same tensors on every worker and every run, and nothing needs to be shipped or shared
between nodes. A micro-batch is made at once (``__getitems__``, which the DataLoader
calls): about 0.5 ms for 32 samples on one CPU thread.

A split of at most :data:`WHOLE_BYTES` (the default 12,000 samples are 37 MB) is made whole
at its first read and read from memory after that: the same tensors, but making a batch
each step cost the default job about 6% of a step on one thread (the draws' temporaries
crowd the step's caches) and more with two workers on two cores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ray_ddp.data.order.permutation import mix64, mix_key

NUM_CLASSES = 10
CHANNELS = 3
IMAGE_SIZE = 16
DEFAULT_TRAIN_SAMPLES = 12_000
DEFAULT_VAL_SAMPLES = 2_000

WHOLE_BYTES = 64 * 2**20
"""A split whose images take at most this many bytes is kept whole once first read."""
_WHOLE_CHUNK = 1024
"""Samples made at a time while a split is made whole (bounds the draws' temporaries)."""

_MAX_SHIFT = 5
_NOISE_STD = 1.1
_DISTRACTOR = 0.6
_PIXELS = CHANNELS * IMAGE_SIZE * IMAGE_SIZE
_DRAWS = 8 + _PIXELS
"""Uniform draws a sample takes: class, other class, 4 shifts, contrast, one spare, then
one per pixel of noise (Box-Muller: a pair of uniforms makes a pair of normals)."""


def _prototypes(generator: torch.Generator) -> torch.Tensor:
    coarse = torch.randn(NUM_CLASSES, CHANNELS, 4, 4, generator=generator)
    smooth = F.interpolate(coarse, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bicubic")
    return smooth / smooth.flatten(1).std(dim=1).view(-1, 1, 1, 1)


_SHIFTS = 2 * _MAX_SHIFT + 1


def _shifted(protos: torch.Tensor) -> torch.Tensor:
    """Every prototype at every shift, ``(classes, shifts**2, C, H, W)``: ``[c, a * 11 +
    b]`` is ``torch.roll(protos[c], (a - 5, b - 5), dims=(1, 2))`` (3.7 MB, once)."""
    rolls = range(-_MAX_SHIFT, _MAX_SHIFT + 1)
    return torch.stack([protos.roll((a, b), dims=(2, 3)) for a in rolls for b in rolls], 1)


def _uniforms(key: int, indices: np.ndarray) -> np.ndarray:
    """``(len(indices), _DRAWS)`` float32 uniforms in (0, 1): draw ``j`` of sample ``i`` is
    a hash of ``(key, i * _DRAWS + j)``, the same whichever samples are made with it."""
    counters = indices.astype(np.uint64)[:, None] * np.uint64(_DRAWS)
    words = mix64(counters + np.arange(_DRAWS, dtype=np.uint64), np.uint64(key))
    return (((words >> np.uint64(40)).astype(np.float32) + 0.5) / 2.0**24).astype(np.float32)


def _samples(
    shifted: torch.Tensor, key: int, indices: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    u = _uniforms(key, indices)
    labels = torch.from_numpy((u[:, 0] * NUM_CLASSES).astype(np.int64))
    other = labels + 1 + torch.from_numpy((u[:, 1] * (NUM_CLASSES - 1)).astype(np.int64))
    shifts = torch.from_numpy((u[:, 2:6] * _SHIFTS).astype(np.int64))  # 0..10: -5..5
    contrast = torch.from_numpy(0.6 + 0.8 * u[:, 6])
    main = shifted[labels, shifts[:, 0] * _SHIFTS + shifts[:, 1]]
    distractor = shifted[other % NUM_CLASSES, shifts[:, 2] * _SHIFTS + shifts[:, 3]]
    first, second = u[:, 8 : 8 + _PIXELS // 2], u[:, 8 + _PIXELS // 2 :]
    radius, angle = np.sqrt(-2.0 * np.log(first)), np.float32(2.0 * math.pi) * second
    noise = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    images = contrast.view(-1, 1, 1, 1) * main + _DISTRACTOR * distractor
    images += _NOISE_STD * torch.from_numpy(noise).view(images.shape)
    return images, labels


class SyntheticImages(Dataset):
    """``size`` samples of one split, each made when read (module docstring)."""

    def __init__(self, shifted: torch.Tensor, key: int, size: int) -> None:
        self.shifted, self.key, self.size = shifted, key, size
        """The prototypes at every shift (``_shifted``), a draw's key, the samples."""
        self.whole: tuple[torch.Tensor, torch.Tensor] | None = None
        """Every sample, once a split of at most ``WHOLE_BYTES`` has been read."""

    def __len__(self) -> int:
        return self.size

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "whole": None}  # made again where it is read, not shipped

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``indices`` as (images, labels) tensors."""
        numbers = np.asarray([range(self.size)[i] for i in indices], dtype=np.int64)  # checked
        if self.whole is None and self.size * _PIXELS * 4 <= WHOLE_BYTES:
            self.whole = self._made_whole()
        if self.whole is not None:
            return self.whole[0][numbers], self.whole[1][numbers]
        return _samples(self.shifted, self.key, numbers)

    def _made_whole(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sample of the split, made ``_WHOLE_CHUNK`` at a time."""
        images = torch.empty(self.size, CHANNELS, IMAGE_SIZE, IMAGE_SIZE)
        labels = torch.empty(self.size, dtype=torch.int64)
        for begin in range(0, self.size, _WHOLE_CHUNK):
            end = min(begin + _WHOLE_CHUNK, self.size)
            numbers = np.arange(begin, end, dtype=np.int64)
            images[begin:end], labels[begin:end] = _samples(self.shifted, self.key, numbers)
        return images, labels

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(*self.batch(indices), strict=True))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.__getitems__([index])[0]


def make_synthetic(
    seed: int, train_samples: int | None = None, val_samples: int | None = None
) -> tuple[SyntheticImages, SyntheticImages]:
    """The train and validation splits for ``seed`` (same seed, same tensors)."""
    # Separate keys, so the validation split does not change with the train size.
    protos = _prototypes(torch.Generator().manual_seed((seed * 3) % 2**64))  # any --seed
    shifted = _shifted(protos)
    train_key, val_key = (mix_key(mix_key(seed) + k) for k in (1, 2))
    return (
        SyntheticImages(shifted, train_key, train_samples or DEFAULT_TRAIN_SAMPLES),
        SyntheticImages(shifted, val_key, val_samples or DEFAULT_VAL_SAMPLES),
    )
