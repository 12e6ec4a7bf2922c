"""The parts under an own loop's verbs (``worker.own_loop.Run``) that are its alone so far:
the steps of an epoch that advance the run's position (:class:`StepSource`), the exact
evaluation of any dataset (:class:`Evaluation`), and the named states a checkpoint holds
(:func:`saved_states`, :func:`load_into`). :class:`StepSource` and :func:`saved_states`
read the run (its position, config, hooks; the steps call back its ``report``), the others
take what they use; none advances the position but :class:`StepSource`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import default_collate

from ray_ddp.checkpoint.format import (
    FORMAT_VERSION,
    SHARDED,
    SHARDS,
    CheckpointError,
    ResumeRefusedError,
    is_fsdp,
    is_sharded,
    unwrap,
)
from ray_ddp.config.sections import Optimisation
from ray_ddp.data.loaders import eval_loader
from ray_ddp.data.order.continuation import order_change, order_record, split_fingerprint
from ray_ddp.data.seeding import seed_micro_batch
from ray_ddp.data.unreadable import SkipUnreadable, SkipUnreadableCollate
from ray_ddp.reliability.hangs.watchdog import NullWatchdog, Watchdog, watched
from ray_ddp.task import Sum
from ray_ddp.task.batches import first_tensor
from ray_ddp.worker.collectives import broadcast_buffers, is_distributed
from ray_ddp.worker.evaluate import evaluate
from ray_ddp.worker.hooks import Pass, observed_loss
from ray_ddp.worker.identity import Worker
from ray_ddp.worker.micro import Micro, OrderedData, Step, epoch_steps, ordered_data, step_end

if TYPE_CHECKING:
    from ray_ddp.worker.own_loop import Run
    from ray_ddp.worker.resume import Restored


class StepSource:
    """The steps of the run's datasets in the global order, from the run's position: the
    one place the position advances (after each step, and at the epoch's end), where a due
    checkpoint is taken (``--checkpoint-every``, a reclaim notice)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.data: dict[int, OrderedData] = {}
        self.samples_seen = 0
        self.train_seconds = 0.0
        self.first = True
        self.now = Pass(None, 0)  # type: ignore[arg-type]
        """The pass in progress, as the hooks see it."""
        self.synced = self.updated = False
        """Whether this step's all-reduce and update were told to the hooks."""
        self.loss = torch.zeros(())
        """The latest loss given to ``backward`` (what the step reports)."""
        self.lr = 0.0
        """The first optimizer's lr after the latest step."""

    def _data(self, dataset: Any, collate, random_samples: bool) -> OrderedData:
        run = self.run
        key = id(dataset)
        if key not in self.data:
            cfg = run.config
            data = ordered_data(cfg.optim, cfg.data, cfg.scaling, cfg.global_batch_size,
                                dataset, run.rank, run.world_size, collate,
                                random_samples)  # fmt: skip
            self._check_order(data, dataset)
            self.data[key] = data
        return self.data[key]

    def _check_order(self, data: OrderedData, dataset: Any) -> None:
        """A position inside an epoch continues only on the order it was counted in."""
        run = self.run
        self.record = order_record(data.order.plan, split_fingerprint(dataset))
        restored, position = run.restored, run.position
        saved = restored.state["progress"].get("order") if restored is not None else None
        change = order_change(saved, self.record) if saved and position.sample else None
        if change is not None:
            raise ResumeRefusedError(
                f"{restored.source} stopped {position.sample} samples into epoch "  # type: ignore[union-attr]
                f"{position.epoch + 1}, a position in an order that no longer names the same "
                f"samples: {change}. Put the data and flags back to finish the epoch"
            )

    def steps(self, dataset: Any, collate, random_samples: bool) -> Iterator[Step]:
        run, position = self.run, self.run.position
        if run._done():
            return
        data = self._data(dataset, collate, random_samples)
        data.order.set_position(position.epoch, position.sample)
        self.now = now = Pass(data.order.plan, len(data.order.slots))
        steps = epoch_steps(data, position.step + 1)
        run.hooks.pass_started(now)
        while True:
            now.step = position.step + 1
            run.hooks.fetching(now)
            waited = time.perf_counter()
            step = next(steps, None)
            run.hooks.fetched(now, time.perf_counter() - waited)
            if step is None:
                run.hooks.pass_ended(now)
                return
            step.prepare = self._prepare
            self.synced = self.updated = False
            run.hooks.computing(step.micro[-1].slot, now)
            started = time.perf_counter()
            yield step
            self.train_seconds += time.perf_counter() - started
            if self._after(step, data, now):
                run.hooks.pass_ended(now)
                return

    def _prepare(self, micro: Micro) -> None:
        """Before a micro-batch is handed out: gradient sync on where it closes the step,
        and the step's randomness seeded from (step, micro-batch number)."""
        run = self.run
        run.sync_models(micro.closes_step)
        seed_micro_batch(run.config.optim.seed, micro.step, micro.slot.micro, run.device)

    def backward(self, loss: torch.Tensor | Sum, micro: Micro) -> None:
        """``Run.backward``: the hooks see the loss (the guard, a test's fault), the step's
        first backward of its last micro-batch is the all-reduce's (``syncing``)."""
        run = self.run
        seen, total, count = observed_loss(loss, micro.slot, micro.step, run.hooks)
        if micro.closes_step and not self.synced:
            run.hooks.syncing(micro.slot, distributed=is_distributed())
            self.synced = True
        run.stepper.backward(seen if count is None else Sum(total, count), micro.weight)
        self.loss = seen.detach()

    def updating(self) -> None:
        """Before the step's first optimizer step (a test's stall lands here)."""
        if not self.updated:
            self.run.hooks.updating(self.now)
            self.updated = True

    def _after(self, step: Step, data: OrderedData, now: Pass) -> bool:
        """The step is done: the position advanced, hooks, a due checkpoint. Whether the
        epoch's steps end here."""
        run, position = self.run, self.run.position
        self.samples_seen += step.samples
        now.seen, now.trained = now.seen + step.samples, now.trained + step.samples
        now.index += len(step)
        position.advance(step_end(data, step.micro[-1].slot))
        run.hooks.stepped(now, self.loss, self.lr)
        run.hooks.trained(step.micro[-1].slot, now)
        self.first = False
        if position.sample >= data.size:
            position.end_epoch()
            return True
        due = run.limits.checkpoint_due(position.step)  # asked at every boundary, every rank
        if run._done():
            return True
        if due:
            run.report({})
            run.reclaims.after_checkpoint(position.step)
        return False


class _Measured:
    """A metrics function as ``worker.evaluate`` reads a task's."""

    def __init__(self, metrics: Callable[[torch.nn.Module, Any], dict[str, Sum]]) -> None:
        self.metrics = self.evaluation_metrics = metrics

    def batch_size(self, batch: Any) -> int:
        tensor = first_tensor(batch)
        return 0 if tensor is None else int(tensor.shape[0])

    def predictions(self, model, batch) -> None:
        return None


class Evaluation:
    """Exact evaluation of any dataset: every sample on one rank, sums all-reduced, in
    batches of twice ``--batch-size`` at ``--amp`` (``optim``)."""

    def __init__(
        self, optim: Optimisation, worker: Worker, watchdog: Watchdog | NullWatchdog
    ) -> None:
        self.optim, self.worker, self.watchdog = optim, worker, watchdog
        self.loaders: dict[int, Any] = {}

    def measure(self, model, dataset, metrics, collate) -> dict[str, float]:
        worker, watchdog = self.worker, self.watchdog
        key = id(dataset)
        if key not in self.loaders:
            options = {"collate_fn": SkipUnreadableCollate(collate or default_collate)}
            batch = self.optim.batch_size * 2
            self.loaders[key] = eval_loader(SkipUnreadable(dataset), batch, worker.rank,
                                            worker.world_size, **options)  # fmt: skip
        inner = unwrap(model)
        watchdog.doing("evaluation: broadcast of rank 0's buffers", collective=True)
        broadcast_buffers(inner)  # every rank evaluates the weights a checkpoint holds
        batches = watched(self.loaders[key], "evaluation", watchdog,
                          then="evaluation: all-reduce of the sums")  # fmt: skip
        result = evaluate(inner, batches, worker.device, _Measured(metrics), self.optim.amp)  # type: ignore[arg-type]
        return {**result.means, "samples": float(result.samples)}


def _state_of(obj: Any) -> Any:
    return unwrap(obj).state_dict() if isinstance(obj, torch.nn.Module) else obj.state_dict()


def saved_states(run: Run) -> dict[str, Any]:
    """What rank 0's checkpoint holds (``state.pt``): every registered state by name, the
    GradScaler's, the position and the order it counts in, the config and world size.
    Under FSDP2 the registered states are every rank's shards instead (:func:`write_shards`;
    ``"sharded": "dcp"`` says so)."""
    record = getattr(run.source, "record", None)
    sharded = run.config.scaling.strategy == "fsdp2"
    return {
        "format_version": FORMAT_VERSION,
        "loop": "own",
        "states": {} if sharded else {name: _state_of(obj) for name, obj in run.states.items()},
        **({"sharded": SHARDED, "sharded_states": list(run.states)} if sharded else {}),
        "scaler": run.scaler.state_dict(),
        "progress": {
            **run.position.to_dict(),
            "order": record,
            "tracking_run": run.tracker.run_id if run.tracker else None,
        },  # fmt: skip
        "config": run.config.to_dict(),
        "task_meta": run.meta,
        "world_size": run.world_size,
    }


def load_into(models: list[torch.nn.Module], obj: Any, name: str, restored: Restored) -> None:
    """Registered state ``name`` loaded from the restore point into ``obj`` (from its
    shards, every rank its part, where the checkpoint is sharded: a collective; ``models``:
    the run's set-up models, among which an optimizer's is found)."""
    saved = restored.state
    held = saved["states"].keys() | set(saved.get("sharded_states", ()))
    if name not in held:
        listed = ", ".join(sorted(held)) or "nothing"
        raise CheckpointError(f"{restored.source} holds no state {name!r} (it holds {listed})")
    if is_sharded(saved):
        import torch.distributed.checkpoint as dcp

        wanted = {name: _sharded_state(models, obj)}
        dcp.load(wanted, checkpoint_id=os.path.join(restored.directory, SHARDS))  # type: ignore[arg-type]
        _load_sharded(models, obj, wanted[name])
        return
    target = unwrap(obj) if isinstance(obj, torch.nn.Module) else obj
    target.load_state_dict(saved["states"][name])


def write_shards(models: list[torch.nn.Module], states: dict[str, Any], directory: str) -> None:
    """``--strategy fsdp2``: every registered state's part on this rank (``states``; the
    run's set-up ``models``) into
    ``directory/shards`` (DCP, a collective: whatever the world size that reads them
    back): a sharded model's and its optimizer's shards, and every other state (an EMA
    whose tensors are shards too, a schedule) whole."""
    import torch.distributed.checkpoint as dcp

    for model in models:  # BatchNorm statistics: rank 0's, as DDP saves them
        broadcast_buffers(unwrap(model))
    shards = {name: _sharded_state(models, obj) for name, obj in states.items()}
    dcp.save(shards, checkpoint_id=os.path.join(directory, SHARDS))


def _optimized_model(
    models: list[torch.nn.Module], optimizer: torch.optim.Optimizer
) -> torch.nn.Module | None:
    """The set-up FSDP2 model whose parameters ``optimizer`` updates (None: none)."""
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    for model in models:
        inner = unwrap(model)
        if is_fsdp(inner) and any(p is first for p in inner.parameters()):
            return inner
    return None


def _sharded_state(models: list[torch.nn.Module], obj: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if isinstance(obj, torch.nn.Module) and is_fsdp(unwrap(obj)):
        return get_model_state_dict(unwrap(obj))
    if isinstance(obj, torch.optim.Optimizer):
        model = _optimized_model(models, obj)
        if model is not None:
            return get_optimizer_state_dict(model, obj)
    return _state_of(obj)


def _load_sharded(models: list[torch.nn.Module], obj: Any, state: Any) -> None:
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if isinstance(obj, torch.nn.Module) and is_fsdp(unwrap(obj)):
        set_model_state_dict(unwrap(obj), state)
        return
    if isinstance(obj, torch.optim.Optimizer):
        model = _optimized_model(models, obj)
        if model is not None:
            set_optimizer_state_dict(model, obj, state)
            return
    target = unwrap(obj) if isinstance(obj, torch.nn.Module) else obj
    target.load_state_dict(state)
