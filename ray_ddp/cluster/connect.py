"""Joining a Ray cluster, or starting a local Ray for this process, quietly."""

from __future__ import annotations

import os

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


def alive_nodes() -> int:
    import ray

    return sum(1 for node in ray.nodes() if node["Alive"])
