"""ray_ddp: distributed PyTorch (DDP) training orchestrated by Ray Train.

The public API (see ``task`` for the interface and the README, "Your own model")::

    from ray_ddp import Sum, Task, TrainConfig, fit, load_model

and for a training loop of your own (``docs/own-loop.md``)::

    from ray_ddp import Run, launch, load_state, main, sweep

Where everything lives: ``docs/architecture.md``, the one map of the package's folders and
modules (each folder's ``__init__`` says its concern in a line or two).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Imported when first used, so that ``import ray_ddp.config.train`` (the entry points' first
# import, before bad flags are refused) does not import torch.
_PUBLIC = {
    "Task": "ray_ddp.task.interface",
    "Sum": "ray_ddp.task.interface",
    "TrainConfig": "ray_ddp.config.train",
    "ConfigError": "ray_ddp.config.train",
    "fit": "ray_ddp.driver.run",
    "load_model": "ray_ddp.checkpoint.format",
    "Run": "ray_ddp.worker.own_loop",
    "launch": "ray_ddp.driver.own_loop",
    "main": "ray_ddp.driver.own_loop",
    "sweep": "ray_ddp.driver.own_loop",
    "load_state": "ray_ddp.checkpoint.format:registered_states",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ray_ddp' has no attribute {name!r}")
    import importlib

    module, _, attribute = _PUBLIC[name].partition(":")
    return getattr(importlib.import_module(module), attribute or name)
