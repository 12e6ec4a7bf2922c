"""What the driver can learn about a Ray cluster's autoscaler (the node types it may
start: their resources and how many of each), and how it asks the autoscaler for nodes.

Ray 2.60 has no public record of the node types. They come from, in order:

* the cluster config in the GCS, where a platform publishes one (Ray Train and Ray Data
  read the same record, ``ray._private.state.state.get_cluster_config()``);
* the autoscaling config file the cluster's monitor process was started with, readable
  when the driver runs on the head (``ray job submit`` drivers do; the cluster launcher's
  is ``~/ray_bootstrap_config.yaml``, with the resources filled in from the instance
  types).

Whether an autoscaler runs at all cannot be told apart otherwise: every v1 monitor
reports an autoscaler status, read-only ones (no node types, nothing to launch) included.
When neither source is there the node types are unknown, and the driver says so rather
than guess: ``--use-gpu`` and ``--wait-for-resources`` are then the explicit request.

Asking it for nodes goes through the coordinator Ray Train's own controller uses
(:func:`asking_for`), not a bare ``ray.autoscaler.sdk.request_resources``: see there why.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ray_ddp.cluster.placement import Nodes

UNLIMITED = 10_000  # a node type without a maximum ("-1"): more nodes than any request
COORDINATOR_TIMEOUT_S = 60  # to start the coordinator actor (a process) and hear back


@contextmanager
def asking_for(bundles: list[Mapping[str, float]], expire_s: float) -> Iterator[None]:
    """Ask the autoscaler for nodes that hold ``bundles`` (one per worker) for the
    duration of the block; the request is withdrawn when it ends, however it ends, and
    expires by itself ``expire_s`` after it was made if this driver dies first.

    Ray's autoscaler keeps one standing request per cluster (``request_resources``: each
    call replaces the last). In Ray 2.60 a detached ``AutoscalingCoordinator`` actor owns
    it: Ray Train's controllers and Ray Data register their bundles with it, and it sends
    the merged list on every change and every 20 s. A bare ``request_resources`` from
    this driver would be overwritten at its next tick, and clearing one would clear every
    other job's. So the driver registers with the coordinator too, as one more requester.
    """
    import ray
    from ray.data._internal.cluster_autoscaler.base_autoscaling_coordinator import (
        ResourceRequestPriority,
    )
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    coordinator = get_or_create_autoscaling_coordinator()
    requester = f"ray_ddp-driver-{uuid.uuid4().hex[:12]}"
    asked = coordinator.request_resources.remote(
        requester_id=requester,
        resources=[dict(bundle) for bundle in bundles],
        expire_after_s=expire_s,
        priority=ResourceRequestPriority.HIGH,
    )
    try:
        ray.get(asked, timeout=COORDINATOR_TIMEOUT_S)
        yield
    finally:
        ray.get(coordinator.cancel_request.remote(requester), timeout=COORDINATOR_TIMEOUT_S)


def autoscaler_node_types() -> tuple[list[Nodes] | None, int | None]:
    """The node types the cluster's autoscaler may start and its cap on worker nodes;
    ``(None, None)`` when this driver cannot see them."""
    import ray._private.state

    published = ray._private.state.state.get_cluster_config()
    if published is not None and published.node_group_configs:
        return types_from_cluster_config(published)
    path = monitor_config_path(ray.get_runtime_context().gcs_address)
    if path is None:
        return None, None
    try:
        with open(path) as f:
            import yaml

            config = yaml.safe_load(f)
    except (OSError, ValueError):
        return None, None
    return types_from_launcher_config(config)


def monitor_config_path(gcs_address: str) -> str | None:
    """The ``--autoscaling-config`` file of the monitor of the cluster at ``gcs_address``,
    if that monitor runs on this machine. Matched by the GCS port only: the driver may
    know the head by another name (127.0.0.1, its IP) than the monitor does, and two
    clusters on one machine cannot share a port."""
    import importlib

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
        config = flags.get("--autoscaling-config")
        if config and flags.get("--gcs-address", "").rsplit(":", 1)[-1] == port:
            return os.path.expanduser(config)
    return None


def types_from_launcher_config(config: Any) -> tuple[list[Nodes] | None, int | None]:
    """Node types from a cluster-launcher config (``cluster.yaml`` as the head runs it).
    Unknown (None) if a worker type's resources are not filled in: the autoscaler then
    learns them only from a launched node."""
    if not isinstance(config, dict) or not isinstance(config.get("available_node_types"), dict):
        return None, None
    max_nodes = config.get("max_workers")
    types = []
    for name, node_type in config["available_node_types"].items():
        if name == config.get("head_node_type"):
            continue  # the head is up already, and its type starts no more
        count = node_type.get("max_workers", max_nodes if max_nodes is not None else UNLIMITED)
        resources = node_type.get("resources") or {}
        if count <= 0:
            continue
        if "CPU" not in resources:
            return None, None
        types.append(Nodes({k: float(v) for k, v in resources.items()}, int(count)))
    return types, (int(max_nodes) if max_nodes is not None else None)


def types_from_cluster_config(config: Any) -> tuple[list[Nodes] | None, int | None]:
    """Node types from the GCS's ``autoscaler_pb2.ClusterConfig``."""
    types = []
    for group in config.node_group_configs:
        if group.max_count == 0 or not group.resources:
            continue
        count = UNLIMITED if group.max_count < 0 else group.max_count
        types.append(Nodes({k: float(v) for k, v in group.resources.items()}, count))
    return types, None
