"""The function Ray Train runs in every worker process: build, restore, wrap, then for
each epoch train, evaluate, checkpoint and report.

One worker = one DDP process = one GPU (or a CPU slot). Ray has already set up the process
group (NCCL with GPUs, gloo without) and pinned the worker to its device. Rank 0 alone
logs and attaches checkpoints; every rank calls ``ray.train.report`` (it is a barrier).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import ray.train
import ray.train.torch
import torch
from torch.utils.data import DataLoader

from ray_ddp.checkpoint.format import check_compatible, task_meta, unwrap
from ray_ddp.config.batch import accumulation
from ray_ddp.config.train import TrainConfig
from ray_ddp.data.loaders import make_loaders
from ray_ddp.data.order.global_order import GlobalOrderBatches
from ray_ddp.data.seeding import seed_initial_weights
from ray_ddp.data.unreadable import SkipLog, skipped_line, take_skipped
from ray_ddp.io import reporting
from ray_ddp.io.run_logs import RunLogs
from ray_ddp.io.storage import join, write_bytes
from ray_ddp.io.timeline import mark
from ray_ddp.reliability.attempts import record_attempt
from ray_ddp.reliability.hangs import watchdog as watch
from ray_ddp.reliability.hangs.dump import HangSite, handle_hang
from ray_ddp.reliability.hangs.report import hang_folder
from ray_ddp.reliability.loss_guard import LossGuard
from ray_ddp.reliability.retry_policy import note_step
from ray_ddp.task import Task, map_tensors
from ray_ddp.testing import harness as rig
from ray_ddp.testing.harness import Harness
from ray_ddp.worker.collectives import all_gather, broadcast_buffers, is_distributed, sum_over_ranks
from ray_ddp.worker.comm_stats import attach_counter
from ray_ddp.worker.epoch import (
    WAITING_FOR_DATA,
    EpochPosition,
    EpochTools,
    max_steps_reached,
    train_epoch,
)
from ray_ddp.worker.evaluate import EvalResult, evaluate
from ray_ddp.worker.flops import FlopRate, flops_line, peak_tflops, training_flops_per_sample
from ray_ddp.worker.identity import Worker, rank_rows, start_worker
from ray_ddp.worker.memory_format import use_channels_last
from ray_ddp.worker.optim import build_optimizer, build_scheduler
from ray_ddp.worker.precision import grad_scaler
from ray_ddp.worker.report import checkpoint_and_report, write_mid_epoch_checkpoint
from ray_ddp.worker.resume import Restored, find_restore_point, restore_training
from ray_ddp.worker.state import EpochSums, TrainProgress, TrainState
from ray_ddp.worker.timing import EpochTiming, StepTimer
from ray_ddp.worker.unreadable import EpochSkips, settle


@dataclass
class WorkerData:
    """This worker's view of the data: loaders over its part, and their sizes."""

    train_loader: DataLoader
    train_order: GlobalOrderBatches
    """The batch sampler behind ``train_loader``: this rank's micro-batches of the epoch's
    global order, from the position it is set to."""
    val_loader: DataLoader
    train_size: int
    val_size: int
    steps_per_epoch: int
    """Optimizer steps per epoch: the same at every world size (the last may be short)."""
    accumulation: int
    """Micro-batches each worker accumulates per optimizer step at this world size."""


@dataclass
class RunSoFar:
    """What this attempt has done, for the summary the driver prints."""

    history: list[dict[str, Any]] = field(default_factory=list)
    per_rank: list[dict[str, Any]] = field(default_factory=list)
    """Every rank's speed and memory in the latest epoch."""
    train_seconds: float = 0.0
    samples: int = 0
    flops: FlopRate = field(default_factory=FlopRate)

    def add(self, metrics: dict[str, Any], trained: EpochTrained, per_rank: list[dict]) -> None:
        self.history.append(metrics)
        self.per_rank = per_rank
        self.train_seconds += trained.seconds
        self.samples += trained.all_trained

    def summary(
        self, worker: Worker, progress: TrainProgress, ranks: list[dict], timer: StepTimer
    ) -> dict[str, Any]:
        """What ``train_loop_per_worker`` returns (Ray hands rank 0's to the driver)."""
        return {
            "history": self.history,
            "train_seconds": self.train_seconds,
            "samples_seen": self.samples,
            "epochs_completed": progress.epoch,
            "steps": progress.step,
            "world_size": worker.world_size,
            "device": worker.device.type,
            "ranks": ranks,
            "per_rank": self.per_rank,
            "timing": timer.summary(),
            "flops_per_sample": self.flops.per_sample,
            "utilisation": self.flops.of(self.samples / max(self.train_seconds, 1e-9)),
        }


def loop_config(
    cfg: TrainConfig, task: Task, facts: dict[str, Any], harness: Harness = rig.NONE
) -> dict[str, Any]:
    """What ``train_loop_per_worker`` gets: the config as plain values, the task object
    (Ray pickles it to every worker), the facts the driver found about its data, and a
    test's harness (``ray_ddp.testing``; none outside ray_ddp's tests)."""
    return {"config": cfg.to_dict(), "task": task, "facts": facts, "harness": harness}


def train_loop_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    cfg = TrainConfig.from_dict(config["config"])
    task, facts, harness = config["task"], config["facts"], config["harness"]
    worker = start_worker(cfg.cpus_per_worker, cfg.log_prefix, cfg.log_all_ranks)
    me = f"rank {worker.rank}"
    mark("loop entered (process group up)", me)
    attempt = number_attempt(cfg, worker)  # first: whatever fails later is this attempt's

    # Build: the data (its size sets the schedule), then the model, identical on all ranks.
    data = build_worker_data(cfg, worker, task, facts, harness)
    mark("data built", me)
    seed_initial_weights(cfg.seed)
    model = task.model(cfg, facts)
    meta = task_meta(cfg.task, facts)
    mark("model built", me)

    # Restore: the weights before DDP broadcasts rank 0's, the rest once it all exists.
    restored = find_restore_point(cfg.resume_from, worker)
    # From here on a rank that stops making progress is found (--hang-timeout).
    watch.install(start_watchdog(cfg, worker, attempt))
    try:
        return train_restored(cfg, worker, task, facts, data, model, meta, restored, harness)
    finally:
        watch.install(None)


def train_restored(
    cfg: TrainConfig,
    worker: Worker,
    task: Task,
    facts: dict[str, Any],
    data: WorkerData,
    model: torch.nn.Module,
    meta: dict[str, Any],
    restored: Restored | None,
    harness: Harness,
) -> dict[str, Any]:
    """Load ``restored`` (if any), wrap the model, then train, evaluate, checkpoint and
    report every epoch; returns the summary for the driver."""
    if restored is not None:
        check_compatible(restored.state, meta, restored.source)
        model.load_state_dict(restored.state["model"])
    channels_last = use_channels_last(cfg.channels_last, model, worker.device)
    model = wrap_model(model, channels_last, cfg.compile)
    state = build_train_state(cfg, worker, task, model, data)
    ledger = harness.sample_ledger
    partial = restore_training(restored, state, worker, cfg, data.steps_per_epoch, ledger)
    if cfg.data_engine == "ray":  # a Ray Data stream restarts an epoch it was inside
        from ray_ddp.worker.resume import restart_epoch

        partial = restart_epoch(state, worker, data.steps_per_epoch, partial)
    counter = attach_counter(state.model) if cfg.comm_stats and is_distributed() else None

    me = f"rank {worker.rank}"
    mark("model wrapped, state restored", me)
    ranks = rank_rows(worker)
    announce(cfg, worker, task, facts, data, ranks)
    tools = epoch_tools(cfg, worker, task, channels_last, harness)
    mark("rank table, logs", me)
    run = RunSoFar(flops=count_flops(cfg, worker, task, state.model, data))
    mark("FLOPs counted", me)
    progress = state.progress
    if progress.epoch >= cfg.epochs or max_steps_reached(cfg, progress.step):
        worker.log(f"nothing to do: {progress.epoch} of {cfg.epochs} epochs already done")
    try:
        for epoch in range(progress.epoch, cfg.epochs):
            if max_steps_reached(cfg, progress.step):
                break
            steps_before, syncs_before = progress.step, counter.syncs if counter else 0
            tools.timing = EpochTiming()
            tools.skips = SkipLog(cfg.max_bad_samples, worker.rank, epoch)
            trained = train_one_epoch(cfg, worker, state, data, tools, partial, meta)
            if cfg.data_engine == "ray":  # rows Ray Data's tasks could not read (rank 0's)
                tools.skips.rows += data.train_order.take_unreadable()
            partial = fresh_sums(ledger)
            evaluated = validate(cfg, worker, task, state, data)
            skips = count_unreadable(cfg, worker, tools, evaluated, data)  # may stop the run
            # A --max-steps stop inside the epoch is saved as that position, so a re-run
            # with more steps trains the rest of the epoch instead of skipping it.
            finished = trained.end_sample >= data.train_size
            progress.epoch, progress.sample = (
                (epoch + 1, 0) if finished else (epoch, trained.end_sample)
            )
            if finished and ledger:
                write_ledger(cfg, worker, epoch, trained.ledger)
            metrics = epoch_metrics(task, state, trained, evaluated, epoch + 1)
            metrics.update(world_size=worker.world_size, accum_steps=data.accumulation)
            metrics.update(run.flops.of(metrics["samples_per_s"]))
            metrics["bad_samples"] = skips.total
            progress.best_score = better(task, progress.best_score, metrics)
            if counter is not None:
                steps = max(1, progress.step - steps_before)
                metrics["allreduces_per_step"] = (counter.syncs - syncs_before) / steps
            speed = trained.own_trained / trained.seconds
            own = fresh_sums(ledger) if finished else trained.own
            timing = tools.timing.summary(trained.seconds)
            watch.doing("epoch end: checkpoint and report", slow=True)
            per_rank = checkpoint_and_report(
                cfg, worker, state, meta, metrics, own, harness, speed, timing
            )  # fmt: skip
            log_epoch(cfg, worker, tools, metrics, per_rank, progress, data, ranks)
            watch.progress("epoch end")
            run.add(metrics, trained, per_rank)
    except Exception as exc:
        note_step(exc, progress.step + 1)  # a restart that fails alike is not retried
        raise
    finally:
        if tools.logs is not None:
            tools.logs.close()  # flushes TensorBoard, renders curves.png from metrics.csv
    mark("training ended, logs closed", me)
    return run.summary(worker, progress, ranks, tools.timer)


# ---------------------------------------------------------------------------- build
def build_worker_data(
    cfg: TrainConfig, worker: Worker, task: Task, facts: dict[str, Any], harness: Harness
) -> WorkerData:
    if cfg.data_engine == "ray":  # Ray Data reads and decodes (ray_ddp.data.ray_data)
        from ray_ddp.data.ray_data.worker import worker_data

        def waiting(first: bool) -> None:  # before each step's batches come from Ray Data
            watch.doing(WAITING_FOR_DATA, slow=first)

        return WorkerData(**worker_data(cfg, worker, waiting))
    if cfg.download:
        for turn in (0, 1):
            if download_turn(worker.rank, worker.local_rank) == turn:
                task.datasets(cfg, facts)
            if is_distributed():
                torch.distributed.barrier()
    train_ds, val_ds = task.datasets(dataclasses.replace(cfg, download=False), facts)
    train_ds = rig.hang_loader(harness, cfg.run_dir, train_ds)
    train_loader, train_order, val_loader = make_loaders(
        cfg, task, train_ds, val_ds, worker.rank, worker.world_size, worker.device
    )
    return WorkerData(
        train_loader,
        train_order,
        val_loader,
        train_size=len(train_ds),  # type: ignore[arg-type]
        val_size=len(val_ds),  # type: ignore[arg-type]
        steps_per_epoch=train_order.plan.steps,  # the order is at the epoch's start here
        accumulation=accumulation(cfg.global_batch_size, cfg.batch_size, worker.world_size),
    )


def download_turn(rank: int, local_rank: int) -> int | None:
    """When this worker fetches the data with ``--download``: turn 0 (rank 0, alone), turn
    1 (the first worker of every other node, at once), or never (None: it waits).

    One fetch per node, not one per worker racing on the same files. Rank 0's node goes
    first: where nodes share ``--data-dir`` (NFS) the others then find the files complete
    and only check them (torchvision skips a finished download), so no two nodes ever
    write the same files; where each node has its own disk, they fetch in parallel."""
    if rank == 0:
        return 0
    return 1 if local_rank == 0 else None


def wrap_model(model: torch.nn.Module, channels_last: bool, compiled: bool) -> torch.nn.Module:
    """NHWC if asked, then DDP (with more than one worker) on this worker's device, then
    torch.compile if asked: compiling the DDP module lets its graph break at the gradient
    buckets, which keeps the all-reduces overlapping the backward."""
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = ray.train.torch.prepare_model(model)
    return torch.compile(model) if compiled else model


def build_train_state(
    cfg: TrainConfig, worker: Worker, task: Task, model: torch.nn.Module, data: WorkerData
) -> TrainState:
    """Optimizer (over the task's parameter groups), warm-up + cosine schedule over the
    run's optimizer steps, GradScaler."""
    total_steps = data.steps_per_epoch * cfg.epochs
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    optimizer = build_optimizer(cfg, task.param_groups(unwrap(model), cfg))
    return TrainState(
        model=model,
        optimizer=optimizer,
        scheduler=build_scheduler(cfg, optimizer, total_steps),
        scaler=grad_scaler(cfg.amp, worker.device),
    )


def epoch_tools(
    cfg: TrainConfig, worker: Worker, task: Task, channels_last: bool, harness: Harness
) -> EpochTools:
    """The step timer, the loss guard, and on rank 0 the run logs and progress lines."""
    logs = None
    if worker.is_main:
        logs = RunLogs(cfg.run_dir, cfg.tensorboard)
    return EpochTools(
        task=task,
        device=worker.device,
        timer=StepTimer(who=f"rank {worker.rank}"),
        guard=LossGuard(worker.device, worker.rank, check_every=cfg.log_every_steps),
        logs=logs,
        show_progress=worker.is_main and cfg.progress_interval_s > 0,
        channels_last=channels_last,
        harness=harness,
        run_dir=cfg.run_dir,
    )


@dataclass(frozen=True)
class Attempt:
    number: int
    peers: tuple[tuple[str, int], ...]
    """Every rank's (host, pid), in rank order."""


def number_attempt(cfg: TrainConfig, worker: Worker) -> Attempt:
    """This attempt's number (rank 0 adds it to ``<run>/attempts.csv``) and every rank's
    host and pid, known to every rank (a collective)."""
    number = 0
    if worker.is_main:
        checkpoint = ray.train.get_checkpoint()
        name = os.path.basename(checkpoint.path.rstrip("/")) if checkpoint else ""
        number = record_attempt(cfg.run_dir, worker.world_size, name)
    gathered = all_gather((number, socket.gethostname(), os.getpid()))
    return Attempt(gathered[0][0], tuple((host, pid) for _, host, pid in gathered))


def start_watchdog(cfg: TrainConfig, worker: Worker, attempt: Attempt) -> watch.Watchdog | None:
    """The rank's hang watchdog, started, unless ``--hang-timeout 0``."""
    if cfg.hang_timeout == 0:
        return None
    folder = hang_folder(cfg.run_dir, attempt.number)
    site = HangSite(worker.rank, worker.world_size, attempt.number, folder, attempt.peers)
    return watch.Watchdog(
        on_hang=lambda stall: handle_hang(stall, site),
        steady_s=cfg.hang_timeout,
        grace_s=cfg.hang_grace,
        peer_check=site.peer_found_hang,
    ).start()


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
            cfg.batch_size, worker.world_size, data.accumulation, cfg.global_batch_size
        )
    )
    described = ", ".join(f"{k} {reporting.short(v)}" for k, v in facts.items())
    worker.log(
        f"data: {task.name(cfg)}, {data.train_size} train / {data.val_size} val samples"
        f"{f' ({described})' if described else ''}; {data.steps_per_epoch} optimizer steps "
        f"of {cfg.global_batch_size} samples per epoch"
    )
    stream_line = getattr(data.train_order, "describe", None)
    if stream_line is not None:
        worker.log(stream_line())
    if cfg.elastic:
        low, high = cfg.worker_range
        worker.log(
            f"elastic: {low} to {high} workers, now {worker.world_size}; the global batch of "
            f"{cfg.global_batch_size} and the data order stay the same at every count"
        )


def count_flops(
    cfg: TrainConfig, worker: Worker, task: Task, model: torch.nn.Module, data: WorkerData
) -> FlopRate:
    """FLOPs per training sample, counted once on two validation samples (a forward and
    backward of a copy of the model), and the workers' peak on GPUs of a known kind;
    rank 0 logs them."""
    watch.doing("start: counting the model's FLOPs", slow=True)
    try:
        batch, _ = take_skipped(next(iter(data.val_loader)))
    except StopIteration:  # this rank's validation share is empty
        batch = None
    per_sample = None
    if batch is not None:
        batch = map_tensors(batch, lambda t: t[:2].to(worker.device))
        per_sample = training_flops_per_sample(unwrap(model), task, batch)
    peak = None
    if worker.device.type == "cuda":
        peak = peak_tflops(torch.cuda.get_device_name(worker.device), cfg.amp)
    worker.log(flops_line(per_sample, peak, cfg.amp))
    return FlopRate(per_sample, peak * worker.world_size if peak else None)


# ---------------------------------------------------------------------------- train
@dataclass(frozen=True)
class EpochTrained:
    """One epoch's training, summed over all ranks where it says so."""

    loss_sum: float
    """All ranks: sum of per-sample losses over the whole epoch."""
    samples: int
    """All ranks: samples of the whole epoch (a resumed epoch's first part included)."""
    all_trained: int
    """All ranks: samples trained by this attempt (for speed)."""
    own_trained: int
    """This rank's samples trained by this attempt."""
    skipped: int
    """This rank's skipped fp16 steps."""
    seconds: float
    own: EpochSums
    """This rank's sums over the epoch so far (what a checkpoint of a partial epoch keeps)."""
    end_sample: int
    """Samples of the epoch's order done: all of them, or fewer where ``--max-steps`` hit."""
    ledger: list[tuple[int, int]] | None
    """This rank's ``(step, index)`` of the whole epoch (``--sample-ledger``)."""


def train_one_epoch(
    cfg: TrainConfig,
    worker: Worker,
    state: TrainState,
    data: WorkerData,
    tools: EpochTools,
    sums: EpochSums,
    meta: dict[str, Any],
) -> EpochTrained:
    """Epoch ``state.progress.epoch`` from ``progress.sample`` on, with a mid-epoch
    checkpoint every ``--checkpoint-every`` optimizer steps."""
    progress = state.progress
    position = EpochPosition(progress.epoch, progress.sample)
    progress.sample = 0
    started = time.perf_counter()
    trained = skipped = 0
    while True:
        # A new, reproducible order every epoch, from where a checkpoint left it.
        data.train_order.set_position(position.epoch, position.sample)
        with explain_oom(cfg, worker, "training"):
            segment = train_epoch(cfg, state, data.train_loader, data.train_order, sums, tools)
        sums, trained, skipped = segment.sums, trained + segment.samples, skipped + segment.skipped
        if not segment.checkpoint_due:
            break
        position = segment.end
        score = (f"val_{tools.task.best_metric}", tools.task.best_mode)
        watch.doing("checkpoint inside the epoch", slow=True)
        settle(cfg.run_dir, tools.skips, worker.is_main)  # named before a crash can lose them
        write_mid_epoch_checkpoint(cfg, worker, state, meta, position, sums, score, tools.harness)
        watch.progress(f"checkpoint at step {state.progress.step}")
    seconds = time.perf_counter() - started
    watch.doing("epoch end: all-reduce of the epoch's sums", collective=True)
    totals = sum_over_ranks(
        {"loss_sum": sums.loss_sum, "samples": sums.samples, "trained": trained}, worker.device
    )
    return EpochTrained(
        loss_sum=totals["loss_sum"],
        samples=int(totals["samples"]),
        all_trained=int(totals["trained"]),
        own_trained=trained,
        skipped=skipped,
        seconds=seconds,
        own=sums,
        end_sample=segment.end.sample,
        ledger=sums.ledger,
    )


def validate(
    cfg: TrainConfig, worker: Worker, task: Task, state: TrainState, data: WorkerData
) -> EvalResult:
    """Exact sharded evaluation of the weights and buffers the checkpoint will hold.

    DDP copies rank 0's buffers (BatchNorm running statistics) to the other ranks only at
    the start of a synchronised forward, so after the epoch's last step every rank holds
    its own. Rank 0's are what gets saved: every rank evaluates with those."""
    model = unwrap(state.model)
    watch.doing("evaluation: broadcast of rank 0's buffers", collective=True)
    broadcast_buffers(model)
    batches = watch.watched(
        data.val_loader, "evaluation", then="evaluation: all-reduce of the sums"
    )
    with explain_oom(cfg, worker, "evaluation"):
        return evaluate(model, batches, worker.device, task, cfg.amp)


def count_unreadable(
    cfg: TrainConfig, worker: Worker, tools: EpochTools, evaluated: EvalResult, data: WorkerData
) -> EpochSkips:
    """The epoch's unreadable samples, all ranks (a collective): named in the run's
    ``bad_samples.csv`` and said by rank 0; over ``--max-bad-samples`` every rank raises
    BadSamplesError here, before the epoch is checkpointed."""
    watch.doing("epoch end: gathering the unreadable samples", collective=True)
    skips = settle(cfg.run_dir, tools.skips, worker.is_main, evaluated.skipped)
    if skips.total:
        epoch = tools.skips.epoch
        worker.log(
            skipped_line(
                epoch, skips.train, skips.val, evaluated.samples, data.val_size, cfg.run_dir
            )
        )
    return skips


def better(task: Task, best: float | None, metrics: dict[str, Any]) -> float:
    """The best validation score so far, after this epoch's (by the task's mode)."""
    score = metrics[f"val_{task.best_metric}"]
    if best is None:
        return score
    return max(best, score) if task.best_mode == "max" else min(best, score)


def fresh_sums(ledger: bool) -> EpochSums:
    """Zero sums for a new epoch (with an empty ledger for the harness's sample ledger)."""
    return EpochSums(ledger=[] if ledger else None)


def write_ledger(
    cfg: TrainConfig, worker: Worker, epoch: int, ledger: list[tuple[int, int]] | None
) -> None:
    """The sample ledger (a test's, ``ray_ddp.testing``): every rank's ``(step, index)`` of
    the finished epoch, gathered to rank 0 and written to ``<run>/ledger/epoch-<N>.csv`` (a
    redone epoch's end overwrites it)."""
    rows = [row for part in all_gather(ledger or []) for row in part]
    if not worker.is_main:
        return
    lines = ["step,index", *(f"{step},{index}" for step, index in sorted(rows))]
    path = join(cfg.run_dir, "ledger", f"epoch-{epoch + 1}.csv")  # a local path or a URI
    write_bytes(path, ("\n".join(lines) + "\n").encode())


@contextlib.contextmanager
def explain_oom(cfg: TrainConfig, worker: Worker, phase: str) -> Iterator[None]:
    """Turn an out-of-memory error into what to change: the per-worker batch."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        batch = cfg.global_batch_size
        size = (
            f"batches of 2 x --batch-size = {2 * cfg.batch_size}"
            if phase == "evaluation"  # no activations kept for backward: twice the batch
            else f"--batch-size {cfg.batch_size}"
        )
        raise RuntimeError(
            f"out of memory on rank {worker.rank} ({worker.device}) during {phase} with {size} "
            f"per worker: lower --batch-size and raise --accum-steps to keep the global batch "
            f"of {batch}"
        ) from exc


def epoch_metrics(
    task: Task, state: TrainState, trained: EpochTrained, evaluated: EvalResult, epoch: int
) -> dict[str, Any]:
    """What an epoch reports to Ray, prints and logs: the task's validation metrics (exact
    means of their sums, and what ``summarize`` derives) as ``val_<name>``."""
    metrics: dict[str, Any] = {
        "epoch": epoch,
        "step": state.progress.step,
        "train_loss": trained.loss_sum / max(1.0, trained.samples),
        **{f"val_{k}": v for k, v in task.summarize(evaluated.means).items()},
        "evaluated_samples": evaluated.samples,
        "lr": state.lr,
        "train_samples": trained.samples,
        "samples_per_s": trained.all_trained / trained.seconds,
        "epoch_s": trained.seconds,
    }
    if state.scaler.is_enabled():
        metrics["amp_skipped_steps"] = trained.skipped
    return metrics


def log_epoch(
    cfg: TrainConfig,
    worker: Worker,
    tools: EpochTools,
    metrics: dict[str, Any],
    per_rank: list[dict[str, Any]],
    progress: TrainProgress,
    data: WorkerData,
    ranks: list[dict[str, Any]],
) -> None:
    """The epoch line, stragglers and the per-worker table from rank 0; the run logs'
    epoch row. (``ranks``: the rank table's rows, for the stragglers' hosts.)"""
    worker.log(reporting.epoch_line(metrics, cfg.epochs))
    for line in reporting.straggler_lines(per_rank, ranks):
        worker.log(line)
    if progress.sample:  # stopped inside the epoch
        worker.log(
            f"stopped at --max-steps {cfg.max_steps}, sample {progress.sample}/"
            f"{data.train_size} of epoch {progress.epoch + 1}: a re-run with more steps "
            "continues from there"
        )
    worker.log(reporting.worker_table(per_rank))
    if tools.logs is not None:
        tools.logs.epoch(metrics, per_rank)
