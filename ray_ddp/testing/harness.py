"""The test harness of a run: faults a test injects into a real run, so that the recovery
code meets the real thing, and records it keeps to check the run by. Each does nothing
unless it is set; a run without a harness has :data:`NONE`.

- ``nan_step`` / ``nan_rank``: one rank's loss turns NaN at one optimizer step, the way a
  diverging model's does;
- ``stalls``: a rank stops at an optimizer step, once per run, and says so in a file the
  test waits for (:func:`stall_marker`): it sleeps (a hang, a node about to be lost, until
  the test removes it), dies (``exit``: ``os._exit(1)``, as a killed process) or sleeps
  holding Python's lock (``frozen``: its own watchdog cannot run), until a reclaim
  notice has reached the rank (``until_notice``) or until the test makes a file
  (``until_file``). Several stalls make several events, each at its own step;
- ``slow_step_s`` / ``slow_rank``: every optimizer step of a rank (or of all) takes this
  much longer (a straggler);
- ``slow_start_s`` / ``slow_checkpoint_s``: an attempt's first step, and every checkpoint,
  take longer (what the hang watchdog must not mistake for a hang);
- ``hang_loader_sample``: the DataLoader worker loading one training sample sleeps, once
  per run (a loader that hangs);
- ``hold_upload_step``: the asynchronous upload of the checkpoint at that optimizer step
  is held, once per run, writing :func:`upload_marker` (an upload in flight, for as long
  as the test needs: it kills a worker, or the run's storage is read meanwhile);
- ``step_log``: rank 0 appends every optimizer step it applies, in every attempt, to
  ``<run>/steps-applied`` (:func:`step_log_path`): the steps a restart did again;
- ``sample_ledger``: rank 0 writes every epoch's trained samples, step by step and from
  every rank, to ``<run>/ledger/epoch-<N>.csv`` (the epoch's part before a mid-epoch
  checkpoint travels in the checkpoint): what the exactness tests compare.

A test passes a :class:`Harness` to ``ray_ddp.fit(..., harness=...)``; a test that runs
``jobs/train.py`` as a process sets ``RAY_DDP_HARNESS`` to its JSON (:func:`from_env`).
It travels to the workers beside the config, never inside it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import operator
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ray_ddp.io.storage import exists, join, write_bytes

ENV = "RAY_DDP_HARNESS"


@dataclass(frozen=True)
class Stall:
    """Rank ``rank`` stops before optimizer step ``step`` is applied, once per run."""

    step: int
    rank: int = 0
    seconds: float = 3600.0
    """How long it sleeps (a test usually ends the stall sooner: it kills the process)."""
    exit: bool = False
    """Die there instead (``os._exit(1)``: no exception, no clean-up)."""
    frozen: bool = False
    """Sleep in a native call that holds Python's lock: no thread of the process runs."""
    until_notice: bool = False
    """Go on once Ray's reclaim notice has reached this rank (``seconds`` at most)."""
    until_file: str | None = None
    """Go on once this local file exists (``seconds`` at most): the test says when."""


@dataclass(frozen=True)
class Harness:
    nan_step: int | None = None
    nan_rank: int = 0
    stalls: tuple[Stall, ...] = ()
    slow_step_s: float = 0.0
    slow_rank: int | None = None
    """The rank ``slow_step_s`` slows (None: all)."""
    slow_start_s: float = 0.0
    slow_checkpoint_s: float = 0.0
    hang_loader_sample: int | None = None
    hang_loader_s: float = 3600.0
    sample_ledger: bool = False
    hold_upload_step: int | None = None
    hold_upload_s: float = 600.0
    step_log: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Harness:
        stalls = tuple(Stall(**s) for s in data.get("stalls", ()))
        return cls(**{**data, "stalls": stalls})

    def to_env(self) -> dict[str, str]:
        """The environment that gives a ``jobs/train.py`` process this harness."""
        return {ENV: json.dumps(self.to_dict())}


NONE = Harness()


def from_env() -> Harness:
    """The harness ``RAY_DDP_HARNESS`` describes (a test running a job as a process)."""
    text = os.environ.get(ENV)
    return Harness.from_dict(json.loads(text)) if text else NONE


# ------------------------------------------------------------------ the run's side
def poison_loss(harness: Harness, loss: Any, step: int, rank: int) -> Any:
    """``loss``, or NaN on rank ``nan_rank`` at optimizer step ``nan_step``."""
    if harness.nan_step != step or harness.nan_rank != rank:
        return loss
    return loss * float("nan")


def stall_marker(run_dir: str, step: int, rank: int) -> str:
    """The file a stalled rank writes (``<run>/stalled-step-<step>-rank-<rank>``: its step
    and pid; a local path or a URI, as the run's); the stall happens once per run, while it
    does not exist."""
    return join(run_dir, f"stalled-step-{step}-rank-{rank}")


def stall(
    harness: Harness, run_dir: str, rank: int, step: int, noticed: Callable[[], bool]
) -> None:
    """At optimizer step ``step``, a stall of ``rank`` writes its marker and sleeps (or
    dies, or freezes, or waits until ``noticed()``: a reclaim notice reached the rank); not
    again once the marker exists (a restarted run goes on)."""
    for planned in harness.stalls:
        if planned.step != step or planned.rank != rank:
            continue
        marker = stall_marker(run_dir, step, rank)
        if exists(marker):
            continue
        write_bytes(marker, f"{step} {os.getpid()}\n".encode())
        if planned.exit:
            os._exit(1)
        if planned.frozen:
            # libc's sleep called without releasing Python's lock, as a native call that
            # never returns would: no other thread of the process (its watchdog) runs.
            ctypes.PyDLL(None).sleep(int(planned.seconds))
        elif planned.until_notice or planned.until_file:
            until = time.monotonic() + planned.seconds
            released = (
                noticed
                if planned.until_notice or planned.until_file is None
                else partial(os.path.exists, planned.until_file)
            )
            while not released() and time.monotonic() < until:
                time.sleep(0.1)
        else:
            time.sleep(planned.seconds)


def step_log_path(run_dir: str) -> str:
    """Where ``step_log`` appends (a local run folder)."""
    return os.path.join(run_dir, "steps-applied")


def log_step(harness: Harness, run_dir: str, rank: int, step: int) -> None:
    """Rank 0, where ``step_log`` asks: ``step`` is being applied (one line: step, pid)."""
    if harness.step_log and rank == 0:
        with open(step_log_path(run_dir), "a") as file:
            file.write(f"{step} {os.getpid()}\n")


def slow_down(harness: Harness, rank: int) -> None:
    """In each optimizer step, before its last micro-batch's forward (the rank's own work,
    as a slow GPU's would be): sleep ``slow_step_s`` on rank ``slow_rank`` (None: all)."""
    if harness.slow_step_s and harness.slow_rank in (None, rank):
        time.sleep(harness.slow_step_s)


def slow_start(harness: Harness) -> None:
    """In an attempt's first optimizer step: sleep ``slow_start_s``."""
    if harness.slow_start_s:
        time.sleep(harness.slow_start_s)


def slow_checkpoint(harness: Harness) -> None:
    """While rank 0 writes a checkpoint: sleep ``slow_checkpoint_s``."""
    if harness.slow_checkpoint_s:
        time.sleep(harness.slow_checkpoint_s)


def upload_marker(run_dir: str, step: int) -> str:
    """The file a held upload writes (``<run>/upload-held-step-<step>``: its step and pid)."""
    return join(run_dir, f"upload-held-step-{step}")


def hold_upload(harness: Harness, run_dir: str, step: int) -> None:
    """In the upload thread of the checkpoint at optimizer step ``step``, before anything
    is written: hold it ``hold_upload_s`` where ``hold_upload_step`` asks, once per run."""
    if harness.hold_upload_step != step:
        return
    marker = upload_marker(run_dir, step)
    if exists(marker):
        return
    write_bytes(marker, f"{step} {os.getpid()}\n".encode())
    time.sleep(harness.hold_upload_s)


def checkpoint_hook(harness: Harness, run_dir: str) -> Callable[[int], None]:
    """What a test attaches to a run's checkpointer (its ``before_write``, called with the
    checkpoint's step where it is about to be written): a held upload, a slow write."""

    def before_write(step: int) -> None:
        hold_upload(harness, run_dir, step)
        slow_checkpoint(harness)

    return before_write


def loader_marker(run_dir: str) -> str:
    """The file a hanging DataLoader worker writes (``<run>/stalled-loader``: its pid)."""
    return os.path.join(run_dir, "stalled-loader")


class HangOnSample(torch.utils.data.Dataset):
    """``dataset``, except that loading sample ``index`` writes ``marker`` and sleeps
    ``seconds``, unless ``marker`` exists (once per run)."""

    def __init__(self, dataset: Any, index: int, marker: str, seconds: float) -> None:
        self.dataset, self.index, self.marker, self.seconds = dataset, index, marker, seconds

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        if operator.index(index) == self.index and not os.path.exists(self.marker):
            with open(self.marker, "w") as file:
                file.write(f"{os.getpid()}\n")
            time.sleep(self.seconds)
        return self.dataset[index]


def hang_loader(harness: Harness, run_dir: str, dataset: Any) -> Any:
    """The training set, with :class:`HangOnSample` where ``hang_loader_sample`` asks."""
    if harness.hang_loader_sample is None:
        return dataset
    marker = loader_marker(run_dir)
    return HangOnSample(dataset, harness.hang_loader_sample, marker, harness.hang_loader_s)
