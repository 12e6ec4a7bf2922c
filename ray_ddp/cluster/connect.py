"""Joining a Ray cluster, or starting a local Ray for this process, quietly."""

from __future__ import annotations

import contextlib
import logging
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
    ``RAY_DDP_DASHBOARD=1`` (to watch a local run at http://127.0.0.1:8265) keep it.

    A local Ray started here stops through :func:`shutdown` when the process exits (a
    program calling ``ray_ddp.fit`` need not), before Ray's own exit hook would stop it
    without its hung workers."""
    import atexit

    import ray

    if ray.is_initialized():
        return
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
        return
    for key, value in QUIET_LOCAL_RAY.items():
        os.environ.setdefault(key, value)  # the user's own setting wins
    dashboard = dashboard or os.environ.get("RAY_DDP_DASHBOARD") == "1"
    ray.init(logging_level=logging.WARNING, log_to_driver=True, include_dashboard=dashboard)
    atexit.unregister(shutdown)  # once, however many runs started a Ray in this process
    atexit.register(shutdown)  # runs before ray.init's own hook (last registered, first run)


def shutdown() -> None:
    """Leave Ray. A Ray this process started stops with it, and so does any of its worker
    processes that outlives it: a worker that hangs in its own exit after Ray has let it go
    (Ray's teardown does now and then, seen after about 1 in 40 worker groups: a Train
    controller stuck on a lock in ``_raylet.so`` with its core worker already destroyed,
    ray-project/ray#52322) is no longer Ray's to kill, and would keep its memory (about
    200 MB) until the machine restarts. The workers are the children of a raylet this
    process started: each is noted before Ray stops, and killed if its raylet has gone and
    the same process is still there (one still in a normal exit is killed too: its Ray is
    gone). A raylet that outlives ``ray.shutdown`` is not one it stopped (a test's
    ``cluster_utils`` node): its workers are left alone, as are a joined cluster's."""
    import ray

    raylets = _children({os.getpid()}, "raylet")
    workers = {raylet: _children({raylet}) for raylet in raylets}
    ray.shutdown()
    for raylet, started in raylets.items():
        if _still(raylet, started):
            continue
        for pid, since in workers[raylet].items():
            if _still(pid, since):
                with contextlib.suppress(OSError):  # gone meanwhile
                    os.kill(pid, signal.SIGKILL)


def _still(pid: int, started: int) -> bool:
    """Whether process ``pid`` is still the one that started at ``started``."""
    return _process(pid)[2:] == (started,)


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
