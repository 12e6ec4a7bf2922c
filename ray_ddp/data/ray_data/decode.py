"""``--data-engine ray``, in Ray Data's tasks: what a split is made of (its items), reading
and decoding them, and handing the rows that cannot be read to the run's actor.

This module is imported (to unpickle a split's Dataset) by Ray Train's controller, its
DatasetManager and Ray Data's split coordinators: it imports neither torch nor torchvision
at the top (~10 s on a 2-core machine); the decode tasks import them.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from ray_ddp.config.sections import Data, Target

if TYPE_CHECKING:
    from ray_ddp.data.unreadable import BadSample

FILES_PER_TASK = 64
"""ImageFolder files one decode call reads."""
ROWS_PER_OUTPUT = 256
"""Decoded rows per output batch of a decode call (bounds Ray Data's block sizes)."""
ACTOR_NAMESPACE = "ray_ddp"

Decoder = Callable[[Any, Any], tuple]
"""``(input, label) -> (tensor, label tensor)``: one row decoded, as the task does it."""
MakeDecoder = Callable[[Data, Target, bool], Decoder]
"""The task's decoder for a split, of the data's and the model's settings (``train``: with
its random augmentation); a function
of a module every node imports (pickled by reference to Ray Data's tasks)."""


def split_items(data: Data, split: str) -> tuple[list[dict[str, Any]], Any]:
    """What a split is made of, cheap to list (Parquet footers, a folder listing):
    ``(items, source)`` where ``source`` is the Parquet split's ``SplitLayout`` (its row
    groups are the items) or the ImageFolder split's root."""
    assert data.data_dir is not None
    if data.dataset == "parquet":
        from ray_ddp.data.parquet_stream import SplitLayout, split_path

        path = split_path(data.data_dir, split)
        layout = SplitLayout(path, [data.feature_column or data.image_column, data.label_column])
        return [{"piece": number} for number in range(len(layout.pieces))], layout
    root = os.path.join(data.data_dir, split)
    items = [
        {"path": path, "label": label, "index": index}
        for index, (path, label) in enumerate(image_folder_files(root))
    ]
    return items, root


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""torchvision's ``IMG_EXTENSIONS`` (0.29), matched without case as it does."""


def image_folder_files(root: str) -> list[tuple[str, int]]:
    """``(path, class index)`` of every image under ``root``'s class folders: the list
    torchvision's ``ImageFolder`` makes (``find_classes`` + ``make_dataset``: sorted class
    folders, each walked in sorted order, links followed), without importing torchvision."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    found = []
    for label, name in enumerate(classes):
        for folder, _, names in sorted(os.walk(os.path.join(root, name), followlinks=True)):
            for file in sorted(names):
                if file.lower().endswith(IMAGE_EXTENSIONS):
                    found.append((os.path.join(folder, file), label))
    return found


def split_size(items: list[dict[str, Any]], source: Any) -> int:
    """Rows of a split (a Parquet split's rows, an ImageFolder split's files)."""
    return int(source.size) if hasattr(source, "size") else len(items)


class Decode:
    """``map_batches`` function: read and decode a batch of items into ``{"input",
    "label"}`` rows with the task's decoder (``make_decoder(data, target, train)``, made in the Ray
    task; ``augmented``: it draws random numbers); rows that cannot be read or decoded
    (``unreadable.is_unreadable``) are left out and handed to ``report(split, records)``."""

    def __init__(
        self, source: Any, data: Data, target: Target, split: str, report: Any,
        make_decoder: MakeDecoder, augmented: bool,
    ) -> None:  # fmt: skip
        self.source, self.data, self.target = source, data, target
        self.split, self.report = split, report
        self.make_decoder, self.augmented = make_decoder, augmented
        self._decode: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_decode": None}  # made where it runs

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        import torch

        from ray_ddp.data.unreadable import BadSample, error_line, is_unreadable

        train = self.split == "train"
        if self._decode is None:
            self._decode = self.make_decoder(self.data, self.target, train)
        bad: list[BadSample] = []
        with torch.random.fork_rng(devices=[]):
            if train and self.augmented:  # a fresh draw per call (not reproducible)
                torch.default_generator.manual_seed(int.from_bytes(os.urandom(8), "little"))
            good: list[tuple] = []
            for index, name, read in self._rows(batch):
                try:
                    good.append(self._decode(*read()))
                except Exception as exc:
                    if not is_unreadable(exc):
                        raise
                    bad.append(BadSample(index, name(), error_line(exc)))
                if len(good) >= ROWS_PER_OUTPUT:
                    yield _stacked(good)
                    good = []
            if good:
                yield _stacked(good)
        if bad and self.report is not None:
            self.report(self.split, bad)

    def _rows(self, batch: dict[str, np.ndarray]) -> Iterator[tuple[int, Any, Any]]:
        """``(index in the split, name(), read())`` per row; ``read()`` gives ``(input,
        label)``, ``name()`` where the row is (``<file> row <n>``, or the file)."""
        if "piece" in batch:  # Parquet: whole row groups
            layout = self.source
            for number in batch["piece"]:
                piece = layout.pieces[int(number)]
                inputs, labels = layout.read(piece)
                for offset, (value, label) in enumerate(zip(inputs, labels, strict=True)):
                    yield (
                        piece.first + offset,
                        lambda p=piece, o=offset: layout.source(p, o),
                        lambda v=value, y=label: (v, y),
                    )
            return
        for path, label, index in zip(batch["path"], batch["label"], batch["index"], strict=True):
            path = str(path)
            yield int(index), lambda p=path: p, lambda p=path, y=int(label): (_read_file(p), y)


def _read_file(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def _stacked(samples: list[tuple]) -> dict[str, np.ndarray]:
    import torch

    return {
        "input": torch.stack([s[0] for s in samples]).numpy(),
        "label": torch.stack([torch.as_tensor(s[1]) for s in samples]).to(torch.int64).numpy(),
    }


def warm_up(module: str) -> None:
    """Imports what the decode tasks use (Ray reuses the process for them): the reader and
    the decoder's ``module``."""
    import ray_ddp.data.parquet_stream  # noqa: F401

    importlib.import_module(module)


class UnreadableRows:
    """Records of rows Ray Data's tasks could not read, per split, until rank 0 takes
    them (a named actor per run: :func:`unreadable_actor`)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[BadSample]] = {"train": [], "val": []}

    def add(self, split: str, records: list[BadSample]) -> None:
        self.rows[split].extend(records)

    def take(self, split: str) -> list[BadSample]:
        rows, self.rows[split] = self.rows[split], []
        return rows


def actor_name(run_dir: str) -> str:
    return "ray_ddp_unreadable_" + hashlib.sha1(run_dir.encode()).hexdigest()[:16]


def unreadable_actor(run_dir: str, create: bool = False):
    """The :class:`UnreadableRows` actor of the run in ``run_dir`` (created where
    ``create``; owned by the process that creates it: Ray Train's controller, for the
    run's length)."""
    if create:
        return (
            ray.remote(UnreadableRows)
            .options(
                name=actor_name(run_dir), namespace=ACTOR_NAMESPACE, get_if_exists=True, num_cpus=0
            )
            .remote()
        )
    return ray.get_actor(actor_name(run_dir), namespace=ACTOR_NAMESPACE)


class Reporter:
    """``report(split, records)`` for the decode tasks: waits until the actor has them, so
    a pass that has ended has reported all of its rows."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def __call__(self, split: str, records: list[BadSample]) -> None:
        ray.get(self.actor.add.remote(split, records))
