"""The number of workers as a way to run a training, not part of what is trained.

What is trained is fixed by the global batch (per-worker batch x workers x accumulation)
and the data order (``ray_ddp.data.order.global_order``), neither of which depends on the
world size.
So a re-run of a run on another number of workers (a stopped 8-GPU run continued on 4)
keeps its global batch by changing the accumulation, and an elastic run (``--num-workers
MIN-MAX``) keeps it at every count Ray gives it. No Ray here: the driver calls this before
any cluster work, and the Ray Train settings are built from :func:`scaling_workers`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ray_ddp.config.batch import saved_global_batch
from ray_ddp.config.sections import Optimisation, Scaling
from ray_ddp.config.train import ConfigError, check_worker_range


def keep_global_batch(
    scaling: Scaling, optim: Optimisation, saved: dict[str, Any] | None, what: str
) -> Optimisation:
    """``optim`` with the accumulation that keeps the global batch of ``saved`` (the config
    of the run being continued, called ``what`` in messages) on the workers of ``scaling``,
    when only the number of workers changed; unchanged otherwise (a changed --batch-size or
    --accum-steps is a change of what is trained, which the re-run guard judges)."""
    if saved is None or scaling.num_workers is None:
        return optim
    batch = saved_global_batch(saved)
    if (
        batch is None
        or saved.get("num_workers") == scaling.num_workers
        or saved.get("batch_size") != optim.batch_size
        or saved.get("accum_steps") != optim.accum_steps
    ):
        return optim
    per_round = optim.batch_size * scaling.num_workers
    if batch % per_round:
        most = batch // optim.batch_size
        counts = [n for n in range(1, most + 1) if batch % (optim.batch_size * n) == 0]
        raise ConfigError(
            f"{what} trains with a global batch of {batch} ({optim.batch_size} x "
            f"{saved['num_workers']} workers x {saved['accum_steps']}), which "
            f"{scaling.num_workers} "
            f"workers of --batch-size {optim.batch_size} cannot make: use "
            f"{', '.join(map(str, counts))} workers, or change --batch-size/--accum-steps "
            "(a different training) with --allow-config-change"
        )
    workers = scaling.num_workers
    kept = dataclasses.replace(optim, accum_steps=batch // per_round)
    if scaling.min_workers is not None:
        check_worker_range(scaling, kept)
    print(
        f"{what} continues on {workers} worker{'s' if workers > 1 else ''}: "
        f"accumulation {optim.accum_steps} -> "
        f"{kept.accum_steps} keeps its global batch of {batch}",
        flush=True,
    )
    return kept


def scaling_workers(scaling: Scaling) -> int | tuple[int, int]:
    """Ray Train's ``ScalingConfig(num_workers=...)``: a count, or (MIN, MAX) when elastic."""
    low, high = scaling.worker_range
    return (low, high) if scaling.elastic else high


ELASTIC_START_TIMEOUT_S = 30
"""How long Ray Train waits for a worker group to start, in elastic runs (its default is
60 s). After a lost node Ray's elastic policy first restarts at the old size, counted from
a view of the nodes its AutoscalingCoordinator refreshes every 20 s; that start cannot be
placed and only its timeout lets the policy retry at the size that fits. Measured on a
simulated cluster: 64 s from a lost node to training again with 60 s, 23 s with 10 s."""


def quick_elastic_restarts() -> None:
    """Shorten Ray Train's worker-group start timeout for an elastic run (a value the user
    set wins). Ray Train hands RAY_TRAIN_* variables of the driver to its controller."""
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", str(ELASTIC_START_TIMEOUT_S))
