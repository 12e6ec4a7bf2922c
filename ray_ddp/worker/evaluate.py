"""Exact distributed evaluation (no Ray: torch.distributed only).

``DistributedSampler`` pads the dataset with repeated samples so every rank gets the same
count; evaluating through it counts those repeats twice. Here each rank takes every
world_size-th sample from its rank on (no padding: ranks may differ by one sample), sums
each of the task's metrics (a total and a count) over its share, and one all-reduce of
the sums gives figures equal to a single-process evaluation of the same weights. The
training loop's validation and ``jobs/evaluate.py`` both use :func:`evaluate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ray_ddp.data.unreadable import BadSample, take_skipped
from ray_ddp.task import Task, map_tensors
from ray_ddp.worker.collectives import all_gather, is_distributed
from ray_ddp.worker.precision import autocast


@dataclass(frozen=True)
class EvalResult:
    """Every metric's sums over every rank (each sample counted once)."""

    sums: dict[str, tuple[float, float]]
    """name -> (total, count), summed over all batches and ranks."""
    samples: int
    """Samples evaluated, over all ranks (each once: the split's size)."""
    predictions: list[tuple] = field(default_factory=list)
    """(index, *columns) per sample, sorted by index, when asked for."""
    columns: list[str] = field(default_factory=list)
    """The names of the prediction columns after ``index``."""
    skipped: list[tuple[int, BadSample]] = field(default_factory=list)
    """(rank, record) of every sample that could not be read (``ray_ddp.data.unreadable``),
    all ranks: left out, so ``samples`` and the sums cover the others."""

    @property
    def means(self) -> dict[str, float]:
        """total / count per metric: what a single-process evaluation gives."""
        return {k: t / c if c else float("nan") for k, (t, c) in self.sums.items()}


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader,
    device: torch.device,
    task: Task,
    amp: str = "off",
    *,
    full: bool = False,
    predictions: bool = False,
) -> EvalResult:
    """Evaluate ``model`` on this rank's share of ``loader`` with the task's ``metrics``
    (its ``evaluation_metrics`` if ``full``) and sum over all ranks. ``predictions``
    collects the task's per-sample columns (``loader`` must then use a
    :class:`ShardSampler`).

    Pass the unwrapped module: evaluation needs no gradient synchronisation, and a plain
    module cannot start a collective that ranks with fewer batches would never join.

    Samples the loader could not read (``ray_ddp.data.unreadable``) are left out and listed
    in the result's ``skipped``.
    """
    was_training = model.training
    model.eval()
    measure = task.evaluation_metrics if full else task.metrics
    totals: dict[str, torch.Tensor] = {}  # name -> [total, count], float64 on the device
    rows: list[tuple] = []
    columns: list[str] = []
    samples = 0
    skipped: list[BadSample] = []
    fetched = 0  # samples the sampler handed out, read or not (predictions' positions)
    for item in loader:
        batch, bad = take_skipped(item)
        skipped += bad
        if batch is None:  # nothing in it could be read
            fetched += len(bad)
            continue
        # A loader prepared by Ray has moved the batch already: then this is a no-op.
        batch = map_tensors(batch, lambda t: t.to(device, non_blocking=True))
        size = task.batch_size(batch)
        samples += size
        with autocast(amp, device):
            sums = measure(model, batch)
            extra = task.predictions(model, batch) if predictions else None
        for name, (total, count) in sums.items():
            pair = torch.stack([_as_float64(total, device), _as_float64(count, device)])
            totals[name] = totals[name] + pair if name in totals else pair
        if extra:
            columns = list(extra)
            unread = {b.index for b in bad}
            positions = range(fetched, fetched + size + len(bad))
            indices = [i for i in map(loader.sampler.global_index, positions) if i not in unread]
            values = [extra[c].float().tolist() if extra[c].is_floating_point()
                      else extra[c].tolist() for c in columns]  # fmt: skip
            for index, row in zip(indices, zip(*values, strict=True), strict=True):
                rows.append((index, *row))
        fetched += size + len(bad)
    # A rank whose share is empty has no names: agree on them (in the task's order) first,
    # then one all-reduce. The unreadable samples come along.
    names: list[str] = []
    gathered = all_gather((list(totals), skipped))
    for part, _ in gathered:
        names += [n for n in part if n not in names]
    zero = torch.zeros(2, dtype=torch.float64, device=device)
    vector = torch.stack([totals.get(n, zero) for n in names] + [zero + samples])
    if is_distributed():
        dist.all_reduce(vector)
    if predictions:
        rows = sorted(row for part in all_gather(rows) for row in part)
        columns = next((c for c in all_gather(columns) if c), columns)
    model.train(was_training)
    values = vector.tolist()
    return EvalResult(
        sums={n: (v[0], v[1]) for n, v in zip(names, values[:-1], strict=True)},
        samples=int(values[-1][0]),
        predictions=rows,
        columns=columns,
        skipped=[(rank, b) for rank, (_, part) in enumerate(gathered) for b in part],
    )


def _as_float64(value: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64, device=device)
