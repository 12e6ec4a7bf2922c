"""A task's batches: whatever ``collate`` makes (tensors, or tuples, lists and dicts of
them), and the two things ray_ddp does to one without knowing its shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Batch = Any
"""What ``collate`` makes of a list of samples: a tensor, or tuples/lists/dicts of them.
Ray moves it to the worker's device before ``loss`` and ``metrics`` see it (a namedtuple
arrives as a plain tuple)."""


def map_tensors(batch: Batch, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    """``batch`` with ``fn`` applied to every tensor in it (nested in tuples, namedtuples,
    lists and dicts); anything else is kept as it is."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def first_tensor(batch: Batch) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, dict) else batch
    if isinstance(values, (list, tuple)) or isinstance(batch, dict):
        for value in values:
            found = first_tensor(value)
            if found is not None:
                return found
    return None
