"""Exact distributed evaluation (no Ray: torch.distributed only).

``DistributedSampler`` pads the dataset with repeated samples so every rank gets the same
count; evaluating through it counts those repeats twice. Here each rank takes every
world_size-th sample from its rank on (no padding: ranks may differ by one sample), sums
loss and correct predictions over its share, and one all-reduce of the sums gives figures
equal to a single-process evaluation of the same weights. The training loop's validation
and ``jobs/evaluate.py`` both use :func:`evaluate`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Sampler

from ray_ddp.collectives import all_gather, is_distributed
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

    def global_index(self, position: int) -> int:
        """The dataset index of this rank's ``position``-th sample."""
        return self.rank + position * self.world_size


@dataclass(frozen=True)
class EvalResult:
    """Sums over every rank (each sample counted once)."""

    loss_sum: float
    correct: int
    count: int
    class_correct: list[int] = field(default_factory=list)
    """Per class, when asked for (``num_classes``)."""
    class_count: list[int] = field(default_factory=list)
    predictions: list[tuple[int, int, int, float]] = field(default_factory=list)
    """(index, label, predicted, confidence) per sample, sorted, when asked for."""

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    @property
    def accuracy(self) -> float:
        return self.correct / self.count if self.count else float("nan")


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader,
    device: torch.device,
    amp: str = "off",
    *,
    num_classes: int = 0,
    predictions: bool = False,
) -> EvalResult:
    """Evaluate ``model`` on this rank's share of ``loader`` and sum over all ranks.
    ``num_classes`` > 0 adds per-class counts; ``predictions`` collects every sample's
    prediction (``loader`` must then use a :class:`ShardSampler`).

    Pass the unwrapped module: evaluation needs no gradient synchronisation, and a plain
    module cannot start a collective that ranks with fewer batches would never join.
    """
    was_training = model.training
    model.eval()
    # float64 sums: exact for counts and stable for the loss whatever the split.
    # [loss sum, correct, count, correct per class..., count per class...]: one all-reduce.
    totals = torch.zeros(3 + 2 * num_classes, dtype=torch.float64, device=device)
    rows: list[tuple[int, int, int, float]] = []
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        with autocast(amp, device):
            logits = model(inputs)
        logits = logits.float()
        predicted = logits.argmax(dim=1)
        hit = (predicted == targets).double()
        totals[0] += F.cross_entropy(logits, targets, reduction="sum").double()
        totals[1] += hit.sum()
        totals[2] += targets.numel()
        if num_classes:
            totals[3 : 3 + num_classes] += torch.bincount(
                targets, weights=hit, minlength=num_classes
            )
            totals[3 + num_classes :] += torch.bincount(targets, minlength=num_classes).double()
        if predictions:
            sampler = loader.sampler
            confidence = logits.softmax(dim=1).max(dim=1).values
            for t, p, c in zip(targets.tolist(), predicted.tolist(), confidence.tolist(),
                               strict=True):  # fmt: skip
                rows.append((sampler.global_index(len(rows)), t, p, c))
    if is_distributed():
        dist.all_reduce(totals)
    if predictions:
        rows = sorted(row for part in all_gather(rows) for row in part)
    model.train(was_training)
    values = totals.tolist()
    return EvalResult(
        loss_sum=values[0],
        correct=int(values[1]),
        count=int(values[2]),
        class_correct=[int(v) for v in values[3 : 3 + num_classes]],
        class_count=[int(v) for v in values[3 + num_classes :]],
        predictions=rows,
    )
