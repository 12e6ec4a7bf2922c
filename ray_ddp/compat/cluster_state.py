"""What the driver reads about the cluster that Ray has no public API for. Each falls back,
saying so once, where the installed Ray lacks it."""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any


@functools.cache
def _fallback(what: str, exc: BaseException, instead: str) -> None:
    """Say once per process that ``what`` is missing in this Ray and what is done instead."""
    print(
        f"ray_ddp: {what} is not in this Ray ({type(exc).__name__}: {exc}); {instead}", flush=True
    )


def free_resources_per_node() -> list[dict[str, float]]:
    """What is free now on each node that is up. Ray's public API has the cluster's totals
    only, and a request the totals hold may fit no single node."""
    import ray

    try:
        from ray._private.state import available_resources_per_node

        return [dict(free) for free in available_resources_per_node().values()]
    except (ImportError, AttributeError) as exc:
        _fallback(
            "ray._private.state.available_resources_per_node", exc,
            "counting what is free over the whole cluster, as one node",
        )  # fmt: skip
        return [dict(ray.available_resources())]


def published_node_groups() -> Any:
    """The node groups of the cluster config a platform publishes in the GCS (the node
    types an autoscaler may start, with their resources and counts), or None. Ray Train and
    Ray Data read the same record; it has no public API."""
    try:
        import ray._private.state

        published = ray._private.state.state.get_cluster_config()
    except (ImportError, AttributeError) as exc:
        _fallback("the GCS's cluster config", exc, "node types are read from the monitor's")
        return None
    return published.node_group_configs if published is not None else None


def monitor_config_path(gcs_address: str) -> str | None:
    """The ``--autoscaling-config`` file of the monitor of the cluster at ``gcs_address``,
    if that monitor runs on this machine: how the autoscaler was started is not published
    anywhere else. Matched by the GCS port only: the driver may know the head by another
    name (127.0.0.1, its IP) than the monitor does, and two clusters on one machine cannot
    share a port."""
    found = _monitor(gcs_address)
    config = found[1].get("--autoscaling-config") if found else None
    return os.path.expanduser(config) if config else None


def monitor_pid(gcs_address: str) -> int | None:
    """The process id of the autoscaler's monitor of the cluster at ``gcs_address``, if it
    runs on this machine (the nodes a fake autoscaler starts are its children)."""
    found = _monitor(gcs_address)
    return found[0] if found else None


def _monitor(gcs_address: str) -> tuple[int, dict[str, str]] | None:
    """(pid, ``--flag=value`` arguments) of the monitor process at ``gcs_address``'s port."""
    import ray  # noqa: F401 - puts the psutil it ships (ray/thirdparty_files) on the path

    psutil = importlib.import_module("psutil")
    port = gcs_address.rsplit(":", 1)[-1]
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if not any(os.path.basename(part) == "monitor.py" for part in cmdline[:4]):
            continue  # the autoscaler's monitor (v1 or v2), not the log monitor
        flags = dict(
            part.split("=", 1) for part in cmdline if part.startswith("--") and "=" in part
        )
        if flags.get("--gcs-address", "").rsplit(":", 1)[-1] == port:
            return process.pid, flags
    return None


def autoscaler_status() -> dict[str, Any] | None:
    """The autoscaler's latest status report (written every update, with its standing
    request for nodes under ``load_metrics_report.request_demand``), or None before the
    first. Ray publishes it in the GCS's key-value store under a private key."""
    import json

    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    status = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
    return json.loads(status) if status else None
