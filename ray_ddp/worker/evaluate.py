"""Exact distributed evaluation (no Ray: torch.distributed only).

``DistributedSampler`` pads the dataset with repeated samples so every rank gets the same
count; evaluating through it counts those repeats twice. Here each rank takes every
world_size-th sample from its rank on (no padding: ranks may differ by one sample), sums
each of the task's metrics (a total and a count) over its share, and one all-reduce of
the sums gives figures equal to a single-process evaluation of the same weights. The
training loop's validation and ``jobs/evaluate.py`` both use :func:`evaluate`.

A model sharded by FSDP2 (``--strategy fsdp2``) all-gathers its parameters in every
forward, a collective every rank must join: the ranks go through their shares in lockstep,
and a rank whose share has ended (or whose batch had nothing readable) runs the same
forwards on a stand-in batch (its latest one, else the ``stand_in`` it was given), whose
results are not counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ray_ddp.checkpoint.format import is_fsdp
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
    stand_in: Any = None,
) -> EvalResult:
    """Evaluate ``model`` on this rank's share of ``loader`` with the task's ``metrics``
    (its ``evaluation_metrics`` if ``full``) and sum over all ranks. ``predictions``
    collects the task's per-sample columns (``loader`` must then use a
    :class:`ShardSampler`).

    Pass the unwrapped module: evaluation needs no gradient synchronisation, and a plain
    module cannot start a collective that ranks with fewer batches would never join.

    Samples the loader could not read (``ray_ddp.data.unreadable``) are left out and listed
    in the result's ``skipped``.
    A model sharded by FSDP2: see the module's docstring (``stand_in``).
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
    sharded = is_fsdp(model) and is_distributed()
    for item in _lockstep(loader, device) if sharded else loader:
        batch, bad = take_skipped(item) if item is not None else (None, [])
        skipped += bad
        if batch is None:  # nothing in it could be read (or, sharded, nothing left)
            fetched += len(bad)
            if sharded:
                _uncounted_forwards(model, task, amp, device, stand_in, full, predictions)
            continue
        # A loader prepared by Ray has moved the batch already: then this is a no-op.
        batch = map_tensors(batch, lambda t: t.to(device, non_blocking=True))
        stand_in = batch
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
            rows += _prediction_rows(extra, loader, range(fetched, fetched + size + len(bad)),
                                     {b.index for b in bad})  # fmt: skip
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


def _prediction_rows(extra: dict[str, torch.Tensor], loader, positions: range,
                     unread: set[int]) -> list[tuple]:  # fmt: skip
    """``(index, *columns)`` of a batch's readable samples (``positions``: where the
    sampler handed them out)."""
    indices = [i for i in map(loader.sampler.global_index, positions) if i not in unread]
    values = [extra[c].float().tolist() if extra[c].is_floating_point()
              else extra[c].tolist() for c in extra]  # fmt: skip
    return [(index, *row) for index, row in zip(indices, zip(*values, strict=True),
                                                strict=True)]  # fmt: skip


def _lockstep(loader, device: torch.device) -> Iterator[Any]:
    """``loader``'s items, then None on this rank while another rank's go on (a small
    all-reduce per batch: every rank knows whether any has one left)."""
    items = iter(loader)
    while True:
        item = next(items, None)
        more = torch.tensor([0 if item is None else 1], device=device)
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more.item():
            return
        yield item


def _uncounted_forwards(model, task: Task, amp: str, device, batch, full, predictions) -> None:
    """The forwards a counted batch makes (its metrics, its predictions), on ``batch``,
    their results thrown away: this rank's part of the other ranks' all-gathers."""
    if batch is None:
        raise RuntimeError(
            "FSDP2 evaluation: this rank has no readable batch to stand in for the forwards "
            "the other ranks run (its validation share is empty or unreadable); use fewer "
            "workers or more validation samples"
        )
    measure = task.evaluation_metrics if full else task.metrics
    with autocast(amp, device):
        measure(model, batch)
        if predictions:
            task.predictions(model, batch)


def _as_float64(value: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64, device=device)
