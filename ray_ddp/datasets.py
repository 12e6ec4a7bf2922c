"""Datasets by name: the built-in one, torchvision's CIFAR-10 / MNIST / Fashion-MNIST,
an ImageFolder tree and Parquet files.

``describe_dataset`` is the cheap driver-side check (files exist, class counts, shapes)
run before any Ray work; ``build_datasets`` constructs the real train and validation
datasets inside each worker. Neither imports Ray.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset, Subset

from ray_ddp import parquet_data, synthetic_data
from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.transforms import (
    CIFAR_STATS,
    DEFAULT_FILE_IMAGE_SIZE,
    FASHION_STATS,
    MNIST_STATS,
    DatasetInfo,
    image_shape,
    image_transform,
)

_TORCHVISION_LAYOUT = {
    # dataset -> (folder under data_dir, files that must be there)
    "cifar10": (
        "cifar-10-batches-py",
        [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"],
    ),
    "mnist": (
        "MNIST/raw",
        [
            "train-images-idx3-ubyte",
            "train-labels-idx1-ubyte",
            "t10k-images-idx3-ubyte",
            "t10k-labels-idx1-ubyte",
        ],
    ),
}
_TORCHVISION_LAYOUT["fashion-mnist"] = ("FashionMNIST/raw", _TORCHVISION_LAYOUT["mnist"][1])


# ---------------------------------------------------------------- driver side
def describe_dataset(cfg: TrainConfig) -> DatasetInfo:
    """Check that the dataset is there and readable; raise ConfigError otherwise."""
    if cfg.dataset == "synthetic":
        return DatasetInfo(
            synthetic_data.NUM_CLASSES,
            image_shape(cfg, synthetic_data.CHANNELS, synthetic_data.IMAGE_SIZE),
            cfg.train_samples or synthetic_data.DEFAULT_TRAIN_SAMPLES,
            cfg.val_samples or synthetic_data.DEFAULT_VAL_SAMPLES,
        )
    assert cfg.data_dir is not None  # validate() guarantees it
    if not os.path.isdir(cfg.data_dir) and not (
        cfg.download and cfg.dataset in _TORCHVISION_LAYOUT
    ):
        raise ConfigError(f"--data-dir {cfg.data_dir} does not exist or is not a directory")
    if cfg.dataset in _TORCHVISION_LAYOUT:
        folder, files = _TORCHVISION_LAYOUT[cfg.dataset]
        missing = [f for f in files if not os.path.isfile(os.path.join(cfg.data_dir, folder, f))]
        if missing and not cfg.download:
            raise ConfigError(
                f"{cfg.dataset} files missing under {os.path.join(cfg.data_dir, folder)} "
                f"({', '.join(missing[:3])}...); pass --download to fetch them"
            )
        channels, size = (3, 32) if cfg.dataset == "cifar10" else (1, 28)
        return DatasetInfo(10, image_shape(cfg, channels, size))
    if cfg.dataset == "imagefolder":
        train_classes = _image_folder_classes(os.path.join(cfg.data_dir, "train"))
        val_classes = _image_folder_classes(os.path.join(cfg.data_dir, "val"))
        if train_classes != val_classes:
            raise ConfigError(
                f"imagefolder train/ and val/ have different class folders: "
                f"{sorted(set(train_classes) ^ set(val_classes))[:5]}"
            )
        return DatasetInfo(len(train_classes), image_shape(cfg, 3, DEFAULT_FILE_IMAGE_SIZE))
    return parquet_data.describe(cfg)


def _image_folder_classes(root: str) -> list[str]:
    if not os.path.isdir(root):
        raise ConfigError(f"imagefolder needs {root}/ with one sub-folder per class")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise ConfigError(f"{root}/ has no class sub-folders (expected {root}/<class>/*.png)")
    return classes


# ---------------------------------------------------------------- worker side
def build_datasets(cfg: TrainConfig, augment: bool = True) -> tuple[Dataset, Dataset, DatasetInfo]:
    """The train and validation datasets, as tensors-producing torch Datasets.
    ``augment=False`` gives the train split the evaluation transform (for evaluating on it)."""
    info = describe_dataset(cfg)
    if cfg.dataset == "synthetic":
        train, val = synthetic_data.make_synthetic(cfg.seed, cfg.train_samples, cfg.val_samples)
        if cfg.image_size and cfg.image_size != synthetic_data.IMAGE_SIZE:
            raise ConfigError("--image-size does not apply to the built-in dataset")
        return train, val, info
    if cfg.dataset == "parquet":
        train, val = parquet_data.load(cfg)
    elif cfg.dataset == "imagefolder":
        import torchvision

        root = cfg.data_dir or ""
        train = torchvision.datasets.ImageFolder(
            os.path.join(root, "train"), transform=image_transform(cfg, train=augment)
        )
        val = torchvision.datasets.ImageFolder(
            os.path.join(root, "val"), transform=image_transform(cfg, train=False)
        )
    else:
        train, val = _torchvision_splits(cfg, augment)
    return (
        _subset(train, cfg.train_samples, cfg.seed),
        _subset(val, cfg.val_samples, cfg.seed),
        info,
    )


def _torchvision_splits(cfg: TrainConfig, augment: bool) -> tuple[Dataset, Dataset]:
    import torchvision

    if cfg.dataset == "cifar10":
        cls, stats = _PresenceCheckedCIFAR10(), CIFAR_STATS
    elif cfg.dataset == "mnist":
        cls, stats = torchvision.datasets.MNIST, MNIST_STATS
    else:
        cls, stats = torchvision.datasets.FashionMNIST, FASHION_STATS
    splits = []
    for train in (True, False):
        splits.append(
            cls(
                cfg.data_dir,
                train=train,
                download=cfg.download,
                transform=image_transform(cfg, stats, train=train and augment),
            )
        )
    return splits[0], splits[1]


def _PresenceCheckedCIFAR10() -> type:  # noqa: N802 - a class factory
    """torchvision's CIFAR-10 reader, checking that the batch files exist rather than their
    MD5 sums, so a CIFAR-format subset or a re-pickled copy loads too. The files are still
    read by torchvision's own code (pickle batches, ``batches.meta``)."""
    import torchvision
    from torchvision.datasets.utils import check_integrity

    class PresenceCheckedCIFAR10(torchvision.datasets.CIFAR10):
        def _check_integrity(self) -> bool:
            names = [name for name, _ in self.train_list + self.test_list]
            return all(check_integrity(os.path.join(self.root, self.base_folder, n)) for n in names)

        def _load_meta(self) -> None:
            import pickle

            path = os.path.join(self.root, self.base_folder, self.meta["filename"])
            with open(path, "rb") as infile:
                self.classes = pickle.load(infile, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    return PresenceCheckedCIFAR10


def _subset(dataset: Dataset, limit: int | None, seed: int) -> Dataset:
    """A seeded random subset (class-balanced in expectation, unlike the first N)."""
    if not limit or limit >= len(dataset):  # type: ignore[arg-type]
        return dataset
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))  # type: ignore[arg-type]
    return Subset(dataset, order[:limit].tolist())
