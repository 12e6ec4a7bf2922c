"""Parquet splits read a few row groups at a time (``--parquet-read stream``).

A split is its files (one file, or a folder of shards, local or behind a pyarrow URI such
as ``s3://bucket/data/train?endpoint_override=...``) and their row groups, known from the
files' footers alone. Nothing else is read until a loader asks:

- :class:`SplitLayout`: the files and row groups, each group's place in the split's row
  numbering, and reading one group's columns;
- :class:`StreamingParquet`: the split as a dataset that decodes rows it is handed
  (:class:`FetchedRow`, read by the sampler), not rows it looks up by number;
- :class:`RowStream`: reads the row groups a sequence of batches needs, in the order they
  are first needed, on a background thread (pyarrow reads and decompresses without the
  GIL), keeping only the groups still to be used plus ``READ_AHEAD`` more, planned a few
  batches ahead as the batches come (never the whole pass: its memory does not grow with
  the rows).

Which rows a rank trains, in which order, is the business of ``ray_ddp.data.order.global_order``
(with ``ray_ddp.data.order.streaming`` for the two-level shuffle); this module only turns a
sequence of row numbers into their values with bounded memory. See docs/data.md, "Data
larger than memory", for the bound as a formula.
"""

from __future__ import annotations

import io
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ray_ddp.config import ConfigError

if TYPE_CHECKING:  # a map-style dataset to torch; not imported to run (Ray Data's decoders)
    from torch.utils.data import Dataset

    _Dataset = Dataset[Any]
else:
    _Dataset = object

READ_AHEAD = 2
"""Row groups a stream reads beyond those the current batch needs (hides read latency)."""


def split_path(data_dir: str, split: str) -> str:
    """``<data_dir>/<split>.parquet`` or the folder ``<data_dir>/<split>/``, on local disk
    or behind a pyarrow URI (``s3://``, ``gs://``)."""
    from ray_ddp.io.storage import exists, join

    for candidate in (join(data_dir, f"{split}.parquet"), join(data_dir, split)):
        if exists(candidate):
            return candidate
    raise ConfigError(
        f"parquet needs {data_dir}/{split}.parquet or a {data_dir}/{split}/ folder of Parquet files"
    )


@dataclass(frozen=True)
class FetchedRow:
    """One row as the sampler read it, handed to the dataset to decode."""

    index: int
    """Its row number in the split (0-based over the split's files in order)."""
    values: tuple
    """(input, label): encoded image bytes or a feature list, and the integer label."""
    source: str
    """Where it came from, for messages: ``<file> row <n>`` (row of that file)."""

    def __index__(self) -> int:
        return self.index


@dataclass(frozen=True)
class Piece:
    """Rows ``[begin, begin + rows)`` of one row group: what a split (or a subset of it)
    is made of; ``first`` is the piece's first row number in the split."""

    file: int
    group: int
    begin: int
    rows: int
    first: int


class SplitLayout:
    """The files and row groups of a Parquet split, from their footers."""

    def __init__(self, location: str, columns: Sequence[str]) -> None:
        import pyarrow.parquet as pq

        from ray_ddp.io.storage import filesystem

        self.location, self.columns = location, list(columns)
        self.fs, path = filesystem(location)
        self.files = _parquet_files(self.fs, path, location)
        pieces: list[Piece] = []
        self.group_bytes: dict[tuple[int, int], int] = {}  # (file, group) -> uncompressed
        first = 0
        for number, file in enumerate(self.files):
            try:
                meta = pq.ParquetFile(self.fs.open_input_file(file)).metadata
            except OSError as exc:  # pyarrow's ArrowInvalid is an OSError... and a ValueError
                raise ConfigError(f"cannot read the Parquet footer of {file}: {exc}") from exc
            for group in range(meta.num_row_groups):
                rows = meta.row_group(group).num_rows
                if rows:
                    pieces.append(Piece(number, group, 0, rows, first))
                    self.group_bytes[(number, group)] = meta.row_group(group).total_byte_size
                    first += rows
        self.pieces = pieces
        self.size = first
        self._open: dict[int, Any] = {}
        self._reading = threading.Lock()

    def subset(self, limit: int, seed: int) -> list[Piece]:
        """A seeded subset of ``limit`` rows made of whole row groups (a random choice of
        groups, the last one cut), renumbered from 0: cheap to stream, unlike a random
        choice of rows, which would touch every group."""
        order = np.random.default_rng(seed).permutation(len(self.pieces))
        chosen, first = [], 0
        for number in order:
            piece = self.pieces[number]
            rows = min(piece.rows, limit - first)
            chosen.append(Piece(piece.file, piece.group, piece.begin, rows, first))
            first += rows
            if first >= limit:
                break
        return chosen

    def read(self, piece: Piece) -> tuple[list, list]:
        """The piece's columns, as Python lists (input values, labels)."""
        import pyarrow.parquet as pq

        with self._reading:  # an abandoned pass's reader may still be finishing a read
            handle = self._open.get(piece.file)
            if handle is None:
                handle = pq.ParquetFile(self.fs.open_input_file(self.files[piece.file]))
                self._open[piece.file] = handle
            table = handle.read_row_group(piece.group, columns=self.columns)
        table = table.slice(piece.begin, piece.rows)
        return [table.column(c).to_pylist() for c in self.columns]  # type: ignore[return-value]

    def source(self, piece: Piece, offset: int) -> str:
        """``<file> row <n>``: where row ``offset`` of ``piece`` sits in its file."""
        return f"{self.files[piece.file]} row {self.file_row(piece) + piece.begin + offset}"

    def file_row(self, piece: Piece) -> int:
        """The row of its file where the piece's row group starts."""
        if not hasattr(self, "_group_starts"):
            starts: dict[tuple[int, int], int] = {}
            per_file: dict[int, int] = {}
            for p in self.pieces:
                starts[(p.file, p.group)] = per_file.get(p.file, 0)
                per_file[p.file] = per_file.get(p.file, 0) + p.rows
            self._group_starts = starts
        return self._group_starts[(piece.file, piece.group)]

    def __getstate__(self) -> dict[str, Any]:  # open files stay in the process that opened them
        return {k: v for k, v in self.__dict__.items() if k not in ("_open", "_reading")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _open={}, _reading=threading.Lock())


def _parquet_files(fs, path: str, location: str) -> list[str]:
    import pyarrow.fs

    info = fs.get_file_info(path)
    if info.type == pyarrow.fs.FileType.File:
        return [path]
    if info.type != pyarrow.fs.FileType.Directory:
        raise ConfigError(f"no Parquet file or folder at {location}")
    found = fs.get_file_info(pyarrow.fs.FileSelector(path, recursive=True))
    files = sorted(
        f.path
        for f in found
        if f.type == pyarrow.fs.FileType.File
        and f.path.endswith(".parquet")
        and not f.base_name.startswith((".", "_"))
    )
    if not files:
        raise ConfigError(f"{location} holds no .parquet files")
    return files


class StreamingParquet(_Dataset):
    """A Parquet split as a dataset of rows the sampler reads: ``dataset[row]`` decodes a
    :class:`FetchedRow` (``len`` is the split's rows). Rows are looked up by the stream,
    never by number, so holding this object costs only the split's footers."""

    def __init__(self, layout: SplitLayout, decode, pieces: list[Piece] | None = None) -> None:
        self.layout, self.decode = layout, decode
        self.pieces = pieces if pieces is not None else layout.pieces
        self.starts = np.array([p.first for p in self.pieces], dtype=np.int64)
        self.size = sum(p.rows for p in self.pieces)

    def __len__(self) -> int:
        return self.size

    def limited(self, limit: int | None, seed: int) -> StreamingParquet:
        """A seeded subset of ``limit`` rows (``--train-samples``), whole row groups."""
        if not limit or limit >= self.size:
            return self
        return StreamingParquet(self.layout, self.decode, self.layout.subset(limit, seed))

    def __getitem__(self, row: FetchedRow | int) -> Any:
        if not isinstance(row, FetchedRow):
            row = self.fetch(int(row))
        return self.decode(*row.values)

    def fetch(self, index: int) -> FetchedRow:
        """Row ``index`` read on its own: its whole row group is read (the last one is
        kept), so this is for a few rows (checks, examples); loaders stream."""
        if not 0 <= index < self.size:
            raise IndexError(f"row {index} of a split of {self.size}")
        number = int(self.pieces_of(np.asarray([index]))[0])
        if getattr(self, "_last", (None,))[0] != number:
            self._last = (number, self.layout.read(self.pieces[number]))
        inputs, labels = self._last[1]
        offset = index - int(self.starts[number])
        source = self.layout.source(self.pieces[number], offset)
        return FetchedRow(index, (inputs[offset], labels[offset]), source)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_last"}

    def piece_sizes(self) -> tuple[int, ...]:
        return tuple(p.rows for p in self.pieces)

    def pieces_of(self, rows: np.ndarray) -> np.ndarray:
        """The piece each row number is in."""
        return np.searchsorted(self.starts, rows, side="right") - 1

    def stream(self, batches: Iterable[Sequence[int]], horizon: int = 1) -> RowStream:
        return RowStream(self, batches, horizon)


class RowStream:
    """Iterates ``batches`` (lists of row numbers, read as they are needed) as lists of
    :class:`FetchedRow`, reading row groups on a background thread in the order the
    batches first need them. It plans as it goes, never the whole pass: it looks
    ``horizon`` batches past the current one, keeps a group while a batch there still
    needs it, and drops it otherwise (read again should a later batch need it: the
    streamed order's ``horizon`` makes that rare, see ``StreamedBatches.horizon``). It
    reads a group first needed by a later batch only while fewer than ``READ_AHEAD`` such
    are held, so it holds at most the groups live at a batch (needed at or before it and
    at or after it) plus ``READ_AHEAD``; its memory besides is the look-ahead's rows."""

    def __init__(
        self, dataset: StreamingParquet, batches: Iterable[Sequence[int]], horizon: int = 1
    ) -> None:
        self.dataset, self.batches, self.horizon = dataset, batches, max(1, horizon)
        self.held = 0
        """The most row groups held at once so far."""
        self._cache: dict[int, tuple[list, list]] = {}
        self._uses: dict[int, int] = {}  # group -> batches of the look-ahead that need it
        self._wanted: deque[tuple[int, int]] = deque()  # (group, first batch) to read
        self._first: dict[int, int] = {}  # a group read or to read -> its first batch
        self._current = 0  # the batch being handed out
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._changed = threading.Condition()

    def _may_read(self) -> bool:
        """The next wanted group is for the current batch, or few are read ahead."""
        if not self._wanted:
            return False
        early = sum(1 for g in self._cache if self._first[g] > self._current)
        return self._wanted[0][1] <= self._current or early < READ_AHEAD

    def _read_all(self) -> None:
        try:
            while True:
                with self._changed:
                    while not self._may_read() and not self._stop.is_set():
                        self._changed.wait(1.0)
                    if self._stop.is_set():
                        return
                    number = self._wanted.popleft()[0]
                values = self.dataset.layout.read(self.dataset.pieces[number])
                with self._changed:
                    self._cache[number] = values
                    self.held = max(self.held, len(self._cache))
                    self._changed.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            with self._changed:
                self._error = exc
                self._changed.notify_all()

    def _group(self, number: int) -> tuple[list, list]:
        with self._changed:
            while number not in self._cache:
                if self._error is not None:
                    piece = self.dataset.pieces[number]
                    raise RuntimeError(
                        f"reading {self.dataset.layout.files[piece.file]} row group "
                        f"{piece.group}: {self._error}"
                    ) from self._error
                self._changed.wait(1.0)
            return self._cache[number]

    def _plan(self, number: int, batch: Sequence[int]) -> list[int]:
        """Batch ``number`` enters the look-ahead: the groups it needs (sorted), a use
        each, and those not held or wanted yet are wanted from it on."""
        needs = sorted(set(self.dataset.pieces_of(np.asarray(batch, dtype=np.int64)).tolist()))
        with self._changed:
            for g in needs:
                self._uses[g] = self._uses.get(g, 0) + 1
                if self._uses[g] == 1:
                    self._wanted.append((g, number))
                    self._first[g] = number
            self._changed.notify_all()
        return needs

    def _done_with(self, needs: list[int]) -> None:
        """The current batch is handed out: a group no batch of the look-ahead needs is
        dropped."""
        with self._changed:
            for g in needs:
                self._uses[g] -= 1
                if not self._uses[g]:
                    del self._uses[g], self._cache[g], self._first[g]
            self._current += 1
            self._changed.notify_all()

    def _rows(self, batch: Sequence[int], needs: list[int]) -> list[FetchedRow]:
        dataset, starts = self.dataset, self.dataset.starts
        groups = {g: self._group(g) for g in needs}
        rows = []
        for row in batch:
            g = int(np.searchsorted(starts, row, side="right") - 1)
            offset = row - int(starts[g])
            inputs, labels = groups[g]
            piece = dataset.pieces[g]
            rows.append(
                FetchedRow(row, (inputs[offset], labels[offset]),
                           dataset.layout.source(piece, offset))
            )  # fmt: skip
        return rows

    def __iter__(self) -> Iterator[list[FetchedRow]]:
        reader = threading.Thread(target=self._read_all, name="parquet-stream", daemon=True)
        reader.start()
        source, planned = iter(self.batches), 0
        ahead: deque[tuple[Any, Any]] = deque()
        try:
            while True:
                while len(ahead) <= self.horizon:  # the current batch and `horizon` more
                    batch = next(source, None)
                    if batch is None:
                        break
                    ahead.append((batch, self._plan(planned, batch)))
                    planned += 1
                if not ahead:
                    return
                batch, needs = ahead.popleft()
                rows = self._rows(batch, needs)
                self._done_with(needs)
                yield rows
        finally:
            self._stop.set()  # an abandoned pass (a checkpoint break) stops its reader
            with self._changed:
                self._changed.notify_all()


def decoder(image: bool, transform) -> Any:
    """The function turning a row's (input, label) into a sample."""
    if image:
        return _ImageDecoder(transform)
    return _feature_sample


class _ImageDecoder:
    def __init__(self, transform) -> None:
        self.transform = transform

    def __call__(self, data: Any, label: int) -> tuple:
        import torch
        from PIL import Image

        if isinstance(data, dict):  # Hugging Face: {"bytes": ..., "path": ...}
            data = data.get("bytes")
        if not isinstance(data, bytes | bytearray):
            raise ValueError(f"an image cell holds {type(data).__name__}, not encoded bytes")
        return self.transform(Image.open(io.BytesIO(data))), torch.tensor(label)


def _feature_sample(data: Any, label: int) -> tuple:
    import torch

    return torch.tensor(data, dtype=torch.float32), torch.tensor(label)
