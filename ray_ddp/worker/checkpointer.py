"""The one checkpointer of a run, whichever loop runs it (the built-in ``Task`` loop or a
user's own, ``worker.own_loop``): it takes what rank 0 saves (a dict of named states and
the run's position, ``checkpoint.format``) and reports it to Ray Train with the metrics.

Three ways to write, one interface (:meth:`Checkpointer.save`):

- **sync** (``--checkpoint-mode sync``): written to a temporary directory and uploaded
  before ``report`` returns; every rank waits for the upload;
- **async**: a snapshot of the state in host memory (``checkpoint.format.Snapshots``,
  reused), written and uploaded in Ray's upload thread while training goes on, registered
  once complete in storage (a crash before that leaves the previous checkpoint the
  latest). At most one in flight: the next waits for the previous upload and says so. A
  snapshot's memory is its own until its upload finally succeeds or finally fails
  (``compat.checkpoint_upload`` retries it);
- **sharded** (a model under FSDP2): every rank writes its shard into the one checkpoint
  (``shards``), synchronously, and rank 0 the rest.

Every rank calls :meth:`save` (``ray.train.report`` is a barrier); only rank 0 passes
what it saves. A test attaches to the write through ``before_write`` (a hook called in the
thread that writes, with the checkpoint's step), never through an argument of ``save``.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import ray.train

from ray_ddp.checkpoint.format import Snapshots, write_state
from ray_ddp.compat.checkpoint_upload import async_upload_supported, report_async, report_sync


def _no_hook(step: int) -> None:
    """The default ``before_write``: nothing."""


class Checkpointer:
    """Rank 0's checkpoints (and every rank's shard of a sharded one): the mode, the
    async snapshot's host memory and its one upload in flight, and what each checkpoint
    blocked training for."""

    def __init__(
        self, mode: str, log: Callable[[str], None],
        before_write: Callable[[int], None] = _no_hook,
    ) -> None:  # fmt: skip
        self.log = log
        self.before_write = before_write
        """Called where the checkpoint of step N is about to be written (rank 0, in the
        thread that writes it: Ray's upload thread when asynchronous)."""
        self.asynchronous = mode == "async" and async_upload_supported()
        if mode == "async" and not self.asynchronous:
            log("--checkpoint-mode async needs Ray's asynchronous upload (Ray 2.60): "
                "checkpoints are synchronous")  # fmt: skip
        self.snapshots = Snapshots()
        self.idle = threading.Event()
        self.idle.set()
        self.blocked_s: list[float] = []
        """Seconds each checkpoint held rank 0's training thread (the gather, the snapshot
        or the write and upload, any wait, the report's barrier); in either mode."""

    def summary(self) -> dict[str, Any]:
        """For the run's summary: the mode, what each checkpoint blocked for, and the
        snapshot's host memory (0 when synchronous)."""
        return {
            "mode": "async" if self.asynchronous else "sync",
            "blocked_s": [round(s, 4) for s in self.blocked_s],
            "snapshot_bytes": self.snapshots.nbytes,
        }

    def save(
        self,
        metrics: dict[str, Any],
        saved: dict[str, Any] | None,
        shards: Callable[[str], None] | None = None,
        started: float | None = None,
    ) -> None:
        """Report ``metrics`` with the checkpoint of ``saved`` (rank 0's live state, with
        ``progress["step"]``; None on the other ranks). ``shards(directory)``: this rank's
        shard of a sharded model, written into the checkpoint by every rank (then
        synchronously, whatever the mode). ``started``: when the caller began the
        checkpoint (its gather counts in ``blocked_s``)."""
        started = time.perf_counter() if started is None else started
        if saved is None and shards is None:
            ray.train.report(metrics)
            return
        if self.asynchronous and shards is None:
            assert saved is not None  # no shards: the whole state
            self._save_async(metrics, saved)
        else:
            self._save_sync(metrics, saved, shards)
        self.blocked_s.append(time.perf_counter() - started)

    def _save_sync(
        self, metrics: dict[str, Any], saved: dict[str, Any] | None,
        shards: Callable[[str], None] | None,
    ) -> None:  # fmt: skip
        directory = tempfile.mkdtemp(prefix="ray_ddp_ckpt_")
        try:
            if shards is not None:
                shards(directory)
            if saved is not None:
                self.before_write(saved["progress"]["step"])
                write_state(directory, saved)
            # SYNC upload: the checkpoint is in storage when report returns. Sharded: Ray
            # copies every rank's files into the one checkpoint and registers it only once
            # every rank's report is in (never a checkpoint with a shard missing).
            if shards is not None:
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))
            else:
                report_sync(metrics, directory, self.log)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def _save_async(self, metrics: dict[str, Any], saved: dict[str, Any]) -> None:
        """Wait for the previous upload, snapshot, and hand the rest to Ray's upload
        thread."""
        waited = time.perf_counter()
        if not self.idle.is_set():
            self.idle.wait()
            self.log(f"checkpoint: waited {time.perf_counter() - waited:.1f} s for the "
                     "previous one to reach storage")  # fmt: skip
        first = not self.snapshots.buffers
        copy = self.snapshots.take(saved)
        if first:
            size = self.snapshots.nbytes / 2**20
            self.log(f"checkpoints are asynchronous: each takes a {size:.0f} MB snapshot in "
                     "host memory; training goes on while it is written and uploaded")  # fmt: skip
        self.idle.clear()
        step = saved["progress"]["step"]

        def write(directory: str) -> None:
            self.before_write(step)
            write_state(directory, copy)

        try:
            report_async(metrics, write, self.idle.set, self.log)
        except BaseException:
            self.idle.set()
            raise
