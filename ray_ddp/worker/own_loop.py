"""A training loop of the user's own, run by ray_ddp in every worker: the :class:`Run`
handle its function is given, and the function Ray Train runs (``own_loop_per_worker``).

The verbs (``docs/own-loop.md``): ``setup`` (DDP), ``register`` (named states, restored on
resume), ``epochs`` and ``steps``/``batches`` (the global order from the run's position),
``backward`` (weighted, accumulation without ``no_sync`` blocks, ``Sum`` losses),
``step`` (unscale, clip, scaler, schedules), ``draws`` (seeded by the sample),
``evaluate`` (exact), ``report`` (metrics and the checkpoint) and ``stop``. The parts under
them are the ones the built-in loop uses: the position (``worker.position``), the
checkpointer (``worker.checkpointer``), the restore point (``worker.resume``), the
step-level hooks (``worker.hooks``), the exact evaluation (``worker.evaluate``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch

from ray_ddp.checkpoint.format import (
    CheckpointError,
    check_compatible,
    check_strategy,
    is_fsdp,
    task_meta,
)
from ray_ddp.config import TrainConfig
from ray_ddp.data.seeding import draw_seed, seed_initial_weights
from ray_ddp.task import Sum
from ray_ddp.testing import harness as rig
from ray_ddp.testing.harness import Harness
from ray_ddp.tracking.params import Settings, versions
from ray_ddp.worker import hooks as hooked
from ray_ddp.worker.collectives import is_distributed
from ray_ddp.worker.identity import Worker, rank_rows, start_worker
from ray_ddp.worker.micro import Micro, Step
from ray_ddp.worker.optim import Stepper
from ray_ddp.worker.own_parts import (
    Evaluation,
    StepSource,
    load_into,
    saved_states,
    write_shards,
)
from ray_ddp.worker.position import Position
from ray_ddp.worker.precision import autocast, grad_scaler
from ray_ddp.worker.report import unscored
from ray_ddp.worker.resume import find_restore_point
from ray_ddp.worker.run_tracking import RunTracking
from ray_ddp.worker.sharding import bf16_policy, default_blocks, shard_model
from ray_ddp.worker.start import number_attempt, safeguards
from ray_ddp.worker.timing import StepTimer
from ray_ddp.worker.watch import Outputs, step_hooks, step_profiler


class Run:
    """What an own loop's function is given, in every worker (see the module's docstring
    and ``docs/own-loop.md``). ``config`` is the run's ``TrainConfig`` (jobs/train.py's
    flags): the loop reads its own settings from it (``lr``, ``batch_size``, ``epochs``)."""

    def __init__(
        self, cfg: TrainConfig, worker: Worker, loop: Any, harness: Harness = rig.NONE,
        notices: bool = True, tracking: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.config, self.worker, self.loop = cfg, worker, loop
        self.device, self.amp = worker.device, cfg.optim.amp
        self.attempt = number_attempt(cfg.checkpointing.run_dir, worker)
        self.restored = find_restore_point(cfg.checkpointing.resume_from, worker)
        self.meta = task_meta(cfg.target.task, {})
        self.position = self._restore_position()
        guards = safeguards(
            cfg, worker, self.attempt, harness, notices, cfg.checkpointing.checkpoint_mode
        )
        self.watchdog, self.checkpointer = guards.watchdog, guards.checkpointer
        self.reclaims, self.limits = guards.reclaims, guards.limits
        self.timer = StepTimer(who=f"rank {worker.rank}")
        self.tracker = self._tracker(tracking)
        self.profiler = step_profiler(cfg.logging, cfg.checkpointing.run_dir, self.attempt.number,
                                      worker)  # fmt: skip
        self.hooks = self._hooks(harness)
        self.scaler = grad_scaler(cfg.optim.amp, worker.device)
        if self.restored is not None:
            self.scaler.load_state_dict(self.restored.state.get("scaler", {}))
        self.stepper = Stepper(self.scaler, worker.world_size, worker.device)
        self.states: dict[str, Any] = {}
        self.models: list[torch.nn.Module] = []
        self.source = StepSource(self)
        self.evaluation = Evaluation(cfg.optim, worker, self.watchdog)
        self.history: list[dict[str, Any]] = []
        self.ranks = rank_rows(worker)
        self.stopped = False
        self.reported_at: tuple[int, int] | None = None
        seed_initial_weights(cfg.optim.seed)  # the loop's models: the same weights on every rank

    def _hooks(self, harness: Harness) -> hooked.Hooks:
        """What watches every step, as in the built-in loop (``worker.watch``)."""
        if self.profiler is not None:
            self.profiler.begin(self.position.step)
        cfg = self.config
        return step_hooks(cfg.logging, cfg.checkpointing.run_dir, cfg.optim.epochs, self.worker,
                          self.watchdog, harness, hooked.Timing(self.timer),
                          tracker=self.tracker, profiler=self.profiler)  # fmt: skip

    def _tracker(self, tracking: dict[str, Any] | None) -> RunTracking | None:
        """Rank 0's experiment tracker (``--tracking``), on the run's tracker run, with
        the run's flags and world as params."""
        if tracking is None or not self.worker.is_main:
            return None
        restored = self.restored
        own = restored is not None and restored.own  # --resume-from's run is another's
        kept = restored.state["progress"].get("tracking_run") if own else None  # type: ignore[union-attr]
        settings = Settings.from_dict(tracking)
        assert settings is not None  # tracking is on
        tracker = RunTracking(settings, self.config.checkpointing.run_dir, self.worker,
                              kept)  # fmt: skip
        tracker.params({**self.config.to_dict(), "world_size": self.world_size,
                        "global_batch_size": self.config.global_batch_size,
                        "device": self.device.type, **versions()})  # fmt: skip
        return tracker

    # ------------------------------------------------------------------ who and where
    @property
    def rank(self) -> int:
        return self.worker.rank

    @property
    def world_size(self) -> int:
        return self.worker.world_size

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs and writes checkpoints."""
        return self.worker.is_main

    def log(self, message: str) -> None:
        """A line from rank 0 (every rank with ``--log-all-ranks``)."""
        self.worker.log(message)

    def _restore_position(self) -> Position:
        """The restore point's position (a fresh run's: the start)."""
        restored = self.restored
        if restored is None:
            return Position()
        if "states" not in restored.state:
            raise CheckpointError(
                f"{restored.source} was written by the built-in loop, not an own loop's run; "
                "use a fresh --name"
            )
        check_compatible(restored.state, self.meta, restored.source)
        check_strategy(restored.state, self.config.scaling.strategy, restored.source)
        position = Position.from_dict(restored.state["progress"])
        before = int(restored.state.get("world_size", 1))
        change = (f"; {before} -> {self.world_size} workers, the same global order"
                  if before != self.world_size else "")  # fmt: skip
        self.worker.log(
            f"resumed from {restored.source}: epoch {position.epoch + 1}, step "
            f"{position.step}, sample {position.sample}{change}"
        )
        return position

    # ------------------------------------------------------------------ the verbs
    def setup(self, *models: torch.nn.Module) -> Any:
        """Each model on this worker's device, wrapped in DDP with more than one worker
        (``ray.train.torch.prepare_model``), or with ``--strategy fsdp2`` sharded by FSDP2
        (its blocks, then itself: ``worker.sharding``; with ``--amp bf16`` its mixed
        precision, where no autocast is needed), compiled with ``--compile``; returned in
        order (one model: itself). Build optimizers after, over the returned models."""
        import ray.train.torch

        cfg, wrapped = self.config, []
        for model in models:
            if cfg.scaling.strategy == "fsdp2":
                if bf16_policy(model, cfg.optim.amp):
                    self.amp = "off"  # FSDP2 computes in bf16 itself
                prepared = shard_model(model, default_blocks(model), cfg.optim.amp, self.device,
                                       self.world_size)  # fmt: skip
            else:
                prepared = ray.train.torch.prepare_model(model)
            if cfg.target.compile:  # a Module (OptimizedModule): typed as a callable
                prepared = cast(torch.nn.Module, torch.compile(prepared))
            wrapped.append(prepared)
        self.models += wrapped
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def register(self, **states: Any) -> None:
        """Name what a checkpoint holds (models, optimizers, schedules, an EMA, anything
        with ``state_dict``/``load_state_dict``); where the run resumes, each is loaded
        from the checkpoint here, so register after building them and before training."""
        for name, obj in states.items():
            if name in self.states:
                raise ValueError(f"run.register: {name!r} is registered already")
            self.states[name] = obj
            if self.restored is not None:
                load_into(self.models, obj, name, self.restored)

    def epochs(self) -> Iterator[int]:
        """The epochs left (0-based), to ``--epochs`` or ``--max-steps`` or ``stop()``.
        An epoch that the loop ends without ``report`` is reported (and checkpointed)
        here, so every epoch's end and every stop is a checkpoint."""
        while self.position.epoch < self.config.optim.epochs and not self._done():
            epoch = self.position.epoch
            yield epoch
            if self.reported_at != (self.position.epoch, self.position.step):
                self.report({})
            if self.position.epoch == epoch and not self._done():
                raise RuntimeError(
                    f"epoch {epoch + 1} ended before its last step: iterate "
                    "run.steps(dataset) (or run.batches) to the end in every epoch"
                )

    def steps(
        self, dataset: Any, collate: Callable[[list[Any]], Any] | None = None,
        random_samples: bool = False,
    ) -> Iterator[Step]:  # fmt: skip
        """The optimizer steps of ``dataset``'s epoch in the global order, from the run's
        position: each a :class:`~ray_ddp.worker.micro.Step` of this rank's micro-batches.
        The position advances after each (a due checkpoint is taken there); the iteration
        ends at the epoch's end, at ``--max-steps`` or after ``stop()``. ``random_samples``:
        the dataset draws torch random numbers per sample (seeded from the sample)."""
        return self.source.steps(dataset, collate, random_samples)

    def batches(
        self, dataset: Any, collate: Callable[[list[Any]], Any] | None = None,
        random_samples: bool = False,
    ) -> Iterator[Micro]:  # fmt: skip
        """:meth:`steps`, one micro-batch at a time: call :meth:`step` where a micro-batch
        ``closes_step``."""
        for step in self.steps(dataset, collate, random_samples):
            yield from step

    def autocast(self) -> Any:
        """The forward's autocast (``--amp``; a no-op with ``off``, and under FSDP2's
        bf16 mixed precision)."""
        return autocast(self.amp, self.device)

    def backward(self, loss: torch.Tensor | Sum, micro: Micro) -> None:
        """The backward of ``micro``'s loss: a mean over its samples (weighted by its share
        of the step's samples), or a ``Sum(total, count)`` (the step's gradient is then
        the sum over every rank's totals divided by every rank's counts: tokens, say)."""
        self.source.backward(loss, micro)

    def step(
        self, *optimizers: torch.optim.Optimizer, schedules: Iterable[Any] = (),
        clip: float | None = None,
    ) -> bool:  # fmt: skip
        """Unscale, clip (``--grad-clip`` unless ``clip``), step each optimizer through the
        GradScaler, step ``schedules`` where the step was applied (an fp16 overflow skips
        it), zero the gradients. Returns whether it was applied."""
        clip = self.config.optim.grad_clip if clip is None else clip
        self.source.updating()
        applied = self.stepper.step(optimizers, tuple(schedules), clip)
        self.source.lr = optimizers[0].param_groups[0]["lr"] if optimizers else 0.0
        return applied

    def draws(self, micro: Micro, *shape: int, stream: int = 0) -> torch.Tensor:
        """Standard normal numbers, ``(len(micro.indices), *shape)`` on the device, each
        row seeded by its sample's place in the global order (seed, epoch, index) and
        ``stream``: the same whatever the split, the world size or a resume."""
        rows = [
            torch.randn(shape, generator=torch.Generator().manual_seed(
                draw_seed(self.config.optim.seed, micro.epoch, index, stream)))
            for index in micro.indices
        ]  # fmt: skip
        return torch.stack(rows).to(self.device)

    def evaluate(
        self, model: torch.nn.Module, dataset: Any,
        metrics: Callable[[torch.nn.Module, Any], dict[str, Sum]],
        collate: Callable[[list[Any]], Any] | None = None,
    ) -> dict[str, float]:  # fmt: skip
        """``metrics(model, batch)``'s sums over every sample of ``dataset`` exactly once,
        over every rank (rank 0's buffers): ``{name: total / count, "samples": n}``."""
        return self.evaluation.measure(model, dataset, metrics, collate)

    def report(self, metrics: dict[str, Any] | None = None, checkpoint: bool = True) -> None:
        """Every rank reports ``metrics`` (a barrier: call it on every rank alike) with the
        run's position; rank 0 attaches the checkpoint of every registered state."""
        position = self.position
        values = {k: float(v) for k, v in (metrics or {}).items()}
        values.update(epoch=position.epoch, step=position.step, sample=position.sample)
        if position.sample:
            values["mid_epoch"] = True
        score = f"val_{self.loop.best_metric}"
        if score not in values:
            values.update(unscored(score, self.loop.best_mode))
        self.watchdog.doing("report and checkpoint", slow=True)
        saved = saved_states(self) if checkpoint and self.is_main else None
        sharded = self.config.scaling.strategy == "fsdp2"  # every rank writes its shards
        if checkpoint:
            shards = functools.partial(write_shards, self.models, self.states) if sharded else None
            self.checkpointer.save(values, saved, shards)
        else:
            import ray.train

            ray.train.report(values)
        if self.tracker is not None:
            last = position.epoch >= self.config.optim.epochs or self._done()
            self.tracker.reported(position.step, values, last)
        self.watchdog.progress("report")
        self.reported_at = (position.epoch, position.step)
        if self.is_main:
            self.history.append(values)
            shown = ", ".join(f"{k} {v:.4g}" for k, v in (metrics or {}).items())
            self.log(f"step {position.step} (epoch {position.epoch}, sample "
                     f"{position.sample}){': ' + shown if shown else ''}")  # fmt: skip

    def stop(self) -> None:
        """End the run after the current step (its epoch is reported and checkpointed)."""
        self.stopped = True

    # ------------------------------------------------------------------ run-wide
    def _done(self) -> bool:
        return self.stopped or self.limits.done(self.position.step)

    def sync_models(self, closes_step: bool) -> None:
        """Every set-up model's gradient all-reduce (FSDP2's reduce-scatter) on, on the
        step's last micro-batch, or off."""
        for model in self.models:
            inner = getattr(model, "_orig_mod", model)
            if is_fsdp(inner):
                inner.set_requires_gradient_sync(closes_step)  # type: ignore[operator]
            elif hasattr(inner, "require_backward_grad_sync"):
                inner.require_backward_grad_sync = closes_step

    def summary(self) -> dict[str, Any]:
        """What the worker returns (Ray hands rank 0's to the driver)."""
        timing = self.timer.summary()
        seen = self.source.samples_seen
        return {
            "history": self.history, "epochs_completed": self.position.epoch,
            "steps": self.position.step, "world_size": self.world_size,
            "device": self.device.type, "ranks": self.ranks, "timing": timing,
            "train_seconds": self.source.train_seconds, "samples_seen": seen,
            "checkpoints": self.checkpointer.summary(), "distributed": is_distributed(),
        }  # fmt: skip


def own_loop_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Build this worker's :class:`Run`, call the loop's function with it, return its
    summary (``worker.loop.loop_config``'s dict: the loop travels as its ``task``)."""
    cfg = TrainConfig.from_dict(config["config"])
    worker = start_worker(
        cfg.scaling.cpus_per_worker, cfg.logging.log_prefix, cfg.logging.log_all_ranks
    )
    run = Run(cfg, worker, config["task"], config["harness"], config.get("notices", True),
              config.get("tracking"))  # fmt: skip
    try:
        config["task"].function(run)
        summary = run.summary()
    finally:
        run.watchdog.stop()
        ended = Outputs(tracker=run.tracker, profiler=run.profiler).close()
    return {**summary, **ended}
