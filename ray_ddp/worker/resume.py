"""Where a worker starts from: this run's latest checkpoint, ``--resume-from``, or nothing;
and putting a checkpoint's state back into the training objects (Ray-aware: it asks Ray
Train for the run's latest checkpoint)."""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import ray.train

from ray_ddp.checkpoint.format import (
    CheckpointError,
    ResumeRefusedError,
    is_sharded,
    load_state,
)
from ray_ddp.config.batch import accumulation, saved_global_batch
from ray_ddp.config.sections import Optimisation
from ray_ddp.data.order.continuation import order_change, saved_version
from ray_ddp.io.storage import filesystem, list_checkpoints
from ray_ddp.worker.data import WorkerData
from ray_ddp.worker.identity import Worker
from ray_ddp.worker.optim import apply_hyperparameters, hyperparameters, set_schedule_step
from ray_ddp.worker.sharding import load_shards
from ray_ddp.worker.state import EpochSums, TrainProgress, TrainState


@dataclass(frozen=True)
class Restored:
    state: dict[str, Any]
    """What ``checkpoint.load_state`` read (a sharded checkpoint's ``state.pt``)."""
    source: str
    """Where from, for messages."""
    own: bool = False
    """One of this run's own checkpoints (not ``--resume-from``'s)."""
    directory: str | None = None
    """A sharded checkpoint's files (``--strategy fsdp2``), in a local directory: its
    own where the storage is local, else a download of it (``temporary``)."""
    temporary: bool = False

    def release(self) -> None:
        """Remove the downloaded copy of a sharded checkpoint, once its shards are read."""
        if self.temporary and self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)


def find_restore_point(resume_from: str | None, worker: Worker) -> Restored | None:
    """This run's own latest checkpoint (a re-run of the same name, or Ray restarting
    workers after a failure) before ``--resume-from``; None for a fresh start.

    A latest checkpoint that cannot be read (truncated, corrupt) is skipped with a warning
    for the newest older one that can; training never silently starts over."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        if not resume_from:
            return None
        return open_checkpoint(resume_from)
    fs = checkpoint.filesystem  # local or s3/gs alike
    try:
        return _open(checkpoint, _shown(fs, checkpoint.path), own=True)
    except CheckpointError as exc:
        worker.log(f"warning: the latest checkpoint is unusable ({exc}); trying older ones")
    latest = checkpoint.path.rstrip("/")
    run_dir = latest.rsplit("/", 1)[0]
    older = [p for p in list_checkpoints(fs, run_dir) if p < latest]
    for path in reversed(older):
        try:
            restored = _open(ray.train.Checkpoint(path, filesystem=fs), _shown(fs, path), own=True)
        except CheckpointError as exc:
            worker.log(f"warning: {_shown(fs, path)} is unusable too ({exc})")
            continue
        worker.log(f"warning: resuming from the older checkpoint {_shown(fs, path)}")
        return restored
    raise CheckpointError(
        f"no usable checkpoint in {_shown(fs, run_dir)}; move the run aside or use a new --name"
    )


# pyarrow filesystems whose paths are "bucket/key", and their URI schemes.
_SCHEMES = {"s3": "s3", "gcs": "gs"}


def _shown(fs, path: str) -> str:
    """``path`` on filesystem ``fs`` as a URI for messages (``s3://bucket/...``)."""
    scheme = _SCHEMES.get(getattr(fs, "type_name", "local"))
    return f"{scheme}://{path}" if scheme else path


def open_checkpoint(uri: str) -> Restored:
    """The checkpoint at ``uri`` (a local path or a storage URI: ``--resume-from``'s, or
    the one ``jobs/evaluate.py`` evaluates), a remote one read from this process's own
    download (:func:`_download`)."""
    fs, path = filesystem(uri)
    return _open(ray.train.Checkpoint(path, filesystem=fs), uri)


def _open(checkpoint: ray.train.Checkpoint, source: str, own: bool = False) -> Restored:
    """``checkpoint``'s state, from ``source`` (a path or URI, for messages). A sharded
    one's files are kept at hand for ``sharding.load_shards``: where they are on local
    storage, else the one download of them that its state was read from."""
    import pyarrow.fs

    if isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
        state = load_state(checkpoint.path)
        return Restored(
            state, source, own, directory=checkpoint.path if is_sharded(state) else None
        )
    directory = _download(checkpoint)  # storage errors propagate: not a broken checkpoint
    kept = False
    try:
        state = load_state(directory)
        kept = is_sharded(state)
        return Restored(state, source, own, directory=directory if kept else None, temporary=kept)
    except CheckpointError as exc:  # name the URI, not the temporary folder
        raise CheckpointError(str(exc).replace(directory, source)) from exc
    finally:
        if not kept:
            shutil.rmtree(directory, ignore_errors=True)


def _download(checkpoint: ray.train.Checkpoint) -> str:
    """A remote checkpoint's files in a new local folder of this process's own. Not Ray's
    shared one (``as_directory``, ``to_directory()``): the ranks of a node share it, keyed
    by the checkpoint they were all handed, and a rank that comes for it while a faster
    rank, done reading, is deleting it fails with "Checkpoint directory ... does not
    exist, even though it should have been created by another process" (seen resuming
    from S3 on 2 cores, Ray 2.60)."""
    return checkpoint.to_directory(tempfile.mkdtemp(prefix="ray_ddp_checkpoint_"))


def restore_training(
    restored: Restored | None,
    state: TrainState,
    worker: Worker,
    optim: Optimisation,
    global_batch: int,
    steps_per_epoch: int,
    ledger: bool = False,
) -> EpochSums:
    """Load optimizer, schedule, scaler and progress from ``restored`` (the weights are
    loaded before DDP wraps the model). Returns this rank's sums of the epoch's part
    before a mid-epoch checkpoint (zero at an epoch boundary): all ranks' totals on rank
    0, so the resumed epoch's loss is exact at any world size.

    What the flags say (``optim``) wins over what the checkpoint saved: the peak lr,
    weight decay and momentum, the optimizer kind and the precision; the resume line
    names each change. ``global_batch``: this run's, against the checkpoint's (another
    world size keeps it; another one moves the schedule). ``ledger``: a test's sample
    ledger is kept (``ray_ddp.testing``)."""
    if restored is None:
        return EpochSums(ledger=[] if ledger else None)
    saved = restored.state
    notes = _restore_optimizer(restored, state, optim)
    notes += _restore_scaler(saved, state)
    progress = state.progress = TrainProgress.from_saved(saved["progress"])
    if saved["progress"].get("batch"):  # an older format's position, in another order
        # The epoch restarts, and so do its steps: the schedule goes back to its start.
        progress.step = progress.epoch * steps_per_epoch
        set_schedule_step(state.scheduler, progress.step)
        worker.log(
            f"the checkpoint's mid-epoch position is of an older version: epoch "
            f"{progress.epoch + 1} restarts from its first sample"
        )
    sums = _partial_sums(saved, worker, ledger) if progress.sample else EpochSums()
    if ledger and sums.ledger is None:
        sums.ledger = []
    notes += _world_size_change(saved, worker, optim.batch_size, global_batch)
    saved_batch = run_global_batch(saved)
    if saved_batch != global_batch:
        # Another global batch (--allow-config-change): another number of steps per
        # epoch, so the schedule continues at the epochs done, in this run's steps.
        step = progress.epoch * steps_per_epoch
        set_schedule_step(state.scheduler, step)
        notes.append(
            f"global batch {saved_batch} -> {global_batch}: the LR schedule "
            f"continues at step {step}"
        )
    where = f", {progress.sample} samples into epoch {progress.epoch + 1}"
    worker.log(
        f"resumed from {restored.source}: {progress.epoch} epochs, {progress.step} steps done"
        + (where if progress.sample else "")
        + "".join(f"; {note}" for note in notes)
    )
    return sums


def saved_world_size(saved: dict[str, Any]) -> int:
    """The world size a checkpoint was written at (older ones saved a RNG state per rank)."""
    return int(saved.get("world_size") or len(saved.get("rng", [])) or 1)


def run_global_batch(saved: dict[str, Any]) -> int:
    """The global batch a checkpoint was trained with (older ones saved no worker count
    in their config: the world size they were written at)."""
    return saved_global_batch(saved.get("config", {}), saved_world_size(saved)) or 0


def _partial_sums(saved: dict[str, Any], worker: Worker, ledger: bool) -> EpochSums:
    """The epoch's sums before a mid-epoch checkpoint: every saved rank's, added up, on
    rank 0 (what is reported is the total over ranks)."""
    if not worker.is_main:
        return EpochSums()
    parts = saved.get("epoch_partial", [])
    rows = [tuple(row) for row in saved.get("ledger", [])] if ledger else None
    # [loss sum, samples, count]; before the count, it was the samples
    count = sum(float(p[2] if len(p) > 2 else p[1]) for p in parts)
    return EpochSums(sum(p[0] for p in parts), sum(int(p[1]) for p in parts), rows, count)


def _world_size_change(
    saved: dict[str, Any], worker: Worker, batch_size: int, global_batch: int
) -> list[str]:
    """The line's words for a resume at another world size (nothing at the same), of a
    run of ``global_batch`` samples per step in micro-batches of ``batch_size``."""
    before, now = saved_world_size(saved), worker.world_size
    if before == now:
        return []
    config = saved.get("config", {})
    accum_before = run_global_batch(saved) // max(1, config.get("batch_size", 1) * before)
    accum_now = accumulation(global_batch, batch_size, now)
    change = "lost" if now < before else "gained"
    workers = "worker" if abs(before - now) == 1 else "workers"
    kept = run_global_batch(saved) == global_batch
    return [
        f"{change} {abs(before - now)} {workers} since the checkpoint: continuing on {now} "
        f"{'worker' if now == 1 else 'workers'}, "
        f"accumulation {accum_before} -> {accum_now}"
        + (f", global batch {global_batch} kept, same data order" if kept else "")
    ]


def _restore_optimizer(restored: Restored, state: TrainState, optim: Optimisation) -> list[str]:
    """The optimizer's state and the schedule's (and a sharded checkpoint's weights);
    ``optim``: what the flags say now (the optimizer kind, its hyperparameters)."""
    notes, saved = [], restored.state
    fresh = hyperparameters(state.optimizer)
    saved_kind = saved.get("config", {}).get("optimizer", optim.optimizer)
    if restored.directory is not None:  # sharded: every rank reads its slices of both
        load_shards(restored.directory, state.model, state.optimizer, saved_kind == optim.optimizer)
        restored.release()
    elif saved_kind == optim.optimizer:
        state.optimizer.load_state_dict(saved["optimizer"])
    if saved_kind != optim.optimizer:  # AdamW's moments mean nothing to SGD (and back)
        notes.append(f"optimizer {saved_kind} -> {optim.optimizer}: its state starts fresh")
    state.scheduler.load_state_dict(saved["scheduler"])
    changes = apply_hyperparameters(optim, state.optimizer, state.scheduler, fresh)
    return notes + [f"{change} (from the flags)" for change in changes]


def _restore_scaler(saved: dict[str, Any], state: TrainState) -> list[str]:
    if saved["scaler"] or not state.scaler.is_enabled():
        state.scaler.load_state_dict(saved["scaler"])  # a disabled scaler ignores it
        return []
    # Saved by a run without fp16 (a disabled scaler saves nothing): an enabled one
    # refuses the empty state, so it starts at its initial loss scale.
    return ["fp16 starts from the initial loss scale (the checkpoint was not fp16)"]


def continue_epoch(
    restored: Restored | None,
    state: TrainState,
    worker: Worker,
    restart: bool,
    data: WorkerData,
    sums: EpochSums,
) -> EpochSums:
    """After a restore inside an epoch: continue it only on the order its position was
    counted in (``data.order.continuation``); where the data or the order's flags changed,
    refuse in one line, or start the epoch over where ``restart`` (``--restart-epoch``).
    A position of an older order version finishes its epoch in that order. Returns the
    sums to continue with."""
    progress, record, steps_per_epoch = state.progress, data.order_record, data.steps_per_epoch
    saved, progress.order = progress.order, record
    if record is None:  # a Ray Data stream
        why = "a Ray Data stream cannot resume inside an epoch"
        return restart_epoch(state, worker, steps_per_epoch, sums, why)
    if restored is None or not progress.sample:
        return sums
    change = None if saved is None else order_change(saved, record)  # None: an older one
    if change is not None and restart:
        return restart_epoch(state, worker, steps_per_epoch, sums, f"--restart-epoch: {change}")
    if change is not None:
        raise ResumeRefusedError(
            f"{restored.source} stopped {progress.sample} samples into epoch "
            f"{progress.epoch + 1}, a position in an order that no longer names the same "
            f"samples: {change}. Put the data and flags back to finish the epoch, or re-run "
            f"with --restart-epoch to start epoch {progress.epoch + 1} over"
        )
    version = saved_version(saved)
    if version != record["version"]:
        data.train_order.finish_in(progress.epoch, version)
        worker.log(
            f"epoch {progress.epoch + 1} is finished in the order its checkpoint counted in "
            f"(order version {version}); the epochs after it take version {record['version']}"
        )
    return sums


def restart_epoch(
    state: TrainState, worker: Worker, steps_per_epoch: int, sums: EpochSums, why: str
) -> EpochSums:
    """A position inside an epoch becomes the epoch's start, and its steps and sums are
    undone (``why``: for the line). Returns the sums to continue with."""
    progress = state.progress
    if not progress.sample:
        return sums
    progress.sample = 0
    progress.step = progress.epoch * steps_per_epoch
    progress.tracked_since = int(time.time() * 1000)  # its steps are logged again
    set_schedule_step(state.scheduler, progress.step)
    worker.log(
        f"epoch {progress.epoch + 1} restarts from its first sample ({why}); the LR schedule "
        f"goes back to step {progress.step}"
    )
    return EpochSums(ledger=None if sums.ledger is None else [])
