"""What a dataset looks like to the model (``DatasetInfo``) and the image transforms that
make it so: decoding to RGB, resizing, normalising, augmenting. Shared by every dataset
reader (``datasets``, ``parquet_data``), which import it and not each other."""

from __future__ import annotations

from dataclasses import dataclass

from ray_ddp.config import TrainConfig
from ray_ddp.models import needs_rgb

# Per-dataset normalisation (channel means/stds of the training sets).
CIFAR_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
MNIST_STATS = ((0.1307,), (0.3081,))
FASHION_STATS = ((0.2860,), (0.3530,))
GENERIC_STATS = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
DEFAULT_FILE_IMAGE_SIZE = 32


@dataclass(frozen=True)
class DatasetInfo:
    """What the model and the driver need to know about a dataset."""

    num_classes: int
    input_shape: tuple[int, ...]
    """One sample's shape as the model sees it (after transforms)."""
    train_size: int | None = None
    """Samples in the train split, where known without loading it all."""
    val_size: int | None = None


def image_shape(cfg: TrainConfig, channels: int, native_size: int) -> tuple[int, int, int]:
    """(C, H, W) after the transform: grey becomes RGB for torchvision models, and
    ``--image-size`` resizes."""
    if channels == 1 and needs_rgb(cfg.model):
        channels = 3
    size = cfg.image_size or native_size
    return (channels, size, size)


def image_transform(cfg: TrainConfig, stats: tuple = GENERIC_STATS, train: bool = False):
    """PIL image -> normalised tensor; grey repeated to RGB for torchvision models;
    random crop + flip augmentation for CIFAR-10 and ImageFolder training images."""
    from torchvision import transforms as T

    steps = []
    size = cfg.image_size
    if cfg.dataset in ("imagefolder", "parquet"):
        size = size or DEFAULT_FILE_IMAGE_SIZE
        steps.append(T.Lambda(_to_rgb))  # palette / grey / RGBA files alike
    if size:
        steps.append(T.Resize((size, size)))
    mean, std = stats
    if len(mean) == 1 and needs_rgb(cfg.model):
        steps.append(T.Grayscale(num_output_channels=3))
        mean, std = mean * 3, std * 3
    if train and has_random_transform(cfg):
        crop = size or 32
        steps += [T.RandomCrop(crop, padding=crop // 8), T.RandomHorizontalFlip()]
    steps += [T.ToTensor(), T.Normalize(mean, std)]
    return T.Compose(steps)


def has_random_transform(cfg: TrainConfig) -> bool:
    """Whether the training transform draws random numbers (crop and flip), i.e. whether
    exact resume needs each sample's randomness pinned down."""
    return cfg.dataset in ("cifar10", "imagefolder")


def _to_rgb(image):
    return image.convert("RGB")
