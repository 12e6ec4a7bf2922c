"""One worker's training run: what Ray Train runs in every worker process (``loop``).

One worker = one DDP process = one GPU (or a CPU slot). Ray has already set up the process
group (NCCL with GPUs, gloo without) and pinned the worker to its device. A
:class:`WorkerRun` is read top to bottom in the order things happen:

- ``__init__`` (build): the attempt's number, the data (its size sets the schedule), the
  model (identical on every rank), where it restores from, the hang watchdog;
- :meth:`restore`: the weights before DDP broadcasts rank 0's, the wrapped model, the
  optimizer and schedule, the rest of the checkpoint; the rank table and the data line;
- :meth:`train`: every epoch: :meth:`train_epoch` (passes of ``step.train_segment``, with
  a checkpoint every ``--checkpoint-every`` steps), :meth:`validate`, then
  :meth:`end_epoch` (unreadable samples, metrics, the checkpoint, the epoch's lines).

Rank 0 alone logs and attaches checkpoints; every rank calls ``ray.train.report`` (a
barrier). What happens around each step attaches as step-level hooks (``hooks``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ray_ddp.checkpoint.format import check_compatible, check_strategy, task_meta, unwrap
from ray_ddp.config import TrainConfig
from ray_ddp.config.sections import step_range
from ray_ddp.data.seeding import seed_initial_weights
from ray_ddp.data.unreadable import SkipLog, skipped_line
from ray_ddp.io.timeline import mark
from ray_ddp.reliability.hangs.watchdog import NullWatchdog, watched
from ray_ddp.reliability.loss_guard import LossGuard
from ray_ddp.reliability.retry_policy import note_step
from ray_ddp.task import Task
from ray_ddp.testing.harness import Harness
from ray_ddp.tracking.params import Settings
from ray_ddp.worker import hooks as hooked
from ray_ddp.worker.collectives import broadcast_buffers, is_distributed, sum_over_ranks
from ray_ddp.worker.comm_stats import attach_counter
from ray_ddp.worker.data import build_worker_data
from ray_ddp.worker.evaluate import EvalResult, evaluate
from ray_ddp.worker.identity import Worker, rank_rows, start_worker
from ray_ddp.worker.memory_format import use_channels_last
from ray_ddp.worker.profile import StepProfiler
from ray_ddp.worker.report import checkpoint_and_report, write_mid_epoch_checkpoint
from ray_ddp.worker.results import (
    EpochTrained,
    RunSoFar,
    better,
    epoch_metrics,
    fresh_sums,
    log_epoch,
    write_ledger,
)
from ray_ddp.worker.resume import continue_epoch, find_restore_point, restore_training
from ray_ddp.worker.run_tracking import RunTracking
from ray_ddp.worker.sharding import bf16_policy
from ray_ddp.worker.start import (
    announce,
    build_train_state,
    count_flops,
    example_batch,
    number_attempt,
    safeguards,
    tracker_params,
    wrap_model,
)
from ray_ddp.worker.step import StepCore, train_segment
from ray_ddp.worker.timing import StepTimer
from ray_ddp.worker.unreadable import EpochSkips, rewind, settle

if TYPE_CHECKING:
    from ray_ddp.io.run_logs import RunLogs
    from ray_ddp.worker.flops import FlopRate


class WorkerRun:
    """A worker's run: its config, task, data, model and training state, and the stages
    a reader looks for (see the module's docstring)."""

    def __init__(
        self, cfg: TrainConfig, task: Task, facts: dict[str, Any], harness: Harness,
        worker: Worker, notices: bool = True, tracking: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.task, self.facts, self.harness, self.worker = (
            cfg,
            task,
            facts,
            harness,
            worker,
        )
        self.me = f"rank {worker.rank}"
        self.watchdog: Any = NullWatchdog()
        self.attempt = number_attempt(cfg, worker)  # first: whatever fails later is its own
        self.data = build_worker_data(cfg, worker, task, facts, harness, self._waiting)
        mark("data built", self.me)
        seed_initial_weights(cfg.optim.seed)
        self.model = task.model(cfg, facts)
        self.meta = task_meta(cfg.target.task, facts)
        mark("model built", self.me)
        self.restored = find_restore_point(cfg.checkpointing.resume_from, worker)
        # From here on a rank that stops making progress is found (--hang-timeout).
        # Sharded checkpoints (--strategy fsdp2) are written by every rank, synchronously.
        mode = "sync" if cfg.scaling.strategy == "fsdp2" else cfg.checkpointing.checkpoint_mode
        guards = safeguards(cfg, worker, self.attempt, harness, notices, mode)
        self.watchdog, self.writer = guards.watchdog, guards.checkpointer
        self.reclaims, self.limits = guards.reclaims, guards.limits
        self.logs: RunLogs | None = None
        self.tracking = Settings.from_dict(tracking) if worker.is_main and tracking else None
        self.tracker: RunTracking | None = None
        steps = step_range(cfg.logging.profile_steps)
        self.profiler = (
            StepProfiler(steps, cfg.checkpointing.run_dir, self.attempt.number, worker.rank,
                         worker.device, worker.log) if steps else None
        )  # fmt: skip
        self.ended: dict[str, Any] = {}

    @classmethod
    def start(cls, config: dict[str, Any]) -> WorkerRun:
        """The run of ``loop.loop_config``'s dict, in this worker process."""
        cfg = TrainConfig.from_dict(config["config"])
        worker = start_worker(
            cfg.scaling.cpus_per_worker, cfg.logging.log_prefix, cfg.logging.log_all_ranks
        )
        mark("loop entered (process group up)", f"rank {worker.rank}")
        return cls(cfg, config["task"], config["facts"], config["harness"], worker,
                   config.get("notices", True), config.get("tracking"))  # fmt: skip

    def _waiting(self, first: bool) -> None:
        """Before each step's batches come from a Ray Data stream."""
        self.watchdog.doing(hooked.WAITING_FOR_DATA, slow=first)

    # ---------------------------------------------------------------------- restore
    def restore(self) -> None:
        """Load the restore point's weights, wrap the model, build the optimizer and
        schedule and restore them; then say what the run is and count its FLOPs."""
        cfg, worker, restored = self.cfg, self.worker, self.restored
        fsdp = cfg.scaling.strategy == "fsdp2"
        if restored is not None:
            check_compatible(restored.state, self.meta, restored.source)
            check_strategy(restored.state, cfg.scaling.strategy, restored.source)
            if not fsdp:  # a sharded checkpoint's weights: read into the shards, later
                self.model.load_state_dict(restored.state["model"])
        channels_last = use_channels_last(cfg.data.channels_last, self.model, worker.device)
        flops: FlopRate | None = None  # counted in one branch or the other below
        # Under FSDP2, --amp bf16 is mostly its MixedPrecisionPolicy: then no autocast.
        self.autocast = "off" if fsdp and bf16_policy(self.model, cfg.optim.amp) else cfg.optim.amp
        if fsdp:  # counted on a copy of the whole model, which sharding takes apart
            example = example_batch(self.data, worker.device, self.watchdog)
            flops = count_flops(cfg, worker, self.task, self.model, example, self.watchdog)
        model = wrap_model(self.model, channels_last, cfg.target.compile,
                           (self.task, cfg.optim.amp, worker) if fsdp else None)  # fmt: skip
        self.state = state = build_train_state(cfg, worker, self.task, model, self.data)
        ledger, steps = self.harness.sample_ledger, self.data.steps_per_epoch
        self.partial = restore_training(restored, state, worker, cfg, steps, ledger)
        if restored is None or not restored.own:  # --resume-from's tracker run is not ours
            state.progress.tracking_run, state.progress.tracked_since = None, 0
        if worker.is_main:  # bad_samples.csv as the checkpoint left it
            state.progress.bad_sample_rows = rewind(cfg.checkpointing.run_dir, restored, worker.log)
        # Inside an epoch: only on the order its position counts in (a Ray Data stream's
        # epoch restarts).
        self.partial = continue_epoch(restored, state, worker, cfg, self.data, self.partial)
        counted = cfg.logging.comm_stats and is_distributed() and not fsdp  # DDP's comm hook
        self.counter = attach_counter(model) if counted else None
        self.core = StepCore(state, self.task, self.autocast, worker.device, cfg.optim.seed,
                             cfg.optim.grad_clip, channels_last, worker.rank)  # fmt: skip
        mark("model wrapped, state restored", self.me)
        self.ranks = rank_rows(worker)
        announce(cfg, worker, self.task, self.facts, self.data, self.ranks)
        self._attach_hooks()
        if self.tracker is not None:
            self.tracker.params(tracker_params(cfg, worker, self.task, self.data))
        mark("rank table, logs", self.me)
        if not fsdp:
            example = example_batch(self.data, worker.device, self.watchdog)
            flops = count_flops(cfg, worker, self.task, model, example, self.watchdog)
        self.core.stand_in = example
        assert flops is not None
        self.so_far = RunSoFar(flops=flops)
        mark("FLOPs counted", self.me)

    def _attach_hooks(self) -> None:
        """What watches every step (``hooks``), for the attempt; rank 0's run logs."""
        cfg, worker = self.cfg, self.worker
        self.timer = StepTimer(who=self.me)
        self.timing = hooked.Timing(self.timer)
        self.skips = hooked.Skips(SkipLog())
        chain: list[hooked.StepHook] = [
            hooked.WatchdogSteps(self.watchdog),
            hooked.Faults(self.harness, cfg.checkpointing.run_dir, worker.rank),
            self.timing,
            hooked.Guard(
                LossGuard(worker.device, worker.rank, check_every=cfg.logging.log_every_steps)
            ),
            self.skips,
            hooked.Ledger(),
        ]
        if worker.is_main:
            from ray_ddp.io.run_logs import RunLogs  # tensorboardX: rank 0's alone

            self.logs = logs = RunLogs(cfg.checkpointing.run_dir, cfg.logging.tensorboard)
            chain.append(hooked.StepLogs(logs, cfg.logging.log_every_steps))
            if cfg.logging.progress_interval_s > 0:
                chain.append(hooked.Progress(cfg.logging.progress_interval_s, cfg.optim.epochs))
            if self.tracking is not None:
                done = self.state.progress  # --resume-from's tracker run: cleared (restore)
                self.tracker = RunTracking(self.tracking, cfg.checkpointing.run_dir, worker,
                                           done.tracking_run, done.tracked_since)  # fmt: skip
                chain.append(self.tracker.hook(cfg.logging.log_every_steps))
        if self.profiler is not None:
            chain.append(hooked.Profiled(self.profiler))
        self.hooks = hooked.Hooks(*chain)

    # ---------------------------------------------------------------------- train
    def train(self) -> dict[str, Any]:
        """Every epoch left (to ``--epochs`` or ``--max-steps``); the summary for the
        driver (Ray hands rank 0's back)."""
        cfg, progress = self.cfg, self.state.progress
        if progress.epoch >= cfg.optim.epochs or self.limits.done(progress.step):
            self.worker.log(
                f"nothing to do: {progress.epoch} of {cfg.optim.epochs} epochs already done"
            )
        if self.profiler is not None:
            self.profiler.begin(progress.step)
        try:
            for epoch in range(progress.epoch, cfg.optim.epochs):
                if self.limits.done(progress.step):
                    break
                self.run_epoch(epoch)
                if epoch + 1 < cfg.optim.epochs and not self.limits.done(progress.step):
                    self.reclaims.after_checkpoint(progress.step)
        except Exception as exc:
            note_step(exc, progress.step + 1)  # a restart that fails alike is not retried
            raise
        finally:
            self.close()
        mark("training ended, logs closed", self.me)
        summary = self.so_far.summary(self.worker, progress, self.ranks, self.timer)
        asked = {"asked": self.reclaims.asked, "seconds": round(self.reclaims.asking_s, 4)}
        return {**summary, "checkpoints": self.writer.summary(), "preemption_checks": asked,
                **self.ended}  # fmt: skip

    def run_epoch(self, epoch: int) -> None:
        """Train the epoch, validate, then end it (checkpoint, report, log)."""
        self.timing.new_epoch()
        progress = self.state.progress  # inside the epoch: its count so far goes on
        so_far = progress.bad_samples if progress.sample else 0
        self.skips.log = SkipLog(
            self.cfg.data.max_bad_samples, self.worker.rank, epoch, total=so_far
        )
        before = (self.state.progress.step, self.counter.syncs if self.counter else 0)
        trained = self.train_epoch()
        self.skips.log.rows += self.data.train_order.take_unreadable()  # Ray Data's (rank 0)
        self.partial = fresh_sums(self.harness.sample_ledger)
        evaluated = self.validate()
        self.end_epoch(epoch, trained, evaluated, before)

    def train_epoch(self) -> EpochTrained:
        """Epoch ``progress.epoch`` from ``progress.sample`` on, in passes that stop for a
        checkpoint every ``--checkpoint-every`` optimizer steps."""
        cfg, state, data, worker = self.cfg, self.state, self.data, self.worker
        position = state.progress  # the run's position: the pass advances it
        sums, started, trained, skipped = self.partial, time.perf_counter(), 0, 0
        while True:
            # A new, reproducible order every epoch, from where a checkpoint left it.
            data.train_order.set_position(position.epoch, position.sample)
            if data.order_record is not None:  # its checkpoints name the order they count in
                state.progress.order = {
                    **data.order_record,
                    "version": data.train_order.plan.version,
                }
            with explain_oom(cfg, worker, "training"):
                segment = train_segment(self.core, data.train_order, data.train_loader, sums,
                                        self.hooks, self.limits)  # fmt: skip
            sums, trained, skipped = (
                segment.sums,
                trained + segment.samples,
                skipped + segment.skipped,
            )
            if not segment.checkpoint_due:
                break
            self.checkpoint_inside_epoch(sums)
            self.reclaims.after_checkpoint(state.progress.step)
        seconds = time.perf_counter() - started
        self.watchdog.doing("epoch end: all-reduce of the epoch's sums", collective=True)
        local: dict[str, float | torch.Tensor] = {
            "loss_sum": sums.loss_sum, "samples": sums.samples, "trained": trained,
            "count": sums.count,
        }  # fmt: skip
        totals = sum_over_ranks(local, worker.device)
        return EpochTrained(
            loss_sum=totals["loss_sum"], samples=int(totals["samples"]), count=totals["count"],
            all_trained=int(totals["trained"]), own_trained=trained, skipped=skipped,
            seconds=seconds, own=sums, ledger=sums.ledger,
        )  # fmt: skip

    def checkpoint_inside_epoch(self, sums: Any) -> None:
        """A ``--checkpoint-every`` checkpoint: the epoch's unreadable samples so far named
        first (before a crash can lose them), no validation."""
        self.watchdog.doing("checkpoint inside the epoch", slow=True)
        skips = settle(self.cfg.checkpointing.run_dir, self.skips.log, self.worker.is_main)
        progress = self.state.progress
        progress.bad_samples = skips.train  # the epoch's so far, carried in the checkpoint
        progress.bad_sample_rows = (progress.bad_sample_rows or 0) + skips.written
        score = (f"val_{self.task.best_metric}", self.task.best_mode)
        self._keep_tracker_run()
        write_mid_epoch_checkpoint(self.cfg.to_dict(), self.worker, self.state, self.meta, sums,
                                   score, self.writer)  # fmt: skip
        self.watchdog.progress(f"checkpoint at step {self.state.progress.step}")

    def validate(self) -> EvalResult:
        """Exact sharded evaluation of the weights and buffers the checkpoint will hold.

        DDP copies rank 0's buffers (BatchNorm running statistics) to the other ranks only
        at the start of a synchronised forward, so after the epoch's last step every rank
        holds its own. Rank 0's are what gets saved: every rank evaluates with those."""
        model = unwrap(self.state.model)
        self.watchdog.doing("evaluation: broadcast of rank 0's buffers", collective=True)
        broadcast_buffers(model)
        then = "evaluation: all-reduce of the sums"
        batches = watched(self.data.val_loader, "evaluation", self.watchdog, then=then)
        with explain_oom(self.cfg, self.worker, "evaluation"):
            return evaluate(model, batches, self.worker.device, self.task, self.autocast,
                            stand_in=self.core.stand_in)  # fmt: skip

    def end_epoch(
        self, epoch: int, trained: EpochTrained, evaluated: EvalResult, before: tuple[int, int]
    ) -> None:
        """Count the unreadable samples (may stop the run), then the position, the metrics,
        the checkpoint with every rank's report, and rank 0's lines. ``before``: the step
        and the all-reduce count at the epoch's start."""
        cfg, progress, data = self.cfg, self.state.progress, self.data
        skips = self.count_unreadable(epoch, evaluated)
        # A --max-steps stop inside the epoch is saved as that position, so a re-run with
        # more steps trains the rest of the epoch instead of skipping it.
        finished = progress.sample >= data.train_size
        if finished:
            progress.end_epoch()
        progress.bad_samples = 0 if finished else skips.train
        progress.bad_sample_rows = (progress.bad_sample_rows or 0) + skips.written
        if finished and self.harness.sample_ledger:
            write_ledger(cfg.checkpointing.run_dir, self.worker, epoch, trained.ledger)
        metrics = epoch_metrics(self.task, self.state, trained, evaluated, epoch + 1)
        metrics.update(world_size=self.worker.world_size, accum_steps=data.accumulation)
        metrics.update(self.so_far.flops.of(metrics["samples_per_s"]), bad_samples=skips.total)
        progress.best_score = better(self.task, progress.best_score, metrics)
        if self.counter is not None:
            steps = max(1, progress.step - before[0])
            metrics["allreduces_per_step"] = (self.counter.syncs - before[1]) / steps
        own = fresh_sums(self.harness.sample_ledger) if finished else trained.own
        timing = self.timing.epoch.summary(trained.seconds)
        speed = trained.own_trained / trained.seconds
        self.watchdog.doing("epoch end: checkpoint and report", slow=True)
        self._keep_tracker_run()
        per_rank = checkpoint_and_report(cfg.to_dict(), self.worker, self.state, self.meta,
                                         metrics, own, self.writer, speed, timing,
                                         self._track_epoch)  # fmt: skip
        log_epoch(cfg.optim, self.worker, self.logs, metrics, per_rank, progress, data.train_size,
                  self.ranks)  # fmt: skip
        self.watchdog.progress("epoch end")
        self.so_far.add(metrics, trained, per_rank)

    def count_unreadable(self, epoch: int, evaluated: EvalResult) -> EpochSkips:
        """The epoch's unreadable samples, all ranks (a collective): named in the run's
        ``bad_samples.csv`` and said by rank 0; over ``--max-bad-samples`` every rank raises
        BadSamplesError here, before the epoch is checkpointed."""
        self.watchdog.doing("epoch end: gathering the unreadable samples", collective=True)
        cfg, worker = self.cfg, self.worker
        skips = settle(cfg.checkpointing.run_dir, self.skips.log, worker.is_main, evaluated.skipped)
        if skips.total:
            val_size = self.data.val_size
            worker.log(skipped_line(epoch, skips.train, skips.val, evaluated.samples, val_size,
                                    cfg.checkpointing.run_dir))  # fmt: skip
        return skips

    def _track_epoch(self, metrics: dict[str, Any]) -> None:
        """The epoch's metrics to the tracker (``worker.run_tracking``)."""
        if self.tracker is not None:
            progress = self.state.progress
            last = progress.epoch >= self.cfg.optim.epochs or self.limits.done(progress.step)
            self.tracker.reported(progress.step, metrics, last)

    def _keep_tracker_run(self) -> None:
        """The tracker's run id into the next checkpoint, once the tracker has one."""
        if self.tracker is not None and self.tracker.run_id is not None:
            self.state.progress.tracking_run = self.tracker.run_id

    def close(self) -> None:
        """Rank 0's run logs flushed (TensorBoard; curves.png rendered from metrics.csv),
        the profiler stopped, what the tracker holds sent (for a while: the run ends)."""
        if self.logs is not None:
            self.logs.close()
            self.logs = None
        if self.profiler is not None:
            self.profiler.close()
            if self.profiler.result:
                self.ended["profile"] = self.profiler.result
        if self.tracker is not None:
            self.ended["tracking"] = self.tracker.close()
            self.tracker = None

    def stop_watching(self) -> None:
        self.watchdog.stop()


@contextlib.contextmanager
def explain_oom(cfg: TrainConfig, worker: Worker, phase: str) -> Iterator[None]:
    """Turn an out-of-memory error into what to change: the per-worker batch."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        size = (
            f"batches of 2 x --batch-size = {2 * cfg.optim.batch_size}"
            if phase == "evaluation"  # no activations kept for backward: twice the batch
            else f"--batch-size {cfg.optim.batch_size}"
        )
        raise RuntimeError(
            f"out of memory on rank {worker.rank} ({worker.device}) during {phase} with {size} "
            f"per worker: lower --batch-size and raise --accum-steps to keep the global batch "
            f"of {cfg.global_batch_size}"
        ) from exc
