"""The parts of a built-in loop's run (``worker.loop``), built once, here, in the order
things happen: the attempt's number (first: whatever fails later is its own), the data
(its size sets the schedule), the model (identical on every rank), the restore point, the
safeguards (the hang watchdog watches from there on), the model wrapped and its training
state restored, the rank table, the step-level hooks and rank 0's outputs, the FLOPs.

Each part keeps its own state behind a small interface (``Parts``' fields name the
modules); the loop and the epoch's stages (``worker.epoch``) take them from one
:class:`Parts`, and nothing is added to it later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ray_ddp.checkpoint.format import check_compatible, check_strategy, task_meta
from ray_ddp.config import TrainConfig
from ray_ddp.data.seeding import seed_initial_weights
from ray_ddp.data.unreadable import SkipLog
from ray_ddp.io.timeline import mark
from ray_ddp.reliability.hangs.watchdog import NullWatchdog, Watchdog
from ray_ddp.task import Task
from ray_ddp.testing.harness import Harness
from ray_ddp.tracking.params import Settings
from ray_ddp.worker import hooks as hooked
from ray_ddp.worker.collectives import is_distributed
from ray_ddp.worker.comm_stats import AllReduceCounter, attach_counter
from ray_ddp.worker.data import WorkerData, build_worker_data
from ray_ddp.worker.flops import FlopRate
from ray_ddp.worker.identity import Worker, rank_rows, start_worker
from ray_ddp.worker.memory_format import use_channels_last
from ray_ddp.worker.report import Reports
from ray_ddp.worker.resume import Restored, continue_epoch, find_restore_point, restore_training
from ray_ddp.worker.run_tracking import RunTracking
from ray_ddp.worker.sharding import bf16_policy
from ray_ddp.worker.start import (
    Safeguards,
    announce,
    build_train_state,
    count_flops,
    example_batch,
    number_attempt,
    safeguards,
    tracker_params,
    wrap_model,
)
from ray_ddp.worker.state import EpochSums, TrainProgress, TrainState
from ray_ddp.worker.step import StepCore
from ray_ddp.worker.timing import StepTimer
from ray_ddp.worker.unreadable import rewind
from ray_ddp.worker.watch import Outputs, step_hooks, step_profiler


@dataclass
class StepWatch:
    """The attempt's step-level hooks (``worker.watch.step_hooks``), and the two of them
    the loop turns over at each epoch's start."""

    hooks: hooked.Hooks
    timing: hooked.Timing
    """The epoch's data wait and ready times; the attempt's steady step timer."""
    skips: hooked.Skips
    """The epoch's unreadable training samples (``data.unreadable.SkipLog``)."""

    def new_epoch(self, skips: SkipLog) -> None:
        self.timing.new_epoch()
        self.skips.log = skips


@dataclass
class Parts:
    """A built-in loop's run in this worker process: what :func:`build_parts` made."""

    cfg: TrainConfig
    task: Task
    worker: Worker
    data: WorkerData
    """The loaders over this rank's part of the data, the epoch's global order."""
    core: StepCore
    """The step (``worker.step``) over the run's ``TrainState``: the wrapped model, the
    optimizer, schedule and scaler, restored, and ``progress``: the run's position."""
    sums: EpochSums
    """This rank's sums of the epoch's part before the restore point (zero at an epoch's
    start): the first epoch goes on from them."""
    reports: Reports
    """Every rank's reports and rank 0's checkpoints (``worker.report``): the config and
    the task's facts each carries, through the one checkpointer."""
    guards: Safeguards
    """The hang watchdog, the one checkpointer, the reclaim watch, the pass's limits."""
    watch: StepWatch
    outputs: Outputs
    """Rank 0's run logs and tracker run, the rank's profiler."""
    ranks: list[dict[str, Any]]
    """The rank table's rows (hosts, devices)."""
    flops: FlopRate
    counter: AllReduceCounter | None
    """DDP's all-reduces counted (``--comm-stats``), or None."""
    ledger: bool
    """A test's sample ledger is kept (``ray_ddp.testing.Harness.sample_ledger``)."""

    @property
    def state(self) -> TrainState:
        return self.core.state

    @property
    def progress(self) -> TrainProgress:
        """The run's position (``worker.position``) and what a checkpoint carries with it;
        only the pass (``step.train_segment``) and the epoch's end advance it."""
        return self.core.state.progress


class _DataWait:
    """What a Ray Data stream calls before each step's batches: the watchdog told, once
    one runs (the data is built before it starts)."""

    def __init__(self) -> None:
        self.watchdog: Watchdog | NullWatchdog = NullWatchdog()

    def __call__(self, first: bool) -> None:
        self.watchdog.doing(hooked.WAITING_FOR_DATA, slow=first)


def build_parts(config: dict[str, Any]) -> Parts:
    """The run of ``loop.loop_config``'s dict, in this worker process (see the module's
    docstring). Where it fails once the watchdog runs, the watchdog is stopped."""
    cfg = TrainConfig.from_dict(config["config"])
    task, facts, harness = config["task"], config["facts"], config["harness"]
    worker = start_worker(
        cfg.scaling.cpus_per_worker, cfg.logging.log_prefix, cfg.logging.log_all_ranks
    )
    me = f"rank {worker.rank}"
    mark("loop entered (process group up)", me)
    # First: whatever fails later is its own.
    attempt = number_attempt(cfg.checkpointing.run_dir, worker)
    waiting = _DataWait()
    data = build_worker_data(cfg, worker, task, facts, harness, waiting)
    mark("data built", me)
    seed_initial_weights(cfg.optim.seed)
    model, meta = task.model(cfg, facts), task_meta(cfg.target.task, facts)
    mark("model built", me)
    restored = find_restore_point(cfg.checkpointing.resume_from, worker)
    # From here on a rank that stops making progress is found (--hang-timeout).
    # Sharded checkpoints (--strategy fsdp2) are written by every rank, synchronously.
    fsdp = cfg.scaling.strategy == "fsdp2"
    mode = "sync" if fsdp else cfg.checkpointing.checkpoint_mode
    guards = safeguards(cfg, worker, attempt, harness, config.get("notices", True), mode)
    waiting.watchdog = watchdog = guards.watchdog
    try:
        _check_and_load(cfg.scaling.strategy, model, meta, restored)
        # Counted on the whole model: under FSDP2 before sharding takes it apart.
        amp = cfg.optim.amp
        counted = _counted(amp, worker, task, model, data, watchdog) if fsdp else None
        core, sums = _restored_core(cfg, worker, task, model, data, restored, harness.sample_ledger)
        comm = cfg.logging.comm_stats and is_distributed() and not fsdp  # DDP's comm hook
        counter = attach_counter(core.state.model) if comm else None
        mark("model wrapped, state restored", me)
        ranks = rank_rows(worker)
        announce(cfg, worker, task, facts, data, ranks)
        watch, outputs = _watch(cfg, worker, attempt.number, harness, watchdog, core.state.progress,
                                config.get("tracking"))  # fmt: skip
        if outputs.tracker is not None:
            outputs.tracker.params(tracker_params(cfg, worker, task, data))
        mark("rank table, logs", me)
        flops, core.stand_in = counted or _counted(amp, worker, task, core.state.model, data,
                                                   watchdog)  # fmt: skip
        mark("FLOPs counted", me)
    except BaseException:
        watchdog.stop()
        raise
    score = (f"val_{task.best_metric}", task.best_mode)  # what ranks the checkpoints
    reports = Reports(cfg.to_dict(), worker, core.state, meta, score, guards.checkpointer)
    return Parts(cfg, task, worker, data, core, sums, reports, guards, watch, outputs, ranks,
                 flops, counter, harness.sample_ledger)  # fmt: skip


def _counted(
    amp: str, worker: Worker, task: Task, model: torch.nn.Module, data: WorkerData,
    watchdog: Watchdog | NullWatchdog,
) -> tuple[FlopRate, Any]:  # fmt: skip
    """The model's FLOPs at ``amp`` (``--amp``), counted on an example batch of this
    rank's validation share, and the example: the step's first stand-in
    (``step.StepCore.stand_in``)."""
    example = example_batch(data, worker.device, watchdog)
    return count_flops(amp, worker, task, model, example, watchdog), example


def _check_and_load(
    strategy: str, model: torch.nn.Module, meta: dict[str, Any], restored: Restored | None
) -> None:
    """The restore point checked against this run (its task, its ``--strategy``), and its
    weights loaded before DDP broadcasts rank 0's (a sharded checkpoint's are read into
    the shards, later)."""
    if restored is None:
        return
    check_compatible(restored.state, meta, restored.source)
    check_strategy(restored.state, strategy, restored.source)
    if strategy != "fsdp2":
        model.load_state_dict(restored.state["model"])


def _restored_core(
    cfg: TrainConfig, worker: Worker, task: Task, model: torch.nn.Module, data: WorkerData,
    restored: Restored | None, ledger: bool,
) -> tuple[StepCore, EpochSums]:  # fmt: skip
    """The model wrapped (channels_last, DDP or FSDP2, compile), the optimizer, schedule
    and scaler built and restored with the position (inside an epoch: only on the order
    it counts in), and the step over them; this rank's sums of the epoch's part before
    the restore point."""
    fsdp = cfg.scaling.strategy == "fsdp2"
    channels_last = use_channels_last(cfg.data.channels_last, model, worker.device)
    # Under FSDP2, --amp bf16 is mostly its MixedPrecisionPolicy: then no autocast.
    amp = "off" if fsdp and bf16_policy(model, cfg.optim.amp) else cfg.optim.amp
    wrapped = wrap_model(model, channels_last, cfg.target.compile,
                         (task, cfg.optim.amp, worker) if fsdp else None)  # fmt: skip
    state = build_train_state(cfg, worker, task, wrapped, data)
    sums = restore_training(restored, state, worker, cfg.optim, cfg.global_batch_size,
                            data.steps_per_epoch, ledger)  # fmt: skip
    if restored is None or not restored.own:  # --resume-from's tracker run is not ours
        state.progress.tracking_run, state.progress.tracked_since = None, 0
    if worker.is_main:  # bad_samples.csv as the checkpoint left it
        state.progress.bad_sample_rows = rewind(cfg.checkpointing.run_dir, restored, worker.log)
    # Inside an epoch: only on the order its position counts in (a Ray Data stream's
    # epoch restarts).
    sums = continue_epoch(restored, state, worker, cfg.checkpointing.restart_epoch, data, sums)
    core = StepCore(state, task, amp, worker.device, cfg.optim.seed, cfg.optim.grad_clip,
                    channels_last, worker.rank)  # fmt: skip
    return core, sums


def _watch(
    cfg: TrainConfig, worker: Worker, attempt: int, harness: Harness,
    watchdog: Watchdog | NullWatchdog, progress: TrainProgress, tracking: dict[str, Any] | None,
) -> tuple[StepWatch, Outputs]:  # fmt: skip
    """What watches every step (``worker.watch``), for the attempt, and what the run
    writes: rank 0's run logs and tracker run (on the run's own tracker run, which the
    restore kept), the profiler."""
    logs, tracker = None, None
    settings = Settings.from_dict(tracking) if worker.is_main and tracking else None
    if worker.is_main:
        from ray_ddp.io.run_logs import RunLogs  # tensorboardX: rank 0's alone

        logs = RunLogs(cfg.checkpointing.run_dir, cfg.logging.tensorboard)
    if settings is not None:
        tracker = RunTracking(settings, cfg.checkpointing.run_dir, worker, progress.tracking_run,
                              progress.tracked_since)  # fmt: skip
    run_dir = cfg.checkpointing.run_dir
    outputs = Outputs(logs, tracker, step_profiler(cfg.logging, run_dir, attempt, worker))
    timing, skips = hooked.Timing(StepTimer(who=f"rank {worker.rank}")), hooked.Skips(SkipLog())
    between: list[hooked.StepHook] = [skips, hooked.Ledger()]
    if logs is not None:
        between.append(hooked.StepLogs(logs, cfg.logging.log_every_steps))
    hooks = step_hooks(cfg.logging, run_dir, cfg.optim.epochs, worker, watchdog, harness, timing,
                       between=between, tracker=tracker, profiler=outputs.profiler)  # fmt: skip
    return StepWatch(hooks, timing, skips), outputs
