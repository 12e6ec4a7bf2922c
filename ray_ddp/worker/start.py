"""What a worker does before its first step: number its attempt, start its hang watchdog,
wrap the model (channels_last, DDP, torch.compile), build the optimizer and schedule, say
what the run is (the rank table, the batch arithmetic, the data) and count the model's
FLOPs."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, cast

import ray.train
import ray.train.torch
import torch

from ray_ddp.checkpoint.format import unwrap
from ray_ddp.config import TrainConfig
from ray_ddp.config.sections import Reliability
from ray_ddp.data.unreadable import take_skipped
from ray_ddp.io import reporting
from ray_ddp.reliability.attempts import record_attempt
from ray_ddp.reliability.hangs.dump import HangSite, handle_hang
from ray_ddp.reliability.hangs.report import hang_folder
from ray_ddp.reliability.hangs.watchdog import NullWatchdog, Watchdog
from ray_ddp.task import Task, map_tensors
from ray_ddp.testing import harness as rig
from ray_ddp.testing.harness import Harness
from ray_ddp.worker.checkpointer import Checkpointer
from ray_ddp.worker.collectives import all_gather
from ray_ddp.worker.data import WorkerData
from ray_ddp.worker.flops import FlopRate, count_training_flops, flops_line, run_peak
from ray_ddp.worker.identity import Worker
from ray_ddp.worker.optim import build_optimizer, build_scheduler
from ray_ddp.worker.precision import grad_scaler
from ray_ddp.worker.preemption import PreemptionWatch
from ray_ddp.worker.sharding import bf16_policy, shard_model, task_blocks
from ray_ddp.worker.state import TrainState
from ray_ddp.worker.step import Limits


@dataclass(frozen=True)
class Attempt:
    number: int
    peers: tuple[tuple[str, int], ...]
    """Every rank's (host, pid), in rank order."""


def number_attempt(run_dir: str, worker: Worker) -> Attempt:
    """This attempt's number (rank 0 adds it to ``<run_dir>/attempts.csv``) and every
    rank's host and pid, known to every rank (a collective)."""
    number = 0
    if worker.is_main:
        checkpoint = ray.train.get_checkpoint()
        name = os.path.basename(checkpoint.path.rstrip("/")) if checkpoint else ""
        number = record_attempt(run_dir, worker.world_size, name)
    gathered = all_gather((number, socket.gethostname(), os.getpid()))
    return Attempt(gathered[0][0], tuple((host, pid) for _, host, pid in gathered))


def start_watchdog(
    reliability: Reliability, run_dir: str, worker: Worker, attempt: Attempt
) -> Watchdog | NullWatchdog:
    """The rank's hang watchdog, started (a null one with ``--hang-timeout 0``); its
    reports go under the run's folder, ``run_dir``."""
    if reliability.hang_timeout == 0:
        return NullWatchdog()
    folder = hang_folder(run_dir, attempt.number)
    site = HangSite(worker.rank, worker.world_size, attempt.number, folder, attempt.peers)
    return Watchdog(
        on_hang=lambda stall: handle_hang(stall, site),
        steady_s=reliability.hang_timeout,
        grace_s=reliability.hang_grace,
        peer_check=site.peer_found_hang,
    ).start()


@dataclass
class Safeguards:
    """What guards a run, whichever loop runs it: the rank's hang watchdog, the one
    checkpointer, the watch for a spot reclaim's notice, and where a pass stops
    (``--max-steps``, a checkpoint due)."""

    watchdog: Watchdog | NullWatchdog
    checkpointer: Checkpointer
    reclaims: PreemptionWatch
    limits: Limits


def safeguards(
    cfg: TrainConfig, worker: Worker, attempt: Attempt, harness: Harness, notices: bool,
    mode: str,
) -> Safeguards:  # fmt: skip
    """The run's :class:`Safeguards`, the watchdog started; ``mode``: the checkpointer's
    (``sync``, ``async``); ``notices``: whether Ray watches the nodes for reclaims."""
    watchdog = start_watchdog(cfg.reliability, cfg.checkpointing.run_dir, worker, attempt)
    checkpointer = Checkpointer(
        mode, worker.log, rig.checkpoint_hook(harness, cfg.checkpointing.run_dir)
    )
    # Asked only where Ray watches for reclaims (not a local run): each ask is a barrier.
    reclaims = PreemptionWatch(
        cfg.reliability.preemption_check_steps if notices else 0, worker.log,
        checkpointer.idle.wait,
        lambda: watchdog.doing("holding for a reclaimed node to go", slow=True),
    )  # fmt: skip
    limits = Limits(cfg.optim.max_steps, cfg.checkpointing.checkpoint_every, reclaims)
    return Safeguards(watchdog, checkpointer, reclaims, limits)


def wrap_model(
    model: torch.nn.Module,
    channels_last: bool,
    compiled: bool,
    fsdp: tuple[Task, str, Worker] | None = None,
) -> torch.nn.Module:
    """NHWC if asked, then DDP (with more than one worker) on this worker's device, then
    torch.compile if asked: compiling the DDP module lets its graph break at the gradient
    buckets, which keeps the all-reduces overlapping the backward.

    ``fsdp`` (``--strategy fsdp2``: the task, ``--amp``, the worker): FSDP2 instead of
    DDP, on every worker count (one included, so that checkpoints are always sharded),
    sharding the task's blocks and then the root (``worker.sharding``)."""
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if fsdp is not None:
        task, amp, worker = fsdp
        blocks = task_blocks(task, model)
        n = worker.world_size
        held = f"each holding 1/{n} of" if n > 1 else "1 worker: nothing to divide, it holds all"
        worker.log(
            f"fsdp2: {len(blocks)} blocks and the rest of the model sharded, {held} the "
            "parameters, gradients and optimizer state"
            + (" (bf16 compute, fp32 gradient reduction)" if bf16_policy(model, amp) else "")
        )
        return shard_model(model, blocks, amp, worker.device, worker.world_size)
    model = ray.train.torch.prepare_model(model)
    # compile gives a Module a Module (OptimizedModule); its types say only a callable
    return cast(torch.nn.Module, torch.compile(model)) if compiled else model


def build_train_state(
    cfg: TrainConfig, worker: Worker, task: Task, model: torch.nn.Module, data: WorkerData
) -> TrainState:
    """Optimizer (over the task's parameter groups), warm-up + cosine schedule over the
    run's optimizer steps, GradScaler.

    The schedule spans ``--epochs`` whatever ``--max-steps`` says: that flag stops a run
    and does not reshape it, so a run stopped by it and re-run without it is the run that
    was never stopped."""
    total_steps = data.steps_per_epoch * cfg.optim.epochs
    optimizer = build_optimizer(cfg.optim, task.param_groups(unwrap(model), cfg))
    return TrainState(
        model=model,
        optimizer=optimizer,
        scheduler=build_scheduler(cfg.optim, optimizer, total_steps),
        scaler=grad_scaler(cfg.optim.amp, worker.device),
    )


def announce(
    cfg: TrainConfig,
    worker: Worker,
    task: Task,
    facts: dict[str, Any],
    data: WorkerData,
    ranks: list[dict],
) -> None:
    """The rank table, the batch arithmetic and the data sizes, once, from rank 0."""
    worker.log(reporting.rank_table(ranks))
    worker.log(
        reporting.batch_line(
            cfg.optim.batch_size, worker.world_size, data.accumulation, cfg.global_batch_size
        )
    )
    described = ", ".join(f"{k} {reporting.short(v)}" for k, v in facts.items())
    worker.log(
        f"data: {task.name(cfg)}, {data.train_size} train / {data.val_size} val samples"
        f"{f' ({described})' if described else ''}; {data.steps_per_epoch} optimizer steps "
        f"of {cfg.global_batch_size} samples per epoch"
    )
    described_order = data.train_order.describe()
    if described_order:
        worker.log(described_order)
    if cfg.scaling.elastic:
        low, high = cfg.scaling.worker_range
        worker.log(
            f"elastic: {low} to {high} workers, now {worker.world_size}; the global batch of "
            f"{cfg.global_batch_size} and the data order stay the same at every count"
        )


def tracker_params(
    cfg: TrainConfig, worker: Worker, task: Task, data: WorkerData
) -> dict[str, Any]:
    """What the experiment tracker records as the run's params: the resolved config (the
    task spec among it), and what this attempt found (world size, global batch,
    accumulation, data sizes, device, versions)."""
    from ray_ddp.tracking.params import versions

    return {
        **cfg.to_dict(),
        "task_name": task.name(cfg),
        "world_size": worker.world_size,
        "global_batch_size": cfg.global_batch_size,
        "accumulation": data.accumulation,
        "steps_per_epoch": data.steps_per_epoch,
        "train_size": data.train_size,
        "val_size": data.val_size,
        "device": worker.device.type,
        **versions(),
    }


def example_batch(data: WorkerData, device: torch.device, watchdog: Watchdog | NullWatchdog):
    """Two readable validation samples of this rank, on its device (None if its share has
    none): what the FLOPs are counted on, and the step's first stand-in for a micro-batch
    with nothing readable (``step.StepCore.stand_in``)."""
    watchdog.doing("start: reading an example batch", slow=True)
    try:
        batch, _ = take_skipped(next(iter(data.val_loader)))
    except StopIteration:  # this rank's validation share is empty
        return None
    return None if batch is None else map_tensors(batch, lambda t: t[:2].to(device))


def count_flops(
    amp: str,
    worker: Worker,
    task: Task,
    model: torch.nn.Module,
    example: Any,
    watchdog: Watchdog | NullWatchdog,
) -> FlopRate:
    """FLOPs per training sample, counted once on ``example`` (a forward and backward of
    a copy of the model), and the workers' peak on GPUs of a known kind at ``amp`` (the
    run's ``--amp``): for ``--amp off``, that of the precision torch runs this model's
    matmuls and convolutions in, read here, after the task built the model and ran its
    loss (``flops.run_peak``); rank 0 logs them."""
    watchdog.doing("start: counting the model's FLOPs", slow=True)
    count = None
    if example is not None:
        count = count_training_flops(unwrap(model), task, example)
    per_sample = count.per_sample if count else None
    peak, precision = None, ""
    if worker.device.type == "cuda":
        name = torch.cuda.get_device_name(worker.device)
        peak, precision = run_peak(name, amp, count.conv_share if count else 0.0)
    worker.log(flops_line(per_sample, peak, precision))
    return FlopRate(per_sample, peak * worker.world_size if peak else None)
