"""Testing aids: faults a test asks a run for through typed ``TrainConfig`` fields (no
flags), so that the recovery code meets the real thing in a real run. Each does nothing
unless its field is set.

- ``inject_nan_step`` / ``inject_nan_rank``: one rank's loss turns NaN at one step, the
  way a diverging model's does;
- ``stall_step`` / ``stall_rank`` / ``stall_s``: one rank stops at one step, once per run
  (a node about to be lost, a hang), and says so in a file the test waits for; with
  ``stall_frozen`` it holds Python's lock while it does (its own watchdog cannot run);
- ``slow_step_s`` / ``slow_rank``: every optimizer step of a rank (or of all) takes this
  much longer, so a test has time to act while training goes on, or a straggler is seen;
- ``slow_start_s`` / ``slow_checkpoint_s``: an attempt's first step, and every checkpoint,
  take longer (what the hang watchdog must not mistake for a hang);
- ``hang_loader_sample``: the DataLoader worker loading one sample sleeps ``stall_s``, once
  per run (a loader that hangs).
"""

from __future__ import annotations

import ctypes
import operator
import os
import time

import torch

from ray_ddp.config import TrainConfig


def poison_loss(cfg: TrainConfig, loss: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    """``loss``, or NaN on rank ``inject_nan_rank`` at optimizer step ``inject_nan_step``."""
    if cfg.inject_nan_step != step or cfg.inject_nan_rank != rank:
        return loss
    return loss * float("nan")


def stall_marker(cfg: TrainConfig, rank: int) -> str:
    """The file a stalled rank writes (``<run>/stalled-rank-<rank>``: its step and pid)."""
    return os.path.join(cfg.run_dir, f"stalled-rank-{rank}")


def stall(cfg: TrainConfig, rank: int, step: int) -> None:
    """At optimizer step ``stall_step``, rank ``stall_rank`` writes its marker and sleeps
    ``stall_s`` seconds (or dies, with ``stall_exit``); not again once the marker exists
    (a restarted run goes on)."""
    if cfg.stall_step != step or cfg.stall_rank != rank:
        return
    marker = stall_marker(cfg, rank)
    if os.path.exists(marker):
        return
    with open(marker, "w") as file:
        file.write(f"{step} {os.getpid()}\n")
    if cfg.stall_exit:
        os._exit(1)
    if cfg.stall_frozen:
        # libc's sleep called without releasing Python's lock, as a native call that never
        # returns would: no other thread of the process (its watchdog) runs meanwhile.
        ctypes.PyDLL(None).sleep(int(cfg.stall_s))
    else:
        time.sleep(cfg.stall_s)


def slow_down(cfg: TrainConfig, rank: int) -> None:
    """In each optimizer step, before its last micro-batch's forward (the rank's own work,
    as a slow GPU's would be): sleep ``slow_step_s`` on rank ``slow_rank`` (None: all)."""
    if cfg.slow_step_s and cfg.slow_rank in (None, rank):
        time.sleep(cfg.slow_step_s)


def slow_start(cfg: TrainConfig) -> None:
    """In an attempt's first optimizer step: sleep ``slow_start_s``."""
    if cfg.slow_start_s:
        time.sleep(cfg.slow_start_s)


def slow_checkpoint(cfg: TrainConfig) -> None:
    """While rank 0 writes a checkpoint: sleep ``slow_checkpoint_s``."""
    if cfg.slow_checkpoint_s:
        time.sleep(cfg.slow_checkpoint_s)


def loader_marker(cfg: TrainConfig) -> str:
    """The file a hanging DataLoader worker writes (``<run>/stalled-loader``: its pid)."""
    return os.path.join(cfg.run_dir, "stalled-loader")


class HangOnSample(torch.utils.data.Dataset):
    """``dataset``, except that loading sample ``index`` writes ``marker`` and sleeps
    ``seconds``, unless ``marker`` exists (once per run)."""

    def __init__(self, dataset, index: int, marker: str, seconds: float) -> None:
        self.dataset, self.index, self.marker, self.seconds = dataset, index, marker, seconds

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        if operator.index(index) == self.index and not os.path.exists(self.marker):
            with open(self.marker, "w") as file:
                file.write(f"{os.getpid()}\n")
            time.sleep(self.seconds)
        return self.dataset[index]


def hang_loader(cfg: TrainConfig, dataset):
    """The training set, with :class:`HangOnSample` where ``hang_loader_sample`` asks."""
    if cfg.hang_loader_sample is None:
        return dataset
    return HangOnSample(dataset, cfg.hang_loader_sample, loader_marker(cfg), cfg.stall_s)
