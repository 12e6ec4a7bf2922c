"""Optimizer and learning-rate schedule (linear warm-up, then cosine, per optimizer step),
and the :class:`Stepper`: the weighted backward and the optimizer step of both loops."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ray_ddp.config.sections import Optimisation
from ray_ddp.task.interface import Sum
from ray_ddp.worker.collectives import is_distributed


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
            groups, lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay
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


class Stepper:
    """The weighted backward of each micro-batch and the optimizer step after them: one
    path for the built-in loop (``worker.step.StepCore``) and an own loop's verbs
    (``worker.own_loop.Run``), for any number of optimizers under one GradScaler.

    A micro-batch's loss is a mean over its samples, weighted by its ``share`` of the
    step's samples (all ranks together; 0: a filler or a stand-in, which only joins the
    all-reduce), or a ``Sum(total, count)``: the step's gradient is then the sum of every
    rank's totals over the sum of every rank's counts (tokens, say), exact however the
    micro-batches and ranks split them. DDP's all-reduce (FSDP2's reduce-scatter) averages
    over the ranks: each rank's part is multiplied back by their number."""

    def __init__(self, scaler: torch.amp.GradScaler, ranks: int, device: torch.device) -> None:
        self.scaler, self.ranks, self.device = scaler, ranks, device
        self.count: torch.Tensor | None = None
        """This rank's counts of the ``Sum`` losses since the last step."""

    def backward(self, loss: torch.Tensor | Sum, share: float) -> None:
        if isinstance(loss, Sum):
            total, count = loss
            if not isinstance(total, torch.Tensor):
                raise TypeError("a Sum's total is the loss tensor to differentiate, got "
                                f"{type(total).__name__}")  # fmt: skip
            kept = 1.0 if share > 0 else 0.0
            count = torch.as_tensor(count, dtype=torch.float64, device=self.device) * kept
            self.count = count if self.count is None else self.count + count
            scaled = total * (kept * self.ranks)
        else:
            scaled = loss * (share * self.ranks)
        self.scaler.scale(scaled).backward()

    def step(
        self, optimizers: Sequence[torch.optim.Optimizer], schedules: Sequence[Any] = (),
        clip: float = 0.0,
    ) -> bool:  # fmt: skip
        """Divide a ``Sum`` step's gradients by every rank's count; per optimizer, unscale
        and clip the true gradients to norm ``clip`` (0: no clipping; under FSDP2 the norm
        is over every rank's shards, a collective), step through the GradScaler; step the
        ``schedules`` where the step was applied; zero the gradients. Returns whether it
        was applied: with fp16 the scaler skips a step whose gradients overflowed (and
        halves its scale), normal while the scale settles, and a schedule must not advance
        for a step not taken. The scale is read before and after (one host sync, which
        ``scaler.step`` already pays for fp16); without a scaler nothing is read."""
        if self.count is not None:
            self._divide_by_count(optimizers)
        enabled = self.scaler.is_enabled()
        scale = self.scaler.get_scale() if enabled else 1.0
        for optimizer in optimizers:
            if clip > 0:
                self.scaler.unscale_(optimizer)  # clip the true gradients, not scaled ones
                params = [p for g in optimizer.param_groups for p in g["params"]]
                torch.nn.utils.clip_grad_norm_(params, clip)
            self.scaler.step(optimizer)
        self.scaler.update()
        applied = not enabled or self.scaler.get_scale() >= scale  # drops after a skip
        if applied:
            for schedule in schedules:
                schedule.step()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        return applied

    def _divide_by_count(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        count, self.count = self.count.clone(), None  # type: ignore[union-attr]
        if is_distributed():
            dist.all_reduce(count)
        factor = 1.0 / max(float(count), 1e-12)
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(factor)


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
