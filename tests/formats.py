"""Writers of tiny datasets in the exact on-disk formats the real loaders read."""

from __future__ import annotations

import io
import os
import pickle
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image


def write_cifar10(root: str, per_batch: int = 6, test: int = 5, seed: int = 0) -> dict:
    """cifar-10-batches-py/ with data_batch_1..5, test_batch and batches.meta (pickles of
    uint8 rows of 3072 = 3x32x32, channel-major, as the original Python version)."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder)
    batches = {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = test if name == "test_batch" else per_batch
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n).tolist()
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump({"batch_label": name, "data": data, "labels": labels}, f)
        batches[name] = (data, labels)
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump(
            {"label_names": [f"class{i}" for i in range(10)], "num_cases_per_batch": per_batch}, f
        )
    return batches


def _idx_images(path: str, images: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack(">IIII", 0x00000803, len(images), 28, 28))
        f.write(images.astype(np.uint8).tobytes())


def _idx_labels(path: str, labels: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack(">II", 0x00000801, len(labels)))
        f.write(labels.astype(np.uint8).tobytes())


def write_mnist(root: str, folder: str = "MNIST", train: int = 12, test: int = 7, seed: int = 0):
    """<folder>/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte, uncompressed IDX files."""
    rng = np.random.default_rng(seed)
    raw = os.path.join(root, folder, "raw")
    os.makedirs(raw)
    out = {}
    for prefix, n in (("train", train), ("t10k", test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        _idx_images(os.path.join(raw, f"{prefix}-images-idx3-ubyte"), images)
        _idx_labels(os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), labels)
        out[prefix] = (images, labels)
    return out


def png_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def class_image(label: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """An RGB image whose colour says its class (learnable in one epoch)."""
    base = np.zeros((size, size, 3), dtype=np.uint8)
    base[..., label % 3] = 200
    noise = rng.integers(0, 40, size=base.shape, dtype=np.uint8)
    return base + noise


def write_imagefolder(
    root: str,
    classes=("cat", "dog", "owl"),
    train: int = 8,
    val: int = 3,
    size: int = 20,
    seed: int = 0,
) -> None:
    """train/<class>/*.png and val/<class>/*.png, different sizes and modes mixed in."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", train), ("val", val)):
        for label, name in enumerate(classes):
            folder = os.path.join(root, split, name)
            os.makedirs(folder)
            for i in range(n):
                image = Image.fromarray(class_image(label, size + i % 3, rng))
                if i % 4 == 3:
                    image = image.convert("L")  # a grey file among RGB ones
                image.save(os.path.join(folder, f"{i}.png"))


def write_parquet(
    root: str,
    train: int = 40,
    val: int = 11,
    classes: int = 3,
    size: int = 16,
    features: int = 0,
    seed: int = 0,
    hf_struct: bool = False,
) -> None:
    """train.parquet and val.parquet with a label column and PNG bytes (or features)."""
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    for split, n in (("train", train), ("val", val)):
        labels = rng.integers(0, classes, size=n)
        columns = {"label": pa.array(labels, type=pa.int64())}
        if features:
            vectors = rng.normal(size=(n, features)) + labels[:, None]
            columns["features"] = pa.array(vectors.tolist(), type=pa.list_(pa.float32()))
        else:
            images = [png_bytes(class_image(int(y), size, rng)) for y in labels]
            if hf_struct:
                columns["image"] = pa.array(
                    [{"bytes": b, "path": None} for b in images],
                    type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
                )
            else:
                columns["image"] = pa.array(images, type=pa.binary())
        pq.write_table(pa.table(columns), os.path.join(root, f"{split}.parquet"))


def write_parquet_shards(
    root: str,
    train: int = 300,
    val: int = 50,
    shards: int = 3,
    group_rows: int = 16,
    classes: int = 3,
    size: int = 8,
    seed: int = 0,
) -> dict[str, list[int]]:
    """train/ and val/ folders of ``shards`` Parquet files each, in row groups of
    ``group_rows`` (the Hugging Face layout); returns each split's labels in row order."""
    rng = np.random.default_rng(seed)
    written = {}
    for split, n in (("train", train), ("val", val)):
        folder = os.path.join(root, split)
        os.makedirs(folder, exist_ok=True)
        labels = rng.integers(0, classes, size=n)
        images = [png_bytes(class_image(int(y), size, rng)) for y in labels]
        bounds = [k * n // shards for k in range(shards + 1)]
        for k in range(shards):
            part = slice(bounds[k], bounds[k + 1])
            table = pa.table(
                {"image": pa.array(images[part], pa.binary()), "label": pa.array(labels[part])}
            )
            name = os.path.join(folder, f"{split}-{k:05d}-of-{shards:05d}.parquet")
            pq.write_table(table, name, row_group_size=group_rows)
        written[split] = labels.tolist()
    return written


class SimulatedLayout:
    """A Parquet split's row groups without files: ``sizes[k]`` rows in group ``k`` of
    one file, each row's value its own row number (a ``range``, so a group costs nothing
    to "read"). For ``parquet_stream.StreamingParquet``: streams of a million row groups
    and a billion rows, and counts of the reads."""

    files = ["simulated.parquet"]

    def __init__(self, sizes: list[int] | tuple[int, ...]) -> None:
        from collections import Counter

        from ray_ddp.data.parquet_stream import Piece

        first = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
        self.pieces = [Piece(0, g, 0, int(sizes[g]), s) for g, s in enumerate(first)]
        self.size = int(sum(sizes))
        self.group_bytes = {(0, g): int(n) for g, n in enumerate(sizes)}
        self.reads: Counter = Counter()

    def read(self, piece) -> tuple[range, range]:
        self.reads[piece.group] += 1
        rows = range(piece.first, piece.first + piece.rows)
        return rows, rows

    def source(self, piece, offset: int) -> str:
        return f"simulated.parquet row {piece.first + offset}"
