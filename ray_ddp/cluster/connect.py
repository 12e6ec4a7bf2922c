"""Joining a Ray cluster, or starting a local Ray for this process, quietly."""

from __future__ import annotations

import contextlib
import os
import signal

# A Ray started by this process for itself (not a cluster it joins) runs beside the
# workers on the same cores: the background work that only clusters need is switched off.
# Measured with benchmarks/run.py (2 cores, 2 workers, batch 256): 4751 vs 4506 samples/s
# and the first step 2 s sooner (2 runs each). The dashboard is left out too (see connect),
# and so are Ray Train's helper actors (lean_trainer, which also keeps these variables from
# the workers' runtime environment).
QUIET_LOCAL_RAY = {
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",  # no spot preemption on one machine
    "RAY_TRAIN_METRICS_ENABLED": "0",  # Train's Prometheus metrics export
    "RAY_USAGE_STATS_ENABLED": "0",  # usage telemetry at start-up
}


def connect(address: str | None, dashboard: bool = False) -> None:
    """Join the cluster at ``address`` (or RAY_ADDRESS), else start a local Ray.

    A local Ray for one run starts without its dashboard: nothing in a run reads it once
    Ray Train's PlacementGroupCleaner is left out (``lean_trainer``), and it is a process
    tree of its own that starts with Ray and takes CPU beside the workers.
    ``dashboard=True`` (a sweep: Tune's trials clean up through its State API) or
    ``RAY_DDP_DASHBOARD=1`` (to watch a local run at http://127.0.0.1:8265) keep it."""
    import ray

    if ray.is_initialized():
        return
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, logging_level="WARNING", log_to_driver=True)
        return
    for key, value in QUIET_LOCAL_RAY.items():
        os.environ.setdefault(key, value)  # the user's own setting wins
    dashboard = dashboard or os.environ.get("RAY_DDP_DASHBOARD") == "1"
    ray.init(logging_level="WARNING", log_to_driver=True, include_dashboard=dashboard)
    global _STARTED_HERE
    _STARTED_HERE = True


_STARTED_HERE = False
"""Whether this process started the Ray it is connected to (``connect``)."""


def shutdown() -> None:
    """Leave Ray. A Ray this process started stops with it, and so does any of its worker
    processes that outlives it: a worker that hangs in its own exit after Ray has let it go
    (Ray's teardown does now and then, seen after about 1 in 40 worker groups: a Train
    controller stuck on a lock in ``_raylet.so`` with its core worker already destroyed,
    ray-project/ray#52322) is no longer Ray's to kill, and would keep its memory (about
    200 MB) until the machine restarts. The workers are the raylet's children: each is
    noted before the raylet goes and killed if the same process is there afterwards (one
    still in a normal exit is killed too: its Ray is gone)."""
    import ray

    global _STARTED_HERE
    workers = _children(_children({os.getpid()}, "raylet")) if _STARTED_HERE else {}
    ray.shutdown()
    _STARTED_HERE = False
    for pid, started in workers.items():
        if _process(pid)[2:] == (started,):
            with contextlib.suppress(OSError):  # gone meanwhile
                os.kill(pid, signal.SIGKILL)


def _process(pid: int) -> tuple[int, str, int] | tuple[()]:
    """(parent pid, name, start time in clock ticks since boot) from Linux's /proc; ()
    once gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            stat = file.read()
    except OSError:
        return ()
    name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rsplit(")", 1)[1].split()
    return () if fields[0] == "Z" else (int(fields[1]), name, int(fields[19]))


def _children(parents: set[int] | dict[int, int], name: str | None = None) -> dict[int, int]:
    """pid -> start time of the living processes whose parent is one of ``parents`` (and
    named ``name``); none where there is no /proc (not Linux)."""
    found = {}
    entries = os.listdir("/proc") if parents and os.path.isdir("/proc") else []
    for entry in filter(str.isdigit, entries):
        info = _process(int(entry))
        if info and info[0] in parents and name in (None, info[1]):
            found[int(entry)] = info[2]
    return found


def alive_nodes() -> int:
    import ray

    return sum(1 for node in ray.nodes() if node["Alive"])
