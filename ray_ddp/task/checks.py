"""Checking a task before Ray starts: its facts, and a dry run of its data, model, loss
and metrics on two samples (the default ``Task.check``).

Every refusal is a ConfigError of one line naming what is wrong (an import error, a
missing method, a wrong return type), raised on the driver, so a broken task costs a
second, not a cluster start and a traceback from every worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.task.batches import map_tensors

if TYPE_CHECKING:
    from ray_ddp.task.interface import Task

T = TypeVar("T")


def user_code(task: Task, method: str, call: Callable[[], T]) -> T:
    """``call()``, a call into the task's own code on the driver: an error in it becomes
    one line naming the task and the method (a ConfigError of its own passes as it is)."""
    try:
        return call()
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code, reported in one line
        raise ConfigError(
            f"task {type(task).__name__}: {method}() failed ({type(exc).__name__}: "
            f"{first_line(exc)})"
        ) from exc


def first_line(exc: BaseException) -> str:
    """An error's first line (or its type's name), for a one-line refusal."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def check_facts(task: Task, facts: Any) -> dict[str, Any]:
    """``describe``'s result must be a dict of plain JSON values (it goes into every
    checkpoint, which is read with ``weights_only``)."""
    import json

    if not isinstance(facts, dict):
        raise ConfigError(
            f"task {type(task).__name__}: describe() returned {type(facts).__name__}, not a dict"
        )
    try:
        json.dumps(facts)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"task {type(task).__name__}: describe() must return plain JSON values ({exc})"
        ) from None
    return facts


# ----------------------------------------------------------------- the dry run
def dry_run(task: Task, cfg: TrainConfig, facts: dict[str, Any]) -> tuple[int, int]:
    """Build the datasets, batch two samples of each split, run ``loss`` (training mode)
    and ``metrics`` (eval mode) on them with the model's weights on the meta device.
    Returns the splits' sizes. Where the meta device cannot tell (an op without a meta
    kernel, ``.item()``), the task is let through: this check never refuses a task that
    works."""
    name = type(task).__name__
    splits = user_code(task, "datasets", lambda: task.datasets(cfg, facts))
    if not (isinstance(splits, (tuple, list)) and len(splits) == 2):
        raise ConfigError(
            f"task {name}: datasets() must return (train, val), got {type(splits).__name__}"
        )
    sizes = []
    for split, dataset in zip(("train", "val"), splits, strict=True):
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise ConfigError(
                f"task {name}: the {split} split is {type(dataset).__name__}, not a map-style "
                "dataset (__getitem__ and __len__)"
            )
        if len(dataset) == 0:
            raise ConfigError(f"task {name}: the {split} split is empty")
        sizes.append(len(dataset))
    with weights_on_meta():
        model = user_code(task, "model", lambda: task.model(cfg, facts))
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"task {name}: model() returned {type(model).__name__}, not a torch.nn.Module"
        )
    train_batch = _two_samples(task, splits[0], "train")
    val_batch = _two_samples(task, splits[1], "val")
    size = user_code(task, "batch_size", lambda: task.batch_size(train_batch))
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"task {name}: batch_size() returned {size!r}, not a positive int")
    model.train()
    loss = _on_meta(name, "loss", lambda: task.loss(model, train_batch))
    if loss is not None and not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(
            f"task {name}: loss() returned {shape}, not a scalar tensor (the batch's mean loss)"
        )
    model.eval()
    with torch.no_grad():
        sums = _on_meta(name, "metrics", lambda: task.metrics(model, val_batch))
    if sums is not None:
        check_metrics(task, sums)
    return sizes[0], sizes[1]


def check_metrics(task: Task, sums: Any) -> None:
    """``metrics`` gives name -> Sum, and ``best_metric`` is among what gets reported."""
    name = type(task).__name__
    if not isinstance(sums, dict) or not all(
        isinstance(k, str) and isinstance(v, tuple) and len(v) == 2 for k, v in sums.items()
    ):
        raise ConfigError(
            f"task {name}: metrics() must return a dict of name -> ray_ddp.Sum(total, count), "
            f"got {type(sums).__name__}"
        )
    reported = task.summarize({k: 1.0 for k in sums})
    if task.best_metric not in reported:
        raise ConfigError(
            f"task {name}: best_metric {task.best_metric!r} is not among its metrics "
            f"({', '.join(sorted(reported))})"
        )


def _two_samples(task: Task, dataset: Any, split: str) -> Any:
    samples = _readable_samples(task, dataset, split)
    try:
        batch = task.collate(samples)
    except Exception as exc:  # noqa: BLE001 - the user's collate
        raise ConfigError(
            f"task {type(task).__name__}: collate() fails on two {split} samples "
            f"({type(exc).__name__}: {first_line(exc)})"
        ) from None
    return map_tensors(batch, lambda t: t.to("meta"))


def _readable_samples(task: Task, dataset: Any, split: str, tries: int = 20) -> list[Any]:
    """The split's first two samples that can be read (the run skips the others: see
    ``ray_ddp.data.unreadable``); refused if the first ``tries`` cannot be."""
    from ray_ddp.data.unreadable import BadSample, SkipUnreadable

    reader = SkipUnreadable(dataset)
    samples: list[Any] = []
    bad: list[Any] = []
    for index in range(min(tries, len(dataset))):
        sample = reader[index]
        (bad if isinstance(sample, BadSample) else samples).append(sample)
        if len(samples) == 2:
            return samples
    if not samples:
        raise ConfigError(
            f"task {type(task).__name__}: the first {len(bad)} {split} samples cannot be read, "
            f"e.g. {bad[0].name} ({bad[0].error})"
        )
    return [samples[0], samples[0]]


def _on_meta(task_name: str, method: str, call: Any) -> Any:
    """``call()`` with new tensors on the meta device; None where meta cannot tell."""
    try:
        with torch.device("meta"):
            return call()
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code, reported in one line
        if meta_cannot_tell(exc):
            return None
        raise ConfigError(
            f"task {task_name}: {method}() fails on a batch of 2 samples "
            f"({type(exc).__name__}: {first_line(exc)})"
        ) from None


def meta_cannot_tell(exc: Exception) -> bool:
    """An error of the meta device, not of the model on this input."""
    return isinstance(exc, NotImplementedError) or "meta" in str(exc).lower()


@contextlib.contextmanager
def weights_on_meta() -> Iterator[None]:
    """Parameters and buffers go to the meta device as modules register them, so even a
    large model allocates nothing and its weight initialisation does no arithmetic.
    (Registration hooks, not ``with torch.device("meta")``: a constructor may compute its
    layer widths with tensors, as RegNet's does, and those must hold real numbers.)"""
    from torch.nn.modules import module

    hooks = [
        # torch annotates the hook's result None; a Parameter returned replaces the one
        # registered, as its docstring says
        module.register_module_parameter_registration_hook(
            lambda _, __, param: nn.Parameter(param.to("meta"), param.requires_grad)  # type: ignore[arg-type]
        ),
        module.register_module_buffer_registration_hook(
            lambda _, __, buffer: None if buffer is None else buffer.to("meta")
        ),
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
