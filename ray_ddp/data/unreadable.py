"""Unreadable samples: skipped, counted per epoch and named, up to ``--max-bad-samples``.

A truncated PNG or undecodable bytes in a Parquet row used to end the whole run with a
traceback from every worker (and ``--max-failures`` retried it into the same sample).
Now such a sample is left out of its batch, named in ``<run>/bad_samples.csv``, and the
run goes on; more of them in an epoch than ``--max-bad-samples`` (all ranks, both splits)
stops every rank with one line naming the first of them, which is never retried.

How a bad sample travels (no Ray here: torch.distributed only, like the epoch loop):

1. :class:`SkipUnreadable` wraps the dataset a DataLoader reads. A fetch that fails with a
   read or decode error (:func:`is_unreadable`) returns a :class:`BadSample` record (the
   split's index, a name, the error in one line) instead of the sample, in the process
   that fetched it (a DataLoader worker: the traceback is still there to classify the
   error). Any other error (a bug in the task's code) propagates as before.
2. :class:`SkipUnreadableCollate` wraps the task's ``collate``: records are taken out and
   only the good samples reach the task's collate. A batch that lost any travels as
   ``{SKIPPED: [records], BATCH: batch or None}``: a dict keeps its keys through Ray's
   device move (``prepare_data_loader``), which moves the batch and leaves the records
   alone. A batch without bad samples is the task's batch itself, at no cost.
3. :func:`take_skipped` splits that again in the training loop and in evaluation.
4. :class:`SkipLog` keeps a rank's records of the epoch; :func:`settle` gathers every
   rank's, rank 0 appends them to ``bad_samples.csv``, and every rank stops together when
   the epoch is over the cap. A rank whose own records already exceed it stops at once.

What is unreadable (a narrow set; anything else fails loudly, as a bug should):

- any ``OSError`` raised while fetching the sample: PIL's ``UnidentifiedImageError`` (not
  an image, garbage bytes), "image file is truncated", "broken data stream", a file gone
  or unreadable (``FileNotFoundError``, ``PermissionError``). A task's own dataset marks a
  sample unreadable by raising an ``OSError``;
- ``SyntaxError``, ``ValueError``, ``EOFError``, ``struct.error``, ``zlib.error`` and
  ``DecompressionBombError`` raised *inside PIL* (broken PNG chunks, a truncated header, a
  corrupt header claiming billions of pixels). Raised by the task's own code, those
  types are bugs and fail the run.

PIL's ``ImageFile.LOAD_TRUNCATED_IMAGES`` stays False: a truncated image is an error
here, never a silently grey-padded sample.
"""

from __future__ import annotations

import csv
import io
import operator
import re
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import Dataset, Subset

from ray_ddp.io.storage import join, read_text, write_bytes

BAD_SAMPLES_CSV = "bad_samples.csv"
CSV_HEADER = ("epoch", "split", "rank", "sample", "error")
SKIPPED = "__ray_ddp_unreadable_samples__"
"""The key of a shortened batch's records (no task's batch has it)."""
BATCH = "__ray_ddp_batch__"
"""The key of a shortened batch's good samples, collated (None if there were none)."""
SHOWN = 3
"""Offenders a stop line names (the rest are counted, and in bad_samples.csv)."""
ERROR_CHARS = 200

_DECODER_ERRORS = (SyntaxError, ValueError, EOFError, struct.error, zlib.error)


class BadSamplesError(RuntimeError):
    """More unreadable samples than ``--max-bad-samples`` allows (or a micro-batch of
    nothing else): a restart would meet them again, so the run stops (not retried)."""


@dataclass(frozen=True)
class BadSample:
    """A sample that could not be read (not a tuple or a mapping: Ray's device move and
    torch's pin_memory leave it as it is)."""

    index: int
    """Its index in the split (a streamed Parquet split's row number)."""
    name: str
    """Where it is: the file, ``<file> row <n>`` for Parquet, else ``<Dataset>[<i>]``."""
    error: str
    """``<type>: <message>``, one line."""


# ----------------------------------------------------------------- classification
def is_unreadable(error: BaseException) -> bool:
    """A read or decode error of the sample's data (see the module's docstring), not a bug."""
    if isinstance(error, OSError):
        return True
    if isinstance(error, _DECODER_ERRORS) or type(error).__name__ == "DecompressionBombError":
        return _raised_in_pil(error)
    return False


def _raised_in_pil(error: BaseException) -> bool:
    """The innermost Python frame of ``error``'s traceback is PIL's (zlib and struct are
    C code called from there)."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    return module == "PIL" or module.startswith("PIL.")


def error_line(error: BaseException) -> str:
    """``<type>: <first line of the message>``, at most ``ERROR_CHARS`` characters."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    text = re.sub(r" ?<_io\.\w+ object at 0x[0-9a-fA-F]+>", "", text)  # PIL names its buffer
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


# ----------------------------------------------------------------- naming
def sample_name(dataset: Any, key: Any) -> str:
    """Where sample ``key`` of ``dataset`` comes from, for a person: a streamed row's
    ``source``; else, through ray_ddp's wrappers (which keep the index) and torch's
    ``Subset`` (which maps it), the first of: the dataset's own ``sample_name(index)``
    (Parquet in memory: file and row), an ImageFolder's file path, ``<Dataset>[<index>]``."""
    part = key[-1] if isinstance(key, tuple) else key  # (epoch, index) when augmented
    source = getattr(part, "source", None)
    if isinstance(source, str):
        return source
    index = operator.index(part)
    while True:
        named = getattr(dataset, "sample_name", None)
        if callable(named):
            return str(named(index))
        if isinstance(dataset, Subset):
            index = int(dataset.indices[index])
            dataset = dataset.dataset
            continue
        samples = getattr(dataset, "samples", None)
        if isinstance(samples, list) and index < len(samples):  # torchvision's DatasetFolder
            entry = samples[index]
            if isinstance(entry, tuple) and entry and isinstance(entry[0], str):
                return entry[0]
        inner = getattr(dataset, "dataset", None)
        if inner is None or not type(dataset).__module__.startswith("ray_ddp."):
            return f"{type(dataset).__name__}[{index}]"  # a wrapper of the task's may remap
        dataset = inner


def split_index(key: Any) -> int:
    """The split's index in a DataLoader key: ``i``, ``(epoch, i)``, or a streamed row."""
    return operator.index(key[-1] if isinstance(key, tuple) else key)


# ----------------------------------------------------------------- the loader's side
class SkipUnreadable(Dataset):
    """``dataset``, where a sample that cannot be read is a :class:`BadSample` record."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        try:
            return self.dataset[key]
        except Exception as exc:
            if not is_unreadable(exc):
                raise
            return BadSample(split_index(key), sample_name(self.dataset, key), error_line(exc))

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        """A micro-batch at once where the dataset makes one (the built-in data does);
        sample by sample otherwise, or where one of them is unreadable (to name it)."""
        many = getattr(self.dataset, "__getitems__", None)
        if many is not None:
            try:
                return many(keys)
            except Exception as exc:
                if not is_unreadable(exc):
                    raise
        return [self[key] for key in keys]


class SkipUnreadableCollate:
    """The task's ``collate`` over the good samples; records ride along (module docstring)."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: list[Any]) -> Any:
        bad = [s for s in samples if isinstance(s, BadSample)]
        if not bad:
            return self.collate(samples)
        good = [s for s in samples if not isinstance(s, BadSample)]
        return {SKIPPED: bad, BATCH: self.collate(good) if good else None}


def take_skipped(item: Any) -> tuple[Any, list[BadSample]]:
    """``(batch, records)`` of what a loader yielded: the batch is None when every sample
    of it was unreadable; the records are empty for a whole batch."""
    if isinstance(item, dict) and SKIPPED in item:
        return item[BATCH], list(item[SKIPPED])
    return item, []


# ----------------------------------------------------------------- the epoch's count
@dataclass
class SkipLog:
    """One rank's unreadable training samples of the current epoch (a new one each epoch).
    ``cap`` None: no limit (a loop run outside a training run)."""

    cap: int | None = None
    rank: int = 0
    epoch: int = 0
    """0-based."""
    rows: list[BadSample] = field(default_factory=list)
    gathered: int = 0
    """Of ``rows``, those already gathered by :func:`settle`."""
    total: int = 0
    """All ranks' training records of the epoch gathered so far."""
    first: list[tuple[int, BadSample]] = field(default_factory=list)
    """The epoch's first gathered records, (rank, record), for a stop line."""

    def add(self, bad: Sequence[BadSample]) -> None:
        """Records of a micro-batch this rank trained. Raises BadSamplesError when they
        alone take the epoch over the cap (the other ranks' are not known here: what was
        gathered so far plus this rank's own is a lower bound of the epoch's total)."""
        self.rows.extend(bad)
        own = len(self.rows) - self.gathered
        if self.cap is None or self.total + own <= self.cap:
            return
        head = f"rank {self.rank} met {count_text(own)} in epoch {self.epoch + 1}"
        if self.total:
            head += f" after {self.total} gathered from all ranks"
        mine = [(self.rank, b) for b in self.rows[self.gathered :]]
        raise BadSamplesError(stop_line(head, self.cap, mine, own, ranks=False))


def count_text(n: int) -> str:
    """``n unreadable sample(s)``."""
    return f"{n} unreadable sample{'' if n == 1 else 's'}"


def stop_line(
    head: str,
    cap: int,
    named: Sequence[tuple[int, BadSample]],
    count: int,
    csv: str | None = None,
    ranks: bool = True,
) -> str:
    """The one line a run stops with: ``head`` (how many, where), the cap, the first
    offenders by name (of ``named``: (rank, record); the rank shown if ``ranks``), how
    many more, and the file."""
    shown = ", ".join(
        f"{b.name} ({b.error}{f'; rank {r}' if ranks else ''})" for r, b in named[:SHOWN]
    )
    rest = count - len(named[:SHOWN])
    more = f" and {rest} more" if rest > 0 else ""
    listed = f"; all are named in {csv}" if csv else ""
    return (
        f"{head}, over --max-bad-samples {cap}: {shown}{more}{listed}. Fix or remove "
        "them, or raise --max-bad-samples"
    )


def append_rows(run_dir: str, epoch: int, rows: Sequence[tuple[str, int, BadSample]]) -> None:
    """Append ``(split, rank, record)`` rows of epoch ``epoch`` (1-based) to the run's
    ``bad_samples.csv`` (a local path or a URI; the file is rewritten whole, as
    ``attempts.csv`` is, so earlier epochs' and attempts' rows stay)."""
    path = join(run_dir, BAD_SAMPLES_CSV)
    text = read_text(path) or ",".join(CSV_HEADER) + "\n"
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for split, rank, record in rows:
        writer.writerow([epoch, split, rank, record.name, record.error])
    write_bytes(path, (text + out.getvalue()).encode())


def rewind_rows(run_dir: str, keep: int | None) -> tuple[int, int]:
    """Keep the first ``keep`` rows of the run's ``bad_samples.csv`` (all if None): the
    rows a resumed checkpoint had seen written. Returns (rows kept, rows dropped)."""
    path = join(run_dir, BAD_SAMPLES_CSV)
    text = read_text(path)
    rows = list(csv.reader(io.StringIO(text)))[1:] if text else []
    if keep is None or keep >= len(rows):
        return len(rows), 0
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([list(CSV_HEADER), *rows[:keep]])
    write_bytes(path, out.getvalue().encode())
    return keep, len(rows) - keep


def read_rows(run_dir: str) -> list[dict[str, str]]:
    """The rows of a run's ``bad_samples.csv`` (empty if it has none)."""
    text = read_text(join(run_dir, BAD_SAMPLES_CSV))
    return list(csv.DictReader(io.StringIO(text))) if text else []


def skipped_line(
    epoch: int, train: int, val: int, evaluated: int, val_size: int, run_dir: str
) -> str:
    """Rank 0's line on an epoch that skipped samples (what its figures then cover)."""
    return (
        f"epoch {epoch + 1}: skipped {count_text(train + val)} ({train} train, "
        f"{val} val), each named in {join(run_dir, BAD_SAMPLES_CSV)}; the training "
        f"loss and the validation metrics cover the samples that were read ({evaluated} of "
        f"{val_size} val)"
    )


def message_of(error: BaseException) -> str | None:
    """The stop line, if ``error`` is a BadSamplesError (or a relayed traceback of one)."""
    if isinstance(error, BadSamplesError):
        return str(error)
    for line in str(error).splitlines():
        if f"{BadSamplesError.__name__}: " in line:
            return line.split(f"{BadSamplesError.__name__}: ", 1)[1]
    return None
