"""``--profile-steps A-B``: optimizer steps A to B recorded on every rank with
``torch.profiler`` (CPU activity, and CUDA's on GPUs; shapes and memory), one warm-up step
before them left out of the record (where the run has one: not before step 1, nor right
after a resume), then one Chrome/Perfetto trace per rank in
``<run>/profiles/attempt-<N>/rank-<R>.trace.json``. On GPUs the CUDA caching allocator's
history of those steps goes beside it (``rank-<R>.memory.pickle``, for
https://pytorch.org/memory_viz). A URI storage gets the files written locally first, then
copied up. Rank 0 keeps its top operators by self time for the driver to print.

A checkpoint or an epoch's validation that falls inside the range is in the trace too.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from ray_ddp.io.storage import is_uri, join, remove_local, upload_dir

PROFILES = "profiles"
TOP_ROWS = 15


def profile_folder(run_dir: str, attempt: int) -> str:
    return join(run_dir, PROFILES, f"attempt-{attempt}")


class StepProfiler:
    """One rank's profiler over steps ``first``..``last`` of the run."""

    def __init__(
        self, steps: tuple[int, int], run_dir: str, attempt: int, rank: int,
        device: torch.device, log: Any,
    ) -> None:  # fmt: skip
        self.first, self.last = steps
        self.target = profile_folder(run_dir, attempt)
        self.local = tempfile.mkdtemp(prefix="ray_ddp_profile_") if is_uri(run_dir) else None
        self.rank, self.device, self.log = rank, device, log
        self.profiler: Any = None
        self.start_after: int | None = None
        self.result: dict[str, Any] = {}

    def begin(self, done: int) -> None:
        """Before the attempt's first step (``done`` steps already trained): plan the
        start, or start now."""
        if self.last <= done:
            if self.rank == 0:
                self.log(
                    f"--profile-steps {self.first}-{self.last}: those steps were trained "
                    f"before this attempt ({done} done); nothing recorded"
                )
            return
        first = max(self.first, done + 1)
        self.warmup = 1 if first - 1 > done else 0
        self.active = self.last - first + 1
        self.start_after = first - self.warmup - 1
        if self.start_after == done:
            self._start()

    def stepped(self, step: int) -> None:
        """Optimizer step ``step`` is done (a boundary of the profiler's schedule)."""
        if self.profiler is None:
            if step == self.start_after:
                self._start()
            return
        self.profiler.step()
        if step >= self.last:
            self._finish()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.profiler = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=self._write_trace,
            record_shapes=True,
            profile_memory=True,
        )
        self.profiler.start()

    def _folder(self) -> str:
        folder = self.local or self.target
        os.makedirs(folder, exist_ok=True)
        return folder

    def _write_trace(self, profiler: Any) -> None:
        path = os.path.join(self._folder(), f"rank-{self.rank}.trace.json")
        profiler.export_chrome_trace(path)
        if self.rank == 0:
            cuda = self.device.type == "cuda"
            key = "self_device_time_total" if cuda else "self_cpu_time_total"
            table = profiler.key_averages().table(sort_by=key, row_limit=TOP_ROWS)
            self.result = {"folder": self.target, "steps": f"{self.first}-{self.last}",
                           "top": table, "sorted_by": key}  # fmt: skip

    def _finish(self) -> None:
        self.profiler.stop()
        self.profiler = None
        if self.device.type == "cuda":
            path = os.path.join(self._folder(), f"rank-{self.rank}.memory.pickle")
            torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.local is not None:
            upload_dir(self.local, self.target)
            remove_local(self.local)
        self.start_after = None

    def close(self) -> None:
        """The run ended inside the range (``--max-steps``, a failure): stop quietly."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
