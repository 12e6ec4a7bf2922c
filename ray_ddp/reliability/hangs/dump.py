"""What a hung rank leaves behind, and how its attempt ends.

On a :class:`~ray_ddp.reliability.hangs.watchdog.Stall` the rank writes
``<run>/hangs/attempt-<N>/rank-<r>.txt``: a header of ``key: value`` lines (read back by
``ray_ddp.reliability.hangs.report``), every thread's Python stack, and, where py-spy is
installed (it
ships with ``ray[default]``), the native stacks of the rank and of its DataLoader worker
processes; on NCCL, the flight recorder's trace beside it (``rank-<r>.nccl-trace.pkl``).
It then waits for the other ranks' files (:func:`peer_wait_s`); a rank on its own node
that wrote none (a process that cannot run Python at all: a native call holding Python's
lock) it dumps itself with py-spy, by the pid every rank learnt at the start. Then it kills
its DataLoader workers and ends its process with ``EXIT_HUNG``: Ray Train sees a failed
attempt, which ``--max-failures`` restarts from the latest checkpoint like any other.

Ending the process is the one way out that always works: a thread stuck in a collective or
in ``time.sleep`` cannot be made to raise, and the process group's timeout is far away.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

from ray_ddp.io.storage import exists, join, write_bytes
from ray_ddp.reliability.hangs.report import report_path, report_text
from ray_ddp.reliability.hangs.watchdog import Stall

EXIT_HUNG = 75
"""The exit status of a rank the watchdog ended."""
PEER_WAIT_MAX_S = 30.0
PEER_WAIT_MIN_S = 5.0


def peer_wait_s(allowed_s: float) -> float:
    """How long a hung rank waits for the other ranks' stack files: ranks notice a hang
    within about one step and one watchdog tick of each other, or at once by the peer check,
    so one steady allowance is plenty; at least 5 s (py-spy's dumps), at most 30 s."""
    return min(PEER_WAIT_MAX_S, max(PEER_WAIT_MIN_S, allowed_s))


PY_SPY_TIMEOUT_S = 20.0
PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, 2**64 - 1  # linux/prctl.h
DETECTED = "detected"
"""The marker the first rank to find a hang writes in the attempt's folder: ranks still
inside a longer allowance see it (``peer_check``) and write their stacks too."""


@dataclass(frozen=True)
class HangSite:
    """Where a rank's hang report goes."""

    rank: int
    world_size: int
    attempt: int
    folder: str
    """``<run>/hangs/attempt-<N>`` (a local path or a storage URI)."""
    peers: tuple[tuple[str, int], ...] = ()
    """Every rank's (host, pid), in rank order: a silent rank on this host is dumped by pid."""

    def rank_file(self, rank: int) -> str:
        return report_path(self.folder, rank)

    def header(self, stall: Stall, rank: int, host: str, pid: int) -> dict[str, str]:
        """What every report's header starts with."""
        return {
            "rank": f"{rank} of {self.world_size}",
            "attempt": str(self.attempt),
            "host": host,
            "pid": str(pid),
            "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "idle_s": f"{stall.idle_s:.1f}",
            "allowed_s": f"{stall.allowed_s:.1f}",
        }

    def peer_found_hang(self) -> bool:
        return exists(join(self.folder, DETECTED))


def handle_hang(stall: Stall, site: HangSite, end: Callable[[int], None] = os._exit) -> None:
    """Write this rank's report, wait for the others', stop the DataLoader workers and end
    the process (``end``; a test passes its own). A report that cannot be written (the
    storage unreachable) is said on stdout: the process ends all the same, or the rank
    would stay hung."""
    children = multiprocessing.active_children()  # DataLoader workers, among others
    try:
        if not stall.by_peer and not site.peer_found_hang():
            write_bytes(join(site.folder, DETECTED), f"rank {site.rank}\n".encode())
        write_bytes(site.rank_file(site.rank), rank_report(stall, site, children).encode())
        collect_nccl_trace(site)
        deadline = time.monotonic() + peer_wait_s(stall.allowed_s)
        silent = list(range(site.world_size))
        while silent and time.monotonic() < deadline:
            silent = [r for r in silent if not exists(site.rank_file(r))]
            time.sleep(0.2)
        for rank in silent:
            dump_silent_peer(stall, site, rank)
    except Exception as exc:  # noqa: BLE001 - the exit below is what matters
        print(f"rank {site.rank} hung; its report failed: {type(exc).__name__}: {exc}")
    finally:
        for child in children:
            child.kill()  # a hung loader worker would outlive us otherwise
        sys.stdout.flush()
        end(EXIT_HUNG)


def rank_report(stall: Stall, site: HangSite, children: list | None = None) -> str:
    """This rank's report: its header, every thread's Python stack, py-spy's dumps."""
    frames = sys._current_frames()
    train_frame = frames.get(stall.thread_id)
    call = collective_call(train_frame)
    spy = py_spy()
    native = {}
    if spy is not None:
        allow_tracing()
        native[os.getpid()] = run_py_spy(spy, os.getpid(), native=True)
        for child in children or []:
            native[child.pid] = run_py_spy(spy, child.pid, native=False)
    loaders = [c.pid for c in children or []]
    header = {
        **site.header(stall, site.rank, socket.gethostname(), os.getpid()),
        "found_by": "another rank's watchdog" if stall.by_peer else "this rank's watchdog",
        "last_progress": stall.last_progress,
        "phase": stall.phase + (f" (in {call})" if call else ""),
        "collective": "yes" if stall.collective or call else "no",
        "where": where(train_frame) if train_frame is not None else "unknown",
        "loader_workers": " ".join(map(str, loaders)) or "none",
        "loading": "; ".join(
            f"pid {pid} in {loading_frame(native[pid])}"
            for pid in loaders
            if loading_frame(native.get(pid, ""))
        )
        or "nothing",
    }
    parts = ["== Python stacks (every thread; the training thread first) =="]
    parts.append(python_stacks(frames, stall.thread_id))
    if spy is None:
        parts.append("== native stacks: py-spy not found (pip install py-spy) ==")
        return report_text(header, parts)
    parts.append(f"== native stacks of this rank (py-spy dump --native --pid {os.getpid()}) ==")
    parts.append(native[os.getpid()])
    for pid in loaders:
        parts.append(f"== DataLoader worker pid {pid} (py-spy dump) ==")
        parts.append(native[pid])
    return report_text(header, parts)


def dump_silent_peer(stall: Stall, site: HangSite, rank: int) -> None:
    """The report of rank ``rank``, which wrote none, from its native stacks: py-spy by
    pid, when it runs on this host (another host's rank stays silent: the line says so)."""
    if rank >= len(site.peers) or site.peers[rank][0] != socket.gethostname():
        return
    spy = py_spy()
    if spy is None or exists(site.rank_file(rank)):
        return
    host, pid = site.peers[rank]
    dump = run_py_spy(spy, pid, native=True)
    header = {
        **site.header(stall, rank, host, pid),
        "found_by": f"rank {site.rank}'s py-spy: its own watchdog never ran (Python's lock "
        "held, or the process frozen)",
        "last_progress": "unknown",
        "phase": "unknown: no Python ran in the process",
        "collective": "no",
        "where": innermost_frame(dump) or "unknown",
        "loader_workers": "unknown",
        "loading": "nothing",
    }
    title = f"== native stacks (py-spy dump --native --pid {pid}, from rank {site.rank}) =="
    write_bytes(site.rank_file(rank), report_text(header, [title, dump]).encode())


def innermost_frame(dump: str) -> str | None:
    """The innermost Python frame of a py-spy dump's training thread (Ray Train names it
    ``TrainingThread``; else the first thread), e.g. ``stall (ray_ddp/testing/harness.py:112)``."""
    threads = _py_spy_threads(dump)
    for name, stack in threads:
        if "TrainingThread" in name:
            return _first_python(stack)
    return _first_python(threads[0][1]) if threads else None


_PYTHON_FRAME = re.compile(r"\((?:.+\.py|<[^>]+>):\d+\)$")
"""A Python frame of a py-spy dump, ``func (path/file.py:12)`` or ``<module> (<string>:1)``;
``--native`` also lists C frames, ``sleep (libc.so.6)``, ``f (callproc.c:943)``."""


def _first_python(stack: list[str]) -> str | None:
    return next((f for f in stack if _PYTHON_FRAME.search(f)), None)


def _py_spy_threads(dump: str) -> list[tuple[str, list[str]]]:
    """``(thread line, frames innermost first)`` of each thread in a py-spy dump."""
    threads: list[tuple[str, list[str]]] = []
    for line in (line.strip() for line in dump.splitlines()):
        if line.startswith("Thread "):
            threads.append((line, []))
        elif line and threads and not line.startswith(("Process ", "Python v")):
            threads[-1][1].append(line)
    return threads


def loading_frame(dump: str) -> str | None:
    """The innermost frame of a DataLoader worker's py-spy dump while it fetches samples
    (one waiting for its next index is idle in ``Queue.get``: None)."""
    for _, stack in _py_spy_threads(dump):
        if any(f.startswith("_MapDatasetFetcher.fetch") or "fetch (" in f for f in stack):
            return stack[0]
    return None


def where(frame: FrameType) -> str:
    """The innermost Python frame, ``file:line in function``."""
    return (
        f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
    )


def collective_call(frame: FrameType | None) -> str | None:
    """The collective the stack is in, if it shows one: the outermost ``torch.distributed``
    call (``all_gather_object`` rather than the ``all_gather`` inside it), or DDP's buffer
    broadcast at a forward. (DDP's gradient all-reduce runs inside autograd, below Python:
    the loop's phase says that one.)"""
    found = None
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        name = frame.f_code.co_name
        if path.endswith("torch/distributed/distributed_c10d.py") and not name.startswith("_"):
            found = f"torch.distributed.{name}"
        elif path.endswith("torch/nn/parallel/distributed.py") and "sync" in name:
            found = f"DistributedDataParallel.{name}"
        frame = frame.f_back
    return found


def python_stacks(frames: dict[int, FrameType], train_thread: int) -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    order = sorted(frames, key=lambda ident: ident != train_thread)
    blocks = []
    for ident in order:
        tag = " (training loop)" if ident == train_thread else ""
        stack = "".join(traceback.format_stack(frames[ident]))
        blocks.append(f"-- thread {names.get(ident, ident)}{tag}\n{stack}")
    return "\n".join(blocks)


def py_spy() -> str | None:
    """py-spy beside this Python (a virtual environment's bin/) or on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def allow_tracing() -> None:
    """Let py-spy, a child of this process, read this process where Yama's
    ``ptrace_scope`` 1 (Ubuntu's default) lets a process trace its descendants only.
    (Its DataLoader workers cannot be asked: where that blocks py-spy, their part of the
    report says so, and their Python stacks are not in it.)"""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: nothing to allow


def run_py_spy(spy: str, pid: int, native: bool) -> str:
    command = [spy, "dump", "--pid", str(pid), *(["--native"] if native else [])]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy failed: {exc}"
    return done.stdout if done.returncode == 0 else f"py-spy failed: {done.stderr.strip()}"


def collect_nccl_trace(site: HangSite) -> None:
    """On NCCL: the flight recorder's record of the last collectives (what each rank
    started and finished), as torch dumps it, beside the stacks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() != "nccl":
        return
    try:
        # torch's private binding (NCCL builds only), absent from its type stubs
        from torch._C._distributed_c10d import _dump_nccl_trace  # type: ignore[attr-defined]

        write_bytes(join(site.folder, f"rank-{site.rank}.nccl-trace.pkl"), _dump_nccl_trace())
    except Exception as exc:  # noqa: BLE001 - a missing trace must not stop the report
        print(f"NCCL flight recorder: no trace ({type(exc).__name__}: {exc})", flush=True)
    # What NCCL's own watchdog dumped earlier (a collective past the group's timeout).
    prefix = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if prefix and os.path.isfile(f"{prefix}{site.rank}"):
        with open(f"{prefix}{site.rank}", "rb") as file:
            write_bytes(join(site.folder, f"rank-{site.rank}.nccl-timeout-dump"), file.read())
