"""The few collectives the loop needs, written once (no Ray: torch.distributed only).

Every function works unchanged in a single process (no process group, or a group of
one), so the epoch loop and evaluation run the same code on one worker and on many.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """Whether there are other ranks to talk to."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (any picklable value), in rank order."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def sum_over_ranks(
    values: dict[str, float | torch.Tensor], device: torch.device
) -> dict[str, float]:
    """Each named value summed over all ranks, in one all-reduce (float64: exact for
    counts up to 2**53 and stable for sums of losses)."""
    names = list(values)
    totals = torch.stack(
        [torch.as_tensor(values[n], dtype=torch.float64, device=device) for n in names]
    )
    if is_distributed():
        dist.all_reduce(totals)
    return dict(zip(names, totals.tolist(), strict=True))


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Every rank takes rank ``src``'s buffers (BatchNorm running statistics)."""
    if is_distributed():
        for buffer in module.buffers():
            dist.broadcast(buffer, src)
