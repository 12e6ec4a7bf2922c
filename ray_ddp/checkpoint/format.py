"""What a checkpoint holds, and how it is written and read (no Ray here).

A checkpoint is a directory with one file, ``state.pt``: the unwrapped model's
``state_dict`` (no ``module.`` prefixes, loads into a plain model), the optimizer,
GradScaler and LR-scheduler states, training progress (the data position in samples of
the epoch's order, which any world size resumes from), the world size it was saved at,
every rank's sums of a partial epoch, the config that produced it, and the task that
builds the model with the facts it was built from (``task_meta``). It is always read
with ``torch.load(weights_only=True)``: only tensors and plain Python values, never
arbitrary pickled code.

A run with ``--strategy fsdp2`` writes a sharded checkpoint: ``state.pt`` holds all of
the above but the model and optimizer states (``"sharded": "dcp"`` says so), which every
rank wrote its part of, with ``torch.distributed.checkpoint``, into ``shards/``.
:func:`load_model` reads them into a plain model in one process all the same.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from ray_ddp.io.storage import atomic_path, is_uri, local_copy

if TYPE_CHECKING:
    from ray_ddp.config import TrainConfig
    from ray_ddp.task.interface import Task
    from ray_ddp.worker.state import EpochSums, TrainState

STATE_FILE = "state.pt"
SHARDS = "shards"
"""A sharded checkpoint's folder of DCP files (``--strategy fsdp2``)."""
SHARDED = "dcp"
"""``state["sharded"]`` of a sharded checkpoint: how its model and optimizer are saved."""
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with the reason."""


class ResumeRefusedError(CheckpointError):
    """A checkpoint that cannot be continued as it is on today's data or flags (a position
    inside an epoch whose order changed): a restart would meet it again, so the run stops
    (not retried), with the line that says what to do."""


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside its wrappers (DDP's, DataParallel-like ones, torch.compile's), so
    its ``state_dict`` has no ``module.`` or ``_orig_mod.`` prefixes."""
    while True:
        inner = model.__dict__.get("_modules", {}).get("_orig_mod")  # torch.compile's
        if inner is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            inner = model.module
        if inner is None and type(model).__name__ == "DataParallel":
            inner = model.module
        if inner is None:
            return model
        model = inner


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``--strategy fsdp2``)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def is_sharded(state: dict[str, Any]) -> bool:
    """Whether a checkpoint's ``state.pt`` (what :func:`load_state` read) is of a sharded
    checkpoint, whose model and optimizer states are in its ``shards/``."""
    return state.get("sharded") == SHARDED


# ------------------------------------------------------------------ save / load
def state_of(
    state: TrainState,
    *,
    config: dict[str, Any],
    task_meta: dict[str, Any],
    world_size: int,
    epoch_partial: list[EpochSums] | None = None,
) -> dict[str, Any]:
    """What ``state.pt`` holds (the live tensors: :func:`snapshot` copies them).

    ``epoch_partial`` is every rank's sums of the epoch so far, for a mid-epoch
    checkpoint, so the resumed epoch reports the same training loss (at any world size:
    only their totals matter)."""
    partial = epoch_partial or []
    # A sharded model's and optimizer's states go to shards/, every rank its part.
    whole: dict[str, Any] = {"sharded": SHARDED}
    if not is_fsdp(state.model):
        whole = {
            "model": unwrap(state.model).state_dict(),
            "optimizer": state.optimizer.state_dict(),
        }
    saved = {
        "format_version": FORMAT_VERSION,
        **whole,
        "scheduler": state.scheduler.state_dict(),
        "scaler": state.scaler.state_dict(),
        "progress": asdict(state.progress),
        "config": config,
        "task_meta": task_meta,
        "world_size": world_size,
        "epoch_partial": [[s.loss_sum, s.samples, s.count] for s in partial],
    }
    ledgers = [s.ledger for s in partial if s.ledger is not None]
    if ledgers:  # a test's sample ledger (ray_ddp.testing)
        saved["ledger"] = [list(row) for ledger in ledgers for row in ledger]
    return saved


class Snapshots:
    """Copies of what a checkpoint holds (:func:`state_of`) that training can no longer
    change, in host memory it keeps and reuses: one state's size, however many checkpoints
    a run takes (the caller takes the next only once the previous is written). Tensors on
    a GPU land in pinned memory through non-blocking copies and one synchronisation."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers)

    def take(self, saved: Any) -> Any:
        import copy

        count = 0

        def host(value: Any) -> Any:
            nonlocal count
            if isinstance(value, torch.Tensor):
                out = self._buffer(count, value)
                out.copy_(value.detach(), non_blocking=value.device.type == "cuda")
                count += 1
                return out
            if isinstance(value, dict):
                return {k: host(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(host(v) for v in value)
            return copy.deepcopy(value)

        copied = host(saved)
        del self.buffers[count:]
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()  # the non-blocking copies have landed
        return copied

    def _buffer(self, number: int, like: torch.Tensor) -> torch.Tensor:
        if number < len(self.buffers):
            kept = self.buffers[number]
            if kept.shape == like.shape and kept.dtype == like.dtype:
                return kept
        pinned = like.device.type == "cuda"
        fresh = torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)
        if number < len(self.buffers):
            self.buffers[number] = fresh
        else:
            self.buffers.append(fresh)
        return fresh


def write_state(directory: str, saved: dict[str, Any]) -> str:
    """Write ``directory/state.pt`` completely or not at all (temp file, then rename)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, STATE_FILE)
    with atomic_path(path) as tmp:
        torch.save(saved, tmp)
    return path


def save_state(directory: str, state: TrainState, **fields: Any) -> str:
    """:func:`write_state` of :func:`state_of` (``fields``: its keywords)."""
    return write_state(directory, state_of(state, **fields))


def load_state(directory: str) -> dict[str, Any]:
    """Read a checkpoint directory written by :func:`save_state`, onto the CPU."""
    path = os.path.join(directory, STATE_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{directory} is not a ray_ddp checkpoint (no {STATE_FILE})")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, corrupt, or not a torch file at all
        first_sentence = str(exc).split(". ")[0]  # torch appends a paragraph of advice
        raise CheckpointError(f"cannot read {path}: {first_sentence}") from exc
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is not a ray_ddp checkpoint of format {FORMAT_VERSION}")
    if is_sharded(state):
        check_shards(directory)
    return state


def check_shards(directory: str) -> None:
    """A sharded checkpoint's ``shards/`` holds DCP's index and every file it names (one
    per rank that wrote it); else the checkpoint is unusable (a resume then falls back to
    an older one)."""
    from torch.distributed.checkpoint import FileSystemReader

    path = os.path.join(directory, SHARDS)
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # no index, or a truncated one
        raise CheckpointError(f"{path} has no readable index of its shards ({exc})") from exc
    named = {info.relative_path for info in (metadata.storage_data or {}).values()}
    missing = sorted(name for name in named if not os.path.isfile(os.path.join(path, name)))
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: a rank's shard is lost")


def load_checkpoint_state(path: str) -> dict[str, Any]:
    """:func:`load_state` of a checkpoint directory at a local path or a storage URI
    (``s3://bucket/runs/<name>/checkpoint_...``: downloaded to a temporary directory)."""
    if not is_uri(path):
        return load_state(path)
    try:
        with local_copy(path) as directory:
            try:
                return load_state(directory)
            except CheckpointError as exc:  # name the URI, not the temporary directory
                raise CheckpointError(str(exc).replace(directory, path)) from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc


def registered_states(checkpoint: str) -> dict[str, Any]:
    """The named states an own loop registered (``Run.register``), from its checkpoint at
    a local path or a storage URI: name -> state dict, tensors on the CPU
    (``ray_ddp.load_state``)."""
    with _local(checkpoint) as directory:
        state = load_state(directory)
        if "states" not in state:
            raise CheckpointError(
                f"{checkpoint} was written by the built-in loop: read it with ray_ddp.load_model"
            )
        states: dict[str, Any] = state["states"]
        return states if not is_sharded(state) else {**states, **_gathered(directory)}


@contextlib.contextmanager
def _local(checkpoint: str) -> Iterator[str]:
    """A checkpoint directory at a local path, or a storage URI's downloaded."""
    if not is_uri(checkpoint):
        yield checkpoint
        return
    try:
        with local_copy(checkpoint) as directory:
            yield directory
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {checkpoint}: {exc}") from exc


def _gathered(directory: str) -> dict[str, Any]:
    """Every state of a sharded checkpoint's ``shards/``, whole, in this process alone
    (no process group): DCP's shards of every rank put together (``dcp_to_torch_save``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        whole = os.path.join(scratch, "whole.pt")
        dcp_to_torch_save(os.path.join(directory, SHARDS), whole)
        gathered: dict[str, Any] = torch.load(whole, map_location="cpu", weights_only=False)
        return gathered


def task_meta(task_spec: str, facts: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint records about its model: the task that builds it and the facts it
    was built from (what a resume is checked against, and how evaluation rebuilds it)."""
    return {"task": task_spec, "facts": facts}


def saved_task_meta(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's task meta; those written before tasks existed hold the image
    classifier's facts under ``model_meta``."""
    if "task_meta" in state:
        meta: dict[str, Any] = state["task_meta"]
        return meta
    from ray_ddp.config import BUILTIN_TASK

    return task_meta(BUILTIN_TASK, dict(state.get("model_meta", {})))


def check_compatible(state: dict[str, Any], meta: dict[str, Any], source: str) -> None:
    """Refuse a checkpoint of another task, or whose model was built from other facts."""
    saved = saved_task_meta(state)
    if saved["task"] != meta["task"]:
        raise CheckpointError(
            f"{source} was saved by task {saved['task']}, this run's is {meta['task']}; "
            "use a matching --task or a fresh --name"
        )
    facts = meta["facts"]
    for key, value in saved["facts"].items():
        if key in facts and list_or(value) != list_or(facts[key]):
            raise CheckpointError(
                f"{source} was saved with {key}={value}, this run has {key}={facts[key]}; "
                "use matching flags and data, or a fresh --name"
            )


def check_strategy(state: dict[str, Any], strategy: str, source: str) -> None:
    """Refuse a checkpoint saved by the other ``--strategy``: a sharded one holds no
    whole-model state for DDP, and DDP's optimizer state is not FSDP2's."""
    saved = "fsdp2" if is_sharded(state) else "ddp"
    if saved != strategy:
        raise CheckpointError(
            f"{source} was saved with --strategy {saved}, this run has --strategy {strategy}; "
            f"continue it with --strategy {saved}, or export its model and start a fresh --name"
        )


def list_or(value: Any) -> Any:
    return list(value) if isinstance(value, (tuple, list)) else value


def load_model(directory: str, task: Task | None = None) -> torch.nn.Module:
    """A plain (unwrapped, non-distributed) model with the checkpoint's weights, in eval
    mode, for evaluation or inference without Ray. ``directory`` is a local path or a
    storage URI (``s3://...``: downloaded to a temporary directory first). ``task``: the
    Task that trained it (default: the one the checkpoint names, imported)."""
    from ray_ddp.io.storage import is_uri, local_copy
    from ray_ddp.task.loading import load_task

    if is_uri(directory):
        with local_copy(directory) as local:
            return load_model(local, task)

    state = load_state(directory)
    meta = saved_task_meta(state)
    task = task if task is not None else load_task(meta["task"])
    model: torch.nn.Module = task.model(saved_config(state), meta["facts"])
    model.load_state_dict(full_model_state(directory, state, model))
    return model.eval()


def full_model_state(
    directory: str, state: dict[str, Any], model: torch.nn.Module
) -> dict[str, torch.Tensor]:
    """The whole model's state dict of the checkpoint in local ``directory``
    (``state``: its ``state.pt``); for a sharded one, every rank's shards gathered from
    ``shards/`` in this process alone (no process group), into tensors shaped like
    ``model``'s."""
    if not is_sharded(state):
        whole: dict[str, torch.Tensor] = state["model"]
        return whole
    import torch.distributed.checkpoint as dcp

    wanted = {"model": model.state_dict()}
    path = os.path.join(directory, SHARDS)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(wanted, checkpoint_id=path, no_dist=True)
    except Exception as exc:  # a shard missing or unreadable
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot read the sharded model in {path}: {first_line}") from exc
    gathered: dict[str, torch.Tensor] = wanted["model"]
    return gathered


def saved_config(state: dict[str, Any]) -> TrainConfig:
    """The TrainConfig a checkpoint was trained with (fields unknown to this version are
    dropped: a checkpoint of an older or newer ray_ddp still loads)."""
    from ray_ddp.config import TrainConfig

    known = {f.name for f in TrainConfig.fields()}
    return TrainConfig.from_dict({k: v for k, v in state["config"].items() if k in known})
