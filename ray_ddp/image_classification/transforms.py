"""What a dataset looks like to the model (``DatasetInfo``) and the image transforms that
make it so: decoding to RGB, resizing, normalising, augmenting. Shared by every dataset
reader (``datasets``, ``parquet``), which import it and not each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ray_ddp.config.sections import AUGMENT_POLICIES, Data, Target
from ray_ddp.image_classification.models import needs_rgb

# Per-dataset normalisation (channel means/stds of the training sets).
Stats = tuple[tuple[float, ...], tuple[float, ...]]
"""Per-channel (mean, std) of a dataset's images."""
CIFAR_STATS: Stats = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
MNIST_STATS: Stats = ((0.1307,), (0.3081,))
FASHION_STATS: Stats = ((0.2860,), (0.3530,))
GENERIC_STATS: Stats = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
DEFAULT_FILE_IMAGE_SIZE = 32

# --augment when not given. Crop + flip suits natural photos (CIFAR-10, and ImageFolder
# trees, which are mostly photos); the rest default to none: a flipped digit or letter is
# another symbol or none, and Parquet or MNIST-style data is as often one as the other.
# The field's help text (config.sections.Data.augment) states this table; a test checks.
DEFAULT_AUGMENT = {"cifar10": "crop-flip", "imagefolder": "crop-flip"}


@dataclass(frozen=True)
class DatasetInfo:
    """What the model and the driver need to know about a dataset."""

    num_classes: int
    input_shape: tuple[int, ...]
    """One sample's shape as the model sees it (after transforms)."""
    train_size: int | None = None
    """Samples in the train split, where known without loading it all."""
    val_size: int | None = None


def image_shape(
    data: Data, target: Target, channels: int, native_size: int
) -> tuple[int, int, int]:
    """(C, H, W) after the transform: grey becomes RGB for torchvision models, and
    ``--image-size`` resizes."""
    if channels == 1 and needs_rgb(target.model):
        channels = 3
    size = data.image_size or native_size
    return (channels, size, size)


def image_transform(data: Data, target: Target, stats: tuple = GENERIC_STATS, train: bool = False):
    """PIL image -> normalised tensor; grey repeated to RGB for torchvision models; the
    ``--augment`` policy (see :func:`augment_policy`) on training images."""
    from torchvision import transforms as T

    steps = []
    size = data.image_size
    if data.dataset in ("imagefolder", "parquet"):
        size = size or DEFAULT_FILE_IMAGE_SIZE
        steps.append(T.Lambda(_to_rgb))  # palette / grey / RGBA files alike
    if size:
        steps.append(T.Resize((size, size)))
    mean, std = stats
    if len(mean) == 1 and needs_rgb(target.model):
        steps.append(T.Grayscale(num_output_channels=3))
        mean, std = mean * 3, std * 3
    if train:
        steps += augmentation(augment_policy(data))
    steps += [T.ToTensor(), T.Normalize(mean, std)]
    return T.Compose(steps)


def augment_policy(data: Data) -> str:
    """The training augmentation policy a run uses: ``--augment``, else the dataset's
    default (``DEFAULT_AUGMENT``); always ``none`` where there are no images to augment
    (the built-in dataset is tensors already; a Parquet feature column is not an image)."""
    if data.dataset == "synthetic" or data.feature_column:
        return "none"
    return data.augment or DEFAULT_AUGMENT.get(data.dataset, "none")


def augmentation(policy: str) -> list:
    """The random steps of ``policy`` (one of ``config.AUGMENT_POLICIES``), applied to a
    PIL image after resizing. Every one draws from torch's global RNG (torchvision's
    RandomCrop, RandomHorizontalFlip, AutoAugment and TrivialAugmentWide all do), which
    ``loaders.SeededSamples`` seeds per (seed, epoch, sample): reproducible, and the same
    whichever loader process draws the sample."""
    from torchvision import transforms as T

    if policy not in AUGMENT_POLICIES:
        raise ValueError(f"unknown augmentation policy {policy!r}")
    steps: list = []
    if policy != "none":
        steps.append(RandomPadCrop())
    if policy not in ("none", "crop"):
        steps.append(T.RandomHorizontalFlip())
    if policy == "autoaugment":
        steps.append(T.AutoAugment(T.AutoAugmentPolicy.CIFAR10))
    elif policy == "trivialaugment":
        steps.append(T.TrivialAugmentWide())
    return steps


def has_random_transform(data: Data) -> bool:
    """Whether the training transform draws random numbers, i.e. whether exact resume
    needs each sample's randomness pinned down (``loaders.SeededSamples``)."""
    return augment_policy(data) != "none"


class RandomPadCrop(torch.nn.Module):
    """Pad by 1/8 of the side (at least 1 pixel) with zeros and crop back to the image's
    own size at a random place: a random shift of up to 1/8 of the image. The size is
    taken from each image, so it fits 28-pixel MNIST as well as 32-pixel CIFAR (where it is
    the usual ``RandomCrop(32, padding=4)``)."""

    def forward(self, image):
        from torchvision import transforms as T
        from torchvision.transforms import functional as F

        width, height = F.get_image_size(image)
        padding = max(1, min(width, height) // 8)
        return T.RandomCrop((height, width), padding=padding)(image)


def _to_rgb(image):
    return image.convert("RGB")


def image_decoder(data: Data, target: Target, train: bool) -> Any:
    """``(input, label) -> (tensor, label tensor)``: the torch engine's decoding of a row,
    for ``--data-engine ray``'s tasks (``ray_ddp.data.ray_data``)."""
    from ray_ddp.data.parquet_stream import decoder

    if data.feature_column:
        return decoder(False, None)
    return decoder(True, image_transform(data, target, train=train))
