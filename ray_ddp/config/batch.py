"""The batch arithmetic of a run, in one place: the global batch (samples per optimizer
step across the run), its micro-batches, and how they split over a number of workers.

What is trained is fixed by the global batch and the data order, not by the world size:
``accumulation`` is what each worker does at a given size to keep it (see
``ray_ddp.driver.elastic`` and ``ray_ddp.data.order``). No Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def global_batch(batch_size: int, workers: int, accum_steps: int) -> int:
    """Samples per optimizer step across the run: every worker's micro-batch
    (``--batch-size``), times the workers, times the micro-batches each accumulates."""
    return batch_size * workers * accum_steps


def saved_global_batch(config: Mapping[str, Any], world_size: int | None = None) -> int | None:
    """The global batch of a config saved as a dict (a run's record, a checkpoint's
    config); its ``num_workers`` or else ``world_size`` (what a checkpoint was written
    at). None while neither is known (a record made before the workers were counted)."""
    workers = config.get("num_workers") or world_size
    if not workers:
        return None
    return global_batch(config.get("batch_size", 0), workers, config.get("accum_steps", 1))


MIN_BUSY = 0.75
"""An elastic range is refused where some worker count in it would keep the workers busy
less than this share of each step (see :func:`busy_share`)."""


def micro_batches(global_batch: int, batch_size: int) -> int:
    """Micro-batches per optimizer step."""
    per_step, rest = divmod(global_batch, batch_size)
    if rest or not per_step:
        raise ValueError(
            f"a global batch of {global_batch} is not a whole number of micro-batches of "
            f"{batch_size}"
        )
    return per_step


def accumulation(global_batch: int, batch_size: int, world_size: int) -> int:
    """The most micro-batches one of ``world_size`` ranks trains per optimizer step (all
    of them train as many where ``world_size`` divides the step's micro-batches)."""
    per_step = micro_batches(global_batch, batch_size)
    if world_size > per_step:
        raise ValueError(
            f"{world_size} workers need at least {world_size} micro-batches per step, and a "
            f"global batch of {global_batch} makes {per_step} of {batch_size}"
        )
    return -(-per_step // world_size)


def busy_share(per_step: int, world_size: int) -> float:
    """The share of a step the workers spend training when ``per_step`` micro-batches are
    split over ``world_size`` of them: 1.0 where it divides, less where some wait for the
    ranks with one micro-batch more (8 over 6: 2 on ranks 0-1, 1 on the others, 67%)."""
    return per_step / (world_size * -(-per_step // world_size))
