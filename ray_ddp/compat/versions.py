"""Which Ray Train a run uses: the lean one (``lean_trainer``) on the Ray releases it was
verified on, Ray's stock ``TorchTrainer`` on any other (or when ``RAY_DDP_STOCK_TRAINER=1``
asks for it). The lean trainer only changes how a local run starts (fewer processes, a
faster-polling controller); the training, checkpoints and results are the same."""

from __future__ import annotations

import functools
import os
from typing import Any

VERIFIED_RAY = ("2.60.0",)
"""Ray releases on which the lean trainer's private hooks were checked (every symbol of
``apis.LEAN`` with its signature, and the suite run on it)."""

STOCK_ENV = "RAY_DDP_STOCK_TRAINER"


def ray_version() -> str:
    import ray

    return ray.__version__


@functools.cache
def lean_trainer_ok() -> bool:
    """The lean trainer is used: this Ray is a verified one, the stock trainer was not asked
    for, and the hooks import. Otherwise says why, once per process, in one line."""
    if os.environ.get(STOCK_ENV) == "1":
        return False
    version = ray_version()
    if version not in VERIFIED_RAY:
        print(
            f"ray_ddp: Ray {version} is not one its lean start-up was verified on "
            f"({', '.join(VERIFIED_RAY)}); runs use Ray Train's stock TorchTrainer (slower to "
            "start, the same training)",
            flush=True,
        )
        return False
    try:
        import ray_ddp.compat.lean_trainer  # noqa: F401 - its private imports resolve
    except (ImportError, AttributeError) as exc:  # pragma: no cover - a verified Ray has them
        print(f"ray_ddp: Ray Train's stock TorchTrainer ({type(exc).__name__}: {exc})", flush=True)
        return False
    return True


def reclaim_watcher_on() -> bool:
    """Ray Train watches this run's nodes for reclaim notices (its preemption watcher):
    not where ``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0`` (a local Ray started by
    ``cluster.connect`` sets it), nor in the lean trainer's local runs (one machine has no
    spot nodes). Where it is off, the workers need not ask (``worker.preemption``)."""
    if os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1").lower() in ("0", "false"):
        return False
    if lean_trainer_ok():
        from ray_ddp.compat.lean_trainer import ray_started_here

        return not ray_started_here()
    return True


def torch_trainer_class() -> type[Any]:
    """``LeanTorchTrainer`` or Ray's ``TorchTrainer`` (see :func:`lean_trainer_ok`)."""
    if lean_trainer_ok():
        from ray_ddp.compat.lean_trainer import LeanTorchTrainer

        return LeanTorchTrainer
    from ray.train.torch import TorchTrainer

    return TorchTrainer
