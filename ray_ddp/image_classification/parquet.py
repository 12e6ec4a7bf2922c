"""Parquet datasets read with pyarrow.

Layout under ``--data-dir`` (a local folder or a pyarrow URI such as ``s3://bucket/data``):
``train.parquet`` and ``val.parquet`` (files), or ``train/`` and ``val/`` (folders of
Parquet files, e.g. Hugging Face shards). Each row has an integer label column and either
an image column (encoded PNG/JPEG bytes, or a struct with a ``bytes`` field as Hugging
Face datasets write it) or, with ``--feature-column``, a list<float> feature column.
"""

from __future__ import annotations

import bisect
import io
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from ray_ddp.config import ConfigError
from ray_ddp.config.sections import Data, Target
from ray_ddp.data.parquet_stream import SplitLayout, StreamingParquet, decoder, split_path
from ray_ddp.image_classification.transforms import (
    DEFAULT_FILE_IMAGE_SIZE,
    DatasetInfo,
    image_transform,
)


def _check_columns(layout: SplitLayout, columns: list[str]) -> None:
    import pyarrow.parquet as pq

    handle = pq.ParquetFile(layout.fs.open_input_file(layout.files[0]))
    names = handle.schema_arrow.names
    missing = [c for c in columns if c not in names]
    if missing:
        raise ConfigError(
            f"{layout.files[0]} has no column {missing[0]!r} (columns: {', '.join(names)}); "
            "set --label-column / --image-column / --feature-column"
        )


def _layout(path: str, columns: list[str]) -> SplitLayout:
    layout = SplitLayout(path, columns)
    _check_columns(layout, columns)
    return layout


def _read(path: str, columns: list[str]) -> pa.Table:
    """The whole split's ``columns`` (``--parquet-read memory``, and labels to describe)."""
    layout = _layout(path, columns)
    tables = []
    for file in layout.files:
        tables.append(pq.read_table(layout.fs.open_input_file(file), columns=columns))
    return pa.concat_tables(tables)


def _labels(table: pa.Table, column: str, path: str) -> torch.Tensor:
    if not pa.types.is_integer(table.schema.field(column).type):
        raise ConfigError(f"{path}: label column {column!r} must hold integers")
    labels = torch.tensor(table.column(column).to_numpy(), dtype=torch.long)  # a copy
    if len(labels) == 0:
        raise ConfigError(f"{path} has no rows")
    if int(labels.min()) < 0:
        raise ConfigError(f"{path}: labels must be 0..C-1, found {int(labels.min())}")
    return labels


def _input_column(data: Data) -> str:
    return data.feature_column or data.image_column


def describe(data: Data, target: Target) -> DatasetInfo:
    """Classes (from the label columns), shapes and split sizes. Reads the label column
    only, and for a feature column the first row group's first row."""
    assert data.data_dir is not None
    num_classes = 0
    sizes = []
    feature_dim = None
    for split in ("train", "val"):
        path = split_path(data.data_dir, split)
        _layout(path, [data.label_column, _input_column(data)])
        labels = _labels(_read(path, [data.label_column]), data.label_column, path)
        num_classes = max(num_classes, int(labels.max()) + 1)
        sizes.append(len(labels))
        if data.feature_column:
            layout = SplitLayout(path, [data.feature_column])
            first = layout.read(layout.pieces[0])[0][0]
            if not isinstance(first, list) or not first:
                raise ConfigError(f"{path}: --feature-column must be a list of numbers")
            feature_dim = len(first)
    if data.feature_column:
        if target.model != "mlp":
            raise ConfigError("a Parquet --feature-column needs --model mlp")
        assert feature_dim is not None  # read from the first row above
        shape: tuple[int, ...] = (feature_dim,)
    else:
        size = data.image_size or DEFAULT_FILE_IMAGE_SIZE
        shape = (3, size, size)
    return DatasetInfo(max(num_classes, 2), shape, sizes[0], sizes[1])


class ParquetImages(Dataset):
    """Rows of encoded images, decoded with PIL on access (in DataLoader workers).
    ``layout``: the split's files, to name a row (``sample_name``)."""

    def __init__(
        self,
        images: list[bytes],
        labels: torch.Tensor,
        transform,
        layout: SplitLayout | None = None,
    ) -> None:
        self.images, self.labels, self.transform = images, labels, transform
        self.layout = layout

    def sample_name(self, index: int) -> str:
        """``<file> row <n>`` (the row of its file) for messages and bad_samples.csv."""
        if self.layout is None:
            return f"row {index}"
        pieces = self.layout.pieces
        piece = pieces[bisect.bisect_right([p.first for p in pieces], index) - 1]
        return self.layout.source(piece, index - piece.first)

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


def load(data: Data, target: Target, augment: bool = True) -> tuple[Dataset, Dataset]:
    """The train and validation splits: streamed (``--parquet-read stream``: row groups
    read as the sampler needs them) or read whole into memory."""
    assert data.data_dir is not None
    if data.parquet_read == "stream":
        return stream(data, target, augment)
    from torch.utils.data import TensorDataset

    splits: list[Dataset[Any]] = []
    for train in (True, False):
        path = split_path(data.data_dir, "train" if train else "val")
        table = _read(path, [data.label_column, _input_column(data)])
        labels = _labels(table, data.label_column, path)
        if data.feature_column:
            features = torch.tensor(
                table.column(data.feature_column).to_pylist(), dtype=torch.float32
            )
            splits.append(TensorDataset(features, labels))
        else:
            images = _image_bytes(table.column(data.image_column))
            transform = image_transform(data, target, train=train and augment)
            layout = SplitLayout(path, [data.image_column])  # footers only: names rows
            splits.append(ParquetImages(images, labels, transform, layout))
    return splits[0], splits[1]


def stream(data: Data, target: Target, augment: bool = True) -> tuple[Dataset, Dataset]:
    """Both splits as :class:`~ray_ddp.data.parquet_stream.StreamingParquet` (footers only)."""
    assert data.data_dir is not None
    splits: list[Dataset[Any]] = []
    for train in (True, False):
        path = split_path(data.data_dir, "train" if train else "val")
        layout = _layout(path, [_input_column(data), data.label_column])
        transform = (
            None if data.feature_column else image_transform(data, target, train=train and augment)
        )
        splits.append(StreamingParquet(layout, decoder(not data.feature_column, transform)))
    return splits[0], splits[1]
