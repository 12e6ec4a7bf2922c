"""Parquet datasets read with pyarrow.

Layout under ``--data-dir``: ``train.parquet`` and ``val.parquet`` (files), or ``train/``
and ``val/`` (folders of Parquet files). Each row has an integer label column and either
an image column (encoded PNG/JPEG bytes, or a struct with a ``bytes`` field as Hugging
Face datasets write it) or, with ``--feature-column``, a list<float> feature column.
"""

from __future__ import annotations

import io
import os

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.transforms import DEFAULT_FILE_IMAGE_SIZE, DatasetInfo, image_transform


def split_path(data_dir: str, split: str) -> str:
    for candidate in (os.path.join(data_dir, f"{split}.parquet"), os.path.join(data_dir, split)):
        if os.path.exists(candidate):
            return candidate
    raise ConfigError(
        f"parquet needs {data_dir}/{split}.parquet or a {data_dir}/{split}/ folder of Parquet files"
    )


def _read(path: str, columns: list[str]) -> pa.Table:
    try:
        schema = pq.read_schema(path) if os.path.isfile(path) else pq.ParquetDataset(path).schema
    except (pa.ArrowInvalid, OSError) as exc:
        raise ConfigError(f"cannot read Parquet at {path}: {exc}") from exc
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise ConfigError(
            f"{path} has no column {missing[0]!r} (columns: {', '.join(schema.names)}); "
            "set --label-column / --image-column / --feature-column"
        )
    return pq.read_table(path, columns=columns)


def _labels(table: pa.Table, column: str, path: str) -> torch.Tensor:
    if not pa.types.is_integer(table.schema.field(column).type):
        raise ConfigError(f"{path}: label column {column!r} must hold integers")
    labels = torch.tensor(table.column(column).to_numpy(), dtype=torch.long)  # a copy
    if len(labels) == 0:
        raise ConfigError(f"{path} has no rows")
    if int(labels.min()) < 0:
        raise ConfigError(f"{path}: labels must be 0..C-1, found {int(labels.min())}")
    return labels


def _input_column(cfg: TrainConfig) -> str:
    return cfg.feature_column or cfg.image_column


def describe(cfg: TrainConfig) -> DatasetInfo:
    assert cfg.data_dir is not None
    num_classes = 0
    sizes = []
    feature_dim = None
    for split in ("train", "val"):
        path = split_path(cfg.data_dir, split)
        table = _read(path, [cfg.label_column, _input_column(cfg)])
        labels = _labels(table, cfg.label_column, path)
        num_classes = max(num_classes, int(labels.max()) + 1)
        sizes.append(len(labels))
        if cfg.feature_column:
            first = table.column(cfg.feature_column)[0].as_py()
            if not isinstance(first, list) or not first:
                raise ConfigError(f"{path}: --feature-column must be a list of numbers")
            feature_dim = len(first)
    if cfg.feature_column:
        if cfg.model != "mlp":
            raise ConfigError("a Parquet --feature-column needs --model mlp")
        shape: tuple[int, ...] = (feature_dim,)
    else:
        size = cfg.image_size or DEFAULT_FILE_IMAGE_SIZE
        shape = (3, size, size)
    return DatasetInfo(max(num_classes, 2), shape, sizes[0], sizes[1])


class ParquetImages(Dataset):
    """Rows of encoded images, decoded with PIL on access (in DataLoader workers)."""

    def __init__(self, images: list[bytes], labels: torch.Tensor, transform) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        from PIL import Image

        image = Image.open(io.BytesIO(self.images[index]))
        return self.transform(image), self.labels[index]


def _image_bytes(column: pa.ChunkedArray) -> list[bytes]:
    if pa.types.is_struct(column.type):  # Hugging Face: {"bytes": ..., "path": ...}
        column = pa.chunked_array([chunk.field("bytes") for chunk in column.chunks])
    if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        raise ConfigError(f"image column must hold encoded image bytes, found {column.type}")
    return column.to_pylist()


def load(cfg: TrainConfig) -> tuple[Dataset, Dataset]:
    from torch.utils.data import TensorDataset

    assert cfg.data_dir is not None
    splits = []
    for train in (True, False):
        path = split_path(cfg.data_dir, "train" if train else "val")
        table = _read(path, [cfg.label_column, _input_column(cfg)])
        labels = _labels(table, cfg.label_column, path)
        if cfg.feature_column:
            features = torch.tensor(
                table.column(cfg.feature_column).to_pylist(), dtype=torch.float32
            )
            splits.append(TensorDataset(features, labels))
        else:
            images = _image_bytes(table.column(cfg.image_column))
            splits.append(ParquetImages(images, labels, image_transform(cfg, train=train)))
    return splits[0], splits[1]
