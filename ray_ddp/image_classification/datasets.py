"""Datasets by name: the built-in one, torchvision's CIFAR-10 / MNIST / Fashion-MNIST,
an ImageFolder tree and Parquet files.

``describe_dataset`` is the cheap driver-side check (files exist, class counts, shapes,
how many samples each split has) run before any Ray work; ``build_datasets`` constructs
the real train and validation datasets inside each worker. Neither imports Ray.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import struct
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from ray_ddp.config import ConfigError
from ray_ddp.config.sections import Data, Target
from ray_ddp.data.parquet_stream import StreamingParquet
from ray_ddp.image_classification import parquet as parquet_data
from ray_ddp.image_classification import synthetic as synthetic_data
from ray_ddp.image_classification.transforms import (
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
# (train, test) samples of the published datasets: what --download will fetch.
_PUBLISHED_SIZES = {
    "cifar10": (50_000, 10_000),
    "mnist": (60_000, 10_000),
    "fashion-mnist": (60_000, 10_000),
}


# ---------------------------------------------------------------- driver side
def describe_dataset(data: Data, target: Target) -> DatasetInfo:
    """Check that the dataset is there and readable, and count each split's samples
    (after ``--train-samples``/``--val-samples``); raise ConfigError otherwise."""
    info = _describe(data, target)
    if data.dataset == "synthetic":
        return info  # generated: the sample counts are what it is asked for
    train_size: int | None
    val_size: int | None
    if data.dataset in _TORCHVISION_LAYOUT:
        train_size, val_size = _torchvision_sizes(data)
    elif data.dataset == "imagefolder":
        train_size, val_size = (
            _image_folder_size(data.data_dir or "", s) for s in ("train", "val")
        )
    else:
        train_size, val_size = info.train_size, info.val_size
    return dataclasses.replace(
        info,
        train_size=_limited(train_size, data.train_samples),
        val_size=_limited(val_size, data.val_samples),
    )


def _limited(size: int | None, limit: int | None) -> int | None:
    """A split's size after a --train-samples/--val-samples subset (see ``_subset``)."""
    return min(size, limit) if size is not None and limit else size


def _describe(data: Data, target: Target) -> DatasetInfo:
    """Classes and shapes; sample counts only where they come free."""
    if data.dataset == "synthetic":
        if data.image_size and data.image_size != synthetic_data.IMAGE_SIZE:
            raise ConfigError("--image-size does not apply to the built-in dataset")
        return DatasetInfo(
            synthetic_data.NUM_CLASSES,
            image_shape(data, target, synthetic_data.CHANNELS, synthetic_data.IMAGE_SIZE),
            data.train_samples or synthetic_data.DEFAULT_TRAIN_SAMPLES,
            data.val_samples or synthetic_data.DEFAULT_VAL_SAMPLES,
        )
    assert data.data_dir is not None  # validate() guarantees it
    if data.dataset == "parquet":  # a local folder or a URI (s3://, gs://)
        return parquet_data.describe(data, target)
    if not os.path.isdir(data.data_dir) and not (
        data.download and data.dataset in _TORCHVISION_LAYOUT
    ):
        raise ConfigError(f"--data-dir {data.data_dir} does not exist or is not a directory")
    if data.dataset in _TORCHVISION_LAYOUT:
        folder, files = _TORCHVISION_LAYOUT[data.dataset]
        missing = [f for f in files if not os.path.isfile(os.path.join(data.data_dir, folder, f))]
        if missing and not data.download:
            raise ConfigError(
                f"{data.dataset} files missing under {os.path.join(data.data_dir, folder)} "
                f"({', '.join(missing[:3])}...); pass --download to fetch them"
            )
        channels, size = (3, 32) if data.dataset == "cifar10" else (1, 28)
        return DatasetInfo(10, image_shape(data, target, channels, size))
    train_classes = _image_folder_classes(os.path.join(data.data_dir, "train"))
    val_classes = _image_folder_classes(os.path.join(data.data_dir, "val"))
    if train_classes != val_classes:
        raise ConfigError(
            f"imagefolder train/ and val/ have different class folders: "
            f"{sorted(set(train_classes) ^ set(val_classes))[:5]}"
        )
    return DatasetInfo(len(train_classes), image_shape(data, target, 3, DEFAULT_FILE_IMAGE_SIZE))


def _image_folder_classes(root: str) -> list[str]:
    if not os.path.isdir(root):
        raise ConfigError(f"imagefolder needs {root}/ with one sub-folder per class")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise ConfigError(f"{root}/ has no class sub-folders (expected {root}/<class>/*.png)")
    return classes


def _image_folder_size(data_dir: str, split: str) -> int:
    """The images torchvision's ImageFolder will find: its own listing, so the count is
    exactly its length (files by extension, class folders walked recursively)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    root = os.path.join(data_dir, split)
    classes = _image_folder_classes(root)
    try:
        found = make_dataset(root, {c: i for i, c in enumerate(classes)}, IMG_EXTENSIONS)
    except FileNotFoundError as exc:  # a class folder without images
        raise ConfigError(f"imagefolder {root}/: {exc}") from exc
    return len(found)


def _torchvision_sizes(data: Data) -> tuple[int, int]:
    """(train, test) samples, read from the files: the IDX headers hold MNIST's counts,
    CIFAR-10's batches are unpickled (a CIFAR-format subset can have any size)."""
    folder, files = _TORCHVISION_LAYOUT[data.dataset]
    folder = os.path.join(data.data_dir or "", folder)
    if not all(os.path.isfile(os.path.join(folder, f)) for f in files):
        return _PUBLISHED_SIZES[data.dataset]  # --download fetches them all (else refused)
    if data.dataset == "cifar10":
        train = sum(_cifar_batch_size(os.path.join(folder, f"data_batch_{i}")) for i in range(1, 6))
        return train, _cifar_batch_size(os.path.join(folder, "test_batch"))
    return tuple(  # type: ignore[return-value]
        _idx_count(os.path.join(folder, f"{prefix}-images-idx3-ubyte"))
        for prefix in ("train", "t10k")
    )


def _idx_count(path: str) -> int:
    """An IDX image file's sample count, from its header (magic 0x803: uint8, 3-d)."""
    with open(path, "rb") as f:
        header = f.read(8)
    if len(header) < 8 or struct.unpack(">I", header[:4])[0] != 0x803:
        raise ConfigError(f"{path} is not an IDX image file (uncompressed, as MNIST's)")
    return struct.unpack(">I", header[4:])[0]


def _cifar_batch_size(path: str) -> int:
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        return len(entry["data"])
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read the CIFAR-10 batch {path}: {exc!r}") from exc


# ---------------------------------------------------------------- worker side
def build_datasets(
    data: Data, target: Target, seed: int, augment: bool = True
) -> tuple[Dataset, Dataset, DatasetInfo]:
    """The train and validation datasets, as tensors-producing torch Datasets.
    ``seed`` (``--seed``) draws the ``--train-samples``/``--val-samples`` subsets; ``augment=False``
    gives the train split the evaluation transform (for evaluating on it)."""
    info = _describe(data, target)  # the sizes: those of the datasets built here
    if data.dataset == "synthetic":
        made = synthetic_data.make_synthetic(seed, data.train_samples, data.val_samples)
        return made[0], made[1], info
    train: Dataset[Any]
    val: Dataset[Any]
    if data.dataset == "parquet":
        train, val = parquet_data.load(data, target, augment)
    elif data.dataset == "imagefolder":
        import torchvision

        root = data.data_dir or ""
        train = torchvision.datasets.ImageFolder(
            os.path.join(root, "train"), transform=image_transform(data, target, train=augment)
        )
        val = torchvision.datasets.ImageFolder(
            os.path.join(root, "val"), transform=image_transform(data, target, train=False)
        )
    else:
        train, val = _torchvision_splits(data, target, augment)
    train, val = (
        _subset(train, data.train_samples, seed),
        _subset(val, data.val_samples, seed),
    )
    # map-style: every split here has a length (Dataset does not declare one)
    sizes = len(train), len(val)  # type: ignore[arg-type]
    return train, val, dataclasses.replace(info, train_size=sizes[0], val_size=sizes[1])


def _torchvision_splits(data: Data, target: Target, augment: bool) -> tuple[Dataset, Dataset]:
    import torchvision

    if data.dataset == "cifar10":
        cls, stats = _PresenceCheckedCIFAR10(), CIFAR_STATS
    elif data.dataset == "mnist":
        cls, stats = torchvision.datasets.MNIST, MNIST_STATS
    else:
        cls, stats = torchvision.datasets.FashionMNIST, FASHION_STATS
    splits = []
    for train in (True, False):
        splits.append(
            cls(
                data.data_dir,
                train=train,
                download=data.download,
                transform=image_transform(data, target, stats, train=train and augment),
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
    """A seeded random subset (class-balanced in expectation, unlike the first N); of a
    streamed split, whole row groups (see ``SplitLayout.subset``)."""
    if isinstance(dataset, StreamingParquet):
        return dataset.limited(limit, seed)
    if not limit or limit >= len(dataset):  # type: ignore[arg-type]
        return dataset
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))  # type: ignore[arg-type]
    return Subset(dataset, order[:limit].tolist())
