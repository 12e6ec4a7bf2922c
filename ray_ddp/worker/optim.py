"""Optimizer and learning-rate schedule (linear warm-up, then cosine, per optimizer step)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ray_ddp.config.sections import Optimisation


def build_optimizer(optim: Optimisation, params: Iterable[Any]) -> torch.optim.Optimizer:
    """AdamW or SGD over ``params``: parameters, or param-group dicts (a task's
    ``param_groups``) that may set their own ``weight_decay`` and an ``lr_scale``, a factor
    on the schedule's lr that the group keeps (so a resume applies it to a new --lr too)."""
    groups: list[dict[str, Any]] = [
        dict(g) if isinstance(g, dict) else {"params": [g]} for g in params
    ]
    if groups and all(set(g) == {"params"} for g in groups):
        groups = [{"params": [p for g in groups for p in g["params"]]}]  # one plain group
    for group in groups:
        group["lr"] = optim.lr * group.setdefault("lr_scale", 1.0)
    if optim.optimizer == "sgd":
        return torch.optim.SGD(
            groups,
            lr=optim.lr,
            momentum=optim.momentum,
            weight_decay=optim.weight_decay,
        )
    return torch.optim.AdamW(groups, lr=optim.lr, weight_decay=optim.weight_decay)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based).

    Linear warm-up from lr/warmup to lr over ``warmup_steps``, then a half cosine down to
    ``lr * min_lr_ratio`` at ``total_steps``, flat after that.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def default_warmup(total_steps: int) -> int:
    return max(1, round(0.05 * total_steps))


def build_scheduler(
    optim: Optimisation, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = optim.warmup_steps if optim.warmup_steps is not None else default_warmup(total_steps)
    # A lambda (not a callable object): LambdaLR then keeps it out of its state_dict, so a
    # resumed run with more epochs uses the new total instead of the checkpoint's.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup, total_steps, optim.min_lr_ratio)
    )


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> bool:
    """One optimizer step through the GradScaler; returns whether it was applied.

    With fp16 the scaler skips a step whose gradients overflowed (and halves its scale):
    that is normal while the scale settles, and the LR schedule must not advance for a
    step the optimizer did not take. The scale is read before and after (one host sync,
    which ``scaler.step`` already pays for fp16); without a scaler nothing is read."""
    if not scaler.is_enabled():
        optimizer.step()
        scheduler.step()
        return True
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    applied = scaler.get_scale() >= scale  # the scale only drops after a skipped step
    if applied:
        scheduler.step()
    return applied


def set_schedule_step(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Put the schedule at optimizer step ``step`` (steps the schedule has counted) and
    set every group's lr from it: what ``step`` calls of ``scheduler.step()`` would."""
    scheduler.last_epoch = step
    lrs = [base * f(step) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() returns


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's settings that come from the flags and the task, not from training:
    what :func:`apply_hyperparameters` puts back after a checkpoint's state is loaded."""
    keys = ("weight_decay", "momentum", "lr_scale")
    return [{k: g[k] for k in keys if k in g} for g in optimizer.param_groups]


def apply_hyperparameters(
    optim: Optimisation,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    fresh: list[dict[str, Any]],
) -> list[str]:
    """After loading a checkpoint's optimizer and schedule: the configured peak lr and
    the groups' ``fresh`` settings (:func:`hyperparameters` of the optimizer as built from
    the flags and the task) replace the saved ones (``load_state_dict`` restores a group's
    hyperparameters with its state). Returns ``name old -> new`` for each value that
    changed, for the resume line."""
    changes = []
    old_lr = scheduler.base_lrs[0] / optimizer.param_groups[0].get("lr_scale", 1.0)
    for group, wanted in zip(optimizer.param_groups, fresh, strict=True):
        for key, value in wanted.items():
            old = group.get(key)
            note = f"{key.replace('_', ' ')} {old:g} -> {value:g}" if old is not None else ""
            if old is not None and old != value and note not in changes:
                changes.append(note)
            group[key] = value
    if not math.isclose(old_lr, optim.lr, rel_tol=1e-12):
        changes.append(f"peak lr {old_lr:g} -> {optim.lr:g}")
    scheduler.base_lrs = [optim.lr * g.get("lr_scale", 1.0) for g in optimizer.param_groups]
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["initial_lr"] = base
    set_schedule_step(scheduler, scheduler.last_epoch)
    return changes
