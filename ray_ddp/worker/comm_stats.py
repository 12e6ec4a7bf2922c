"""Counting DDP's gradient all-reduces for real, with a communication hook.

DDP calls the hook once per gradient bucket in every backward pass that synchronises;
``no_sync()`` backward passes call it not at all. Counting the calls on the last bucket
counts synchronising backward passes, however many buckets the model has.
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations at
# registration and needs the real dist.GradBucket / Future objects, not strings.
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook


@dataclass
class AllReduceCounter:
    buckets: int = 0
    """All-reduce calls (one per bucket per synchronising backward)."""
    syncs: int = 0
    """Backward passes whose gradients were all-reduced."""


def _counting_allreduce(
    counter: AllReduceCounter, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    counter.buckets += 1
    if bucket.is_last():
        counter.syncs += 1
    # None: the default (world) process group, which torch's hook takes (not in its types)
    return allreduce_hook(None, bucket)  # type: ignore[arg-type]


def attach_counter(ddp_model: torch.nn.Module) -> AllReduceCounter:
    """Count ``ddp_model``'s all-reduces (a DDP-wrapped model: the hook is DDP's)."""
    assert isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel), type(ddp_model)
    counter = AllReduceCounter()
    ddp_model.register_comm_hook(counter, _counting_allreduce)
    return counter
