"""Whether a checkpoint's position inside an epoch can be continued on today's data and
flags (no torch, no Ray).

A position inside an epoch is a number of samples of that epoch's order
(``global_order``): the rest of the epoch is the order from there. That holds only while
the order is the one the position was counted in. It is decided by:

- the training split: its size, and which files (and row groups) make it. Parquet shards
  added to the folder or bucket renumber the rows, so the old position would train some
  rows twice and others never; a smaller split would not even fit the old order;
- the seed (both orders);
- for a streamed Parquet split, also how the order is cut (``streaming``): the per-worker
  batch, the global batch (its lanes) and ``--shuffle-buffer``. The in-memory permutation
  does not depend on them, so there they may change inside an epoch.

A checkpoint records these (:func:`order_record`); a resume inside an epoch compares them
(:func:`order_change`) and is refused, in one line, where they differ, unless
``--restart-epoch`` starts the epoch over. At an epoch boundary nothing is refused: the
next epoch's order is made from today's data and flags.

The record also names how the order was made (``global_order.ORDER_VERSION``, or
``streaming.STREAMED_VERSION`` for a streamed split; a record without one, or none at all,
is of the first: ``torch.randperm``, or for a streamed split the whole-list order of
``streaming.streaming_order``, which versions 1 and 2 share): an epoch a checkpoint of an
older version stopped inside is finished in that version's order (:func:`saved_version`),
and the epochs after it take today's. Keeping the old order for the rest of one epoch
costs what it always did (one permutation held), and the run is neither stopped nor
moved to another order mid-epoch, which would train some samples twice and others never.
"""

from __future__ import annotations

import hashlib
from typing import Any


def split_fingerprint(dataset: Any) -> str | None:
    """A cheap digest of which files (and Parquet row groups) make a split, from what the
    dataset already knows: a Parquet split's ``layout`` (files, row groups and their rows),
    an ImageFolder's ``samples`` (paths); None for a dataset that says neither (its size
    is still compared)."""
    layout = getattr(dataset, "layout", None)
    if layout is not None and hasattr(layout, "files") and hasattr(layout, "pieces"):
        parts = [*map(str, layout.files), *(f"{p.file}:{p.group}:{p.rows}" for p in layout.pieces)]
    elif isinstance(getattr(dataset, "samples", None), list):
        parts = [str(s[0]) if isinstance(s, tuple) else str(s) for s in dataset.samples]
    else:
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def order_record(plan: Any, fingerprint: str | None) -> dict[str, Any]:
    """What decides the epoch order of ``plan`` (``global_order.EpochPlan``), for a
    checkpoint."""
    return {
        "size": plan.size,
        "files": fingerprint,
        "seed": plan.seed,
        "streamed": plan.pieces is not None,
        "batch_size": plan.batch_size,
        "global_batch": plan.global_batch,
        "buffer": plan.buffer,
        "version": plan.version,
    }


def saved_version(saved: dict[str, Any] | None) -> int:
    """The order version a checkpoint's position counts in (see the module docstring)."""
    from ray_ddp.data.order.global_order import RANDPERM_VERSION

    return (saved or {}).get("version", RANDPERM_VERSION)


def order_change(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """What differs between a checkpoint's order record and today's that makes its
    position inside an epoch name other samples (None: it can be continued)."""
    if saved["size"] != now["size"]:
        return f"the training split has {now['size']} samples, the checkpoint's had {saved['size']}"
    if saved["files"] != now["files"] and None not in (saved["files"], now["files"]):
        return "the training split's files are not the checkpoint's (same size, other files)"
    if saved["seed"] != now["seed"]:
        return f"--seed {now['seed']}, the checkpoint's was {saved['seed']}"
    if saved["streamed"] != now["streamed"]:
        return "the split is read another way (--parquet-read) than the checkpoint's"
    if not now["streamed"]:
        return None
    cut = ("batch_size", "global_batch", "buffer")
    if all(saved[k] == now[k] for k in cut):
        return None
    return (
        "a streamed order is cut by the per-worker batch, the global batch and the shuffle "
        f"buffer: the checkpoint's were {saved['batch_size']}, {saved['global_batch']} and "
        f"{saved['buffer']}, today's are {now['batch_size']}, {now['global_batch']} and "
        f"{now['buffer']}"
    )
