"""Finding a task by its ``--task package.module:Name`` (and the spec of a task object):
a refusal is a ConfigError of one line naming what is wrong (an import error, a missing
method), raised on the driver before Ray starts."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from ray_ddp.config import ConfigError
from ray_ddp.task.checks import first_line
from ray_ddp.task.interface import Task


def load_task(spec: str) -> Task:
    """The task that ``spec`` (``package.module:Name``) names: a :class:`Task` subclass
    (instantiated without arguments) or a Task instance (one with settings of its own).

    The current directory is searched first, as ``python -m`` does, so a task module next
    to where the job is started imports; Ray gives the workers the driver's directory too
    (and a ``ray job submit --working-dir`` ships it)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--task {spec!r}: expected package.module:Name")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any error of the user's module is reported
        raise ConfigError(
            f"--task {spec}: cannot import {module_name} ({type(exc).__name__}: {first_line(exc)})"
        ) from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"--task {spec}: {module_name} has no attribute {attr!r}")
        target = getattr(target, part)
    return as_task(target, f"--task {spec}")


def as_task(target: Any, source: str) -> Task:
    """``target`` as a Task instance, or a ConfigError saying what it lacks."""
    if isinstance(target, type) and issubclass(target, Task):
        missing = sorted(getattr(target, "__abstractmethods__", ()))
        if missing:
            raise ConfigError(
                f"{source}: {target.__name__} does not implement "
                f"{', '.join(m + '()' for m in missing)} (see ray_ddp.Task)"
            )
        try:
            target = target()
        except Exception as exc:  # noqa: BLE001 - the user's constructor
            raise ConfigError(
                f"{source}: {target.__name__}() failed ({type(exc).__name__}: "
                f"{first_line(exc)}); a task class is built without arguments, or name an "
                "instance"
            ) from None
    if not isinstance(target, Task):
        kind = target.__name__ if isinstance(target, type) else type(target).__name__
        raise ConfigError(
            f"{source} is {kind}, not a ray_ddp.Task subclass or instance: subclass "
            "ray_ddp.Task and implement datasets(), model(), loss() and metrics()"
        )
    if target.best_mode not in ("min", "max"):
        raise ConfigError(f"{source}: best_mode must be 'min' or 'max', got {target.best_mode!r}")
    return target


def spec_of(task: Task) -> str:
    """The ``package.module:Name`` a task object is found at (recorded in the run's config,
    so evaluation and export can rebuild its model): the module-level instance it is, if
    any (its settings come with it), else its class."""
    cls = type(task)
    module = sys.modules.get(cls.__module__)
    named = [n for n, v in vars(module).items() if v is task] if module is not None else []
    return f"{cls.__module__}:{named[0] if named else cls.__qualname__}"
