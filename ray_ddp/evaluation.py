"""Exact distributed evaluation.

``DistributedSampler`` pads the dataset with repeated samples so every rank gets the same
count; evaluating through it counts those repeats twice. Here each rank takes every
world_size-th sample from its rank on (no padding: ranks may differ by one sample), sums
loss and correct predictions over its share, and one all-reduce of (loss sum, correct,
count) gives figures equal to a single-process evaluation of the same weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Sampler

from ray_ddp.precision import autocast


class ShardSampler(Sampler[int]):
    """Indices rank, rank + world_size, ...: every sample on exactly one rank, in order."""

    def __init__(self, size: int, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.size, self.rank, self.world_size = size, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.size, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world_size))


@dataclass(frozen=True)
class EvalResult:
    loss_sum: float
    correct: int
    count: int

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    @property
    def accuracy(self) -> float:
        return self.correct / self.count if self.count else float("nan")


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device, amp: str = "off") -> EvalResult:
    """Evaluate ``model`` on this rank's share of ``loader`` and sum over all ranks.

    Pass the unwrapped module: evaluation needs no gradient synchronisation, and a plain
    module cannot start a collective that ranks with fewer batches would never join.
    """
    was_training = model.training
    model.eval()
    # float64 sums: exact for counts and stable for the loss whatever the split.
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        with autocast(amp, device):
            logits = model(inputs)
        totals[0] += F.cross_entropy(logits.float(), targets, reduction="sum").double()
        totals[1] += (logits.argmax(dim=1) == targets).sum()
        totals[2] += targets.numel()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    model.train(was_training)
    loss_sum, correct, count = totals.tolist()
    return EvalResult(loss_sum, int(correct), int(count))
