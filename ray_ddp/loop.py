"""The per-worker training loop that Ray Train runs in every worker process.

One worker = one DDP process = one GPU (or a CPU slot). Ray has already set up the process
group (NCCL with GPUs, gloo without) and pinned the worker to its device; this loop builds
data and model, wraps them with ``prepare_data_loader`` / ``prepare_model``, trains with
AMP and gradient accumulation, evaluates exactly across ranks every epoch, and reports a
checkpoint from rank 0 through ``ray.train.report`` (which every rank calls, as a barrier).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from ray_ddp import reporting
from ray_ddp.checkpoint import (
    CheckpointError,
    TrainProgress,
    capture_rng,
    check_compatible,
    load_state,
    model_meta,
    restore_rng,
    save_state,
    unwrap,
)
from ray_ddp.comm_stats import AllReduceCounter, attach_counter
from ray_ddp.config import TrainConfig
from ray_ddp.datasets import build_datasets
from ray_ddp.epoch import train_epoch
from ray_ddp.evaluation import evaluate
from ray_ddp.loaders import make_loaders
from ray_ddp.models import build_model
from ray_ddp.numerics import LossGuard
from ray_ddp.optim import build_optimizer, build_scheduler
from ray_ddp.precision import grad_scaler, use_channels_last
from ray_ddp.run_logs import RunLogs
from ray_ddp.step_timing import StepTimer
from ray_ddp.storage import list_checkpoints


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_gather(obj: Any) -> list[Any]:
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _peak_memory(device: torch.device) -> tuple[float, str]:
    """This process's peak memory in MB: CUDA peak allocated on GPU, resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "CUDA peak allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "peak RSS"


def _load_checkpoint(checkpoint: ray.train.Checkpoint) -> dict[str, Any]:
    with checkpoint.as_directory() as directory:
        return load_state(directory)


def _restore_source(cfg: TrainConfig, log) -> tuple[dict[str, Any] | None, str | None]:
    """The state to start from: this run's own latest checkpoint (a re-run of the same
    name, or Ray restarting workers after a failure) before ``--resume-from``.

    A latest checkpoint that cannot be read (truncated, corrupt) is skipped with a warning
    for the newest older one that can; training never silently starts over."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return (load_state(cfg.resume_from), cfg.resume_from) if cfg.resume_from else (None, None)
    try:
        return _load_checkpoint(checkpoint), checkpoint.path
    except CheckpointError as exc:
        log(f"warning: the latest checkpoint is unusable ({exc}); trying older ones")
    latest = checkpoint.path.rstrip("/")
    run_dir = latest.rsplit("/", 1)[0]
    fs = checkpoint.filesystem  # local or s3/gs alike
    older = [p for p in list_checkpoints(fs, run_dir) if p < latest]
    for path in reversed(older):
        try:
            state = _load_checkpoint(ray.train.Checkpoint(path, filesystem=fs))
        except CheckpointError as exc:
            log(f"warning: {path} is unusable too ({exc})")
            continue
        log(f"warning: resuming from the older checkpoint {path}")
        return state, path
    raise CheckpointError(
        f"no usable checkpoint in {run_dir}; move the run aside or use a new --name"
    )


def quiet_report_lines() -> None:
    """Ray 2.60 logs every ``report`` call at INFO from a logger named after its file
    path (outside ``ray.train``, so LoggingConfig's level does not reach it): two lines
    per epoch that would bury ours. Raise that one logger to WARNING."""
    from ray.train.v2._internal.execution import context as train_context

    logging.getLogger(train_context.__file__).setLevel(logging.WARNING)


def train_loop_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    cfg = TrainConfig.from_dict(config)
    quiet_report_lines()
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    is_main = rank == 0  # the world rank, never the local rank: one logger per run

    prefix = cfg.extra.get("log_prefix", "")  # a Tune trial's id: trials interleave
    if cfg.log_all_ranks:
        prefix += f"[rank {rank}] "

    def log(message: str) -> None:
        # Straight to stdout: Ray Train patches print() into its logger, which echoes
        # every line twice on the driver.
        if is_main or cfg.log_all_ranks:
            sys.stdout.write(prefix + message.replace("\n", "\n" + prefix) + "\n")
            sys.stdout.flush()

    # Ray reserved cpus_per_worker CPUs for this process; more threads would oversubscribe.
    torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
    device = ray.train.torch.get_device()

    if cfg.download:
        # One download per node (by its local rank 0), not one per worker racing on the
        # same files; everyone else waits, then reads what is on disk.
        if context.get_local_rank() == 0:
            build_datasets(cfg)
        if _distributed():
            dist.barrier()
    train_ds, val_ds, info = build_datasets(dataclasses.replace(cfg, download=False))
    train_loader, train_sampler, val_loader = make_loaders(
        cfg, train_ds, val_ds, rank, world_size, device
    )

    # The same seed on every rank gives identical initial weights (DDP also broadcasts
    # rank 0's on wrapping; this makes it true before, too).
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, info.input_shape, info.num_classes)
    meta = model_meta(cfg.model, info.num_classes, info.input_shape)
    state, source = _restore_source(cfg, log)
    if state is not None:
        check_compatible(state, meta, source or "checkpoint")
        model.load_state_dict(state["model"])

    nhwc = use_channels_last(cfg.channels_last, model, info.input_shape, device)
    if nhwc:
        model = model.to(memory_format=torch.channels_last)
    model = ray.train.torch.prepare_model(model)  # DDP on >1 worker; moved to `device`
    counter: AllReduceCounter | None = None
    if cfg.comm_stats and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        counter = attach_counter(model)

    batches_per_epoch = len(train_loader)  # micro-batches per worker (sampler at batch 0)
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.accum_steps)
    total_steps = steps_per_epoch * cfg.epochs
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    optimizer = build_optimizer(cfg, model.parameters())
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    scaler = grad_scaler(cfg.amp, device)
    progress = TrainProgress()
    partial = (0.0, 0)  # this rank's (loss sum, samples) of a mid-epoch checkpoint's epoch

    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        progress = TrainProgress(**state["progress"])
        same_world = len(state["rng"]) == world_size
        if same_world:
            restore_rng(state["rng"][rank])
        else:  # a different world size: data order is still exact, dropout RNG is not
            torch.manual_seed(cfg.seed + 7919 * progress.epoch + rank)
        if progress.batch and not same_world:
            # A mid-epoch position is a position in each rank's shard: with another world
            # size the shards differ, so the interrupted epoch is started over.
            log(
                f"world size changed ({len(state['rng'])} -> {world_size}): epoch "
                f"{progress.epoch + 1} restarts from its first batch"
            )
            progress.batch = 0
        elif progress.batch:
            partial = tuple(state["epoch_partial"][rank])  # type: ignore[assignment]
        where = f", {progress.batch} micro-batches into epoch {progress.epoch + 1}"
        log(
            f"resumed from {source}: {progress.epoch} epochs, {progress.step} steps done"
            + (where if progress.batch else "")
        )
    else:
        # Different ranks draw different dropout randomness from here on.
        torch.manual_seed(cfg.seed + rank)

    rows = _all_gather(
        {
            "rank": rank,
            "local_rank": context.get_local_rank(),
            "node_rank": context.get_node_rank(),
            "host": socket.gethostname(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "device": str(device),
        }
    )
    log(reporting.rank_table(rows))
    log(reporting.batch_line(cfg.batch_size, world_size, cfg.accum_steps))
    log(
        f"data: {cfg.dataset}, {len(train_ds)} train / {len(val_ds)} val samples, "
        f"{info.num_classes} classes; {batches_per_epoch} micro-batches and "
        f"{steps_per_epoch} optimizer steps per epoch per worker"
    )

    history: list[dict[str, Any]] = []
    per_rank: list[dict[str, Any]] = []
    train_seconds = 0.0
    samples_seen = 0
    timer = StepTimer()
    guard = LossGuard(device, rank, check_every=cfg.log_every_steps)
    logs = (
        RunLogs(os.path.join(cfg.storage_path, cfg.name or ""), cfg.tensorboard)
        if is_main
        else None
    )
    if progress.epoch >= cfg.epochs or (cfg.max_steps and progress.step >= cfg.max_steps):
        log(f"nothing to do: {progress.epoch} of {cfg.epochs} epochs already done")

    def save(
        metrics: dict[str, Any], loss_sum: float, seen: int, samples_per_s: float = 0.0
    ) -> None:
        """A checkpoint of every rank's state at an optimizer-step boundary (a barrier)."""
        guard.check()  # every rank, before the all-gather that precedes the write
        peak_mb, memory_kind = _peak_memory(device)
        stats = {
            "rank": rank,
            "samples_per_s": samples_per_s,
            "peak_memory_mb": peak_mb,
            "memory_kind": memory_kind,
        }
        # One collective for all of it: every rank's RNG and partial sums (for the
        # checkpoint) and its speed and memory (for the balance table).
        gathered = _all_gather({"rng": capture_rng(), "partial": (loss_sum, seen), "stats": stats})
        per_rank[:] = [g["stats"] for g in gathered]
        if not metrics.get("mid_epoch"):
            metrics.update(reporting.balance(per_rank))
        _report(
            cfg,
            metrics,
            is_main,
            model,
            optimizer,
            scheduler,
            scaler,
            progress,
            meta,
            [g["rng"] for g in gathered],
            [g["partial"] for g in gathered],
        )

    def mid_epoch_checkpoint(epoch: int, batch: int, loss_sum: float, seen: int) -> None:
        progress.batch = batch
        save(
            {
                "epoch": progress.epoch,
                "step": progress.step,
                "batch": batch,
                "mid_epoch": True,
                # Not validated. Scored below every epoch checkpoint (so Ray keeps it only
                # while it is the latest); not NaN, which Ray's saved state turns to null.
                "val_acc": -1.0,
                "lr": optimizer.param_groups[0]["lr"],
            },
            loss_sum,
            seen,
        )
        progress.batch = 0
        log(
            f"checkpoint: step {progress.step} (epoch {epoch + 1}, micro-batch "
            f"{batch}/{batches_per_epoch})"
        )

    try:
        for epoch in range(progress.epoch, cfg.epochs):
            if cfg.max_steps and progress.step >= cfg.max_steps:
                break
            start_batch, progress.batch = progress.batch, 0
            # A new, reproducible shuffle every epoch, from where a checkpoint left it.
            train_sampler.set_position(epoch, start_batch)
            started = time.perf_counter()
            syncs_before = counter.syncs if counter else 0
            steps_before = progress.step
            try:
                done = train_epoch(
                    cfg,
                    model,
                    train_loader,
                    optimizer,
                    scheduler,
                    scaler,
                    device,
                    progress,
                    epoch,
                    (start_batch, batches_per_epoch),
                    partial,
                    timer=timer,
                    guard=guard,
                    logs=logs,
                    checkpoint=mid_epoch_checkpoint,
                    report_progress=is_main and cfg.progress_interval_s > 0,
                    channels_last=nhwc,
                )
            except torch.OutOfMemoryError as exc:
                raise RuntimeError(
                    f"out of memory on rank {rank} ({device}) with --batch-size {cfg.batch_size} "
                    f"per worker: lower --batch-size and raise --accum-steps to keep the global "
                    f"batch of {cfg.batch_size * world_size * cfg.accum_steps}"
                ) from exc
            partial = (0.0, 0)
            epoch_s = time.perf_counter() - started
            seen_now = done.seen_now
            totals = torch.tensor(
                [done.loss_sum, done.seen, seen_now], dtype=torch.float64, device=device
            )
            if _distributed():
                dist.all_reduce(totals)
            train_loss = totals[0].item() / max(1.0, totals[1].item())
            result = evaluate(unwrap(model), val_loader, device, cfg.amp)
            global_samples = int(totals[2].item())
            train_seconds += epoch_s
            samples_seen += global_samples
            progress.epoch = epoch + 1
            progress.best_val_acc = max(progress.best_val_acc, result.accuracy)
            metrics: dict[str, Any] = {
                "epoch": progress.epoch,
                "step": progress.step,
                "train_loss": train_loss,
                "val_loss": result.loss,
                "val_acc": result.accuracy,
                "val_correct": result.correct,
                "val_count": result.count,
                "lr": optimizer.param_groups[0]["lr"],
                "samples_per_s": global_samples / epoch_s,
                "epoch_s": epoch_s,
            }
            if scaler.is_enabled():
                metrics["amp_skipped_steps"] = done.skipped
            if counter is not None:
                steps = progress.step - steps_before
                metrics["allreduces_per_step"] = (counter.syncs - syncs_before) / max(1, steps)
            save(metrics, 0.0, 0, seen_now / epoch_s)
            log(reporting.epoch_line(metrics, cfg.epochs))
            log(reporting.worker_table(per_rank))
            if logs is not None:
                logs.epoch(metrics, per_rank)
            history.append(metrics)
    finally:
        if logs is not None:
            logs.close()  # flushes TensorBoard, renders curves.png from metrics.csv

    return {
        "history": history,
        "train_seconds": train_seconds,
        "samples_seen": samples_seen,
        "epochs_completed": progress.epoch,
        "steps": progress.step,
        "world_size": world_size,
        "device": device.type,
        "ranks": rows,
        "per_rank": per_rank,
        "timing": timer.summary(),
    }


def _report(
    cfg: TrainConfig,
    metrics: dict[str, Any],
    is_main: bool,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    progress: TrainProgress,
    meta: dict[str, Any],
    rng: list[dict[str, Any]],
    epoch_partial: list[tuple[float, int]],
) -> None:
    """Every rank reports (it is a barrier); only rank 0 attaches the checkpoint."""
    if not is_main:
        ray.train.report(metrics)
        return
    directory = tempfile.mkdtemp(prefix="ray_ddp_ckpt_")
    try:
        save_state(
            directory,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            progress=progress,
            config=cfg.to_dict(),
            model_meta=meta,
            rng_per_rank=rng,
            epoch_partial=epoch_partial,
        )
        # SYNC upload (the default): the checkpoint is in storage when report returns.
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
