"""What the driver can learn about a Ray cluster's autoscaler (the node types it may
start: their resources and how many of each), and how it asks the autoscaler for nodes.

Ray 2.60 has no public record of the node types. They come from, in order:

* the cluster config in the GCS, where a platform publishes one (Ray Train and Ray Data
  read the same record: ``ray_ddp.compat.cluster_state``);
* the autoscaling config file the cluster's monitor process was started with, readable
  when the driver runs on the head (``ray job submit`` drivers do; the cluster launcher's
  is ``~/ray_bootstrap_config.yaml``, with the resources filled in from the instance
  types).

Whether an autoscaler runs at all cannot be told apart otherwise: every v1 monitor
reports an autoscaler status, read-only ones (no node types, nothing to launch) included.
When neither source is there the node types are unknown, and the driver says so rather
than guess: ``--use-gpu`` and ``--wait-for-resources`` are then the explicit request.

Asking it for nodes goes through the coordinator Ray Train's own controller uses
(``ray_ddp.compat.autoscaler.asking_for``), not a bare
``ray.autoscaler.sdk.request_resources``: see there why.
"""

from __future__ import annotations

from typing import Any

from ray_ddp.cluster.placement import Nodes
from ray_ddp.compat.cluster_state import monitor_config_path, published_node_groups

UNLIMITED = 10_000  # a node type without a maximum ("-1"): more nodes than any request


def autoscaler_node_types() -> tuple[list[Nodes] | None, int | None]:
    """The node types the cluster's autoscaler may start and its cap on worker nodes;
    ``(None, None)`` when this driver cannot see them."""
    import ray

    groups = published_node_groups()
    if groups:
        return types_from_node_groups(groups)
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


def types_from_node_groups(groups: Any) -> tuple[list[Nodes] | None, int | None]:
    """Node types from the node groups of the cluster config a platform publishes."""
    types = []
    for group in groups:
        if group.max_count == 0 or not group.resources:
            continue
        count = UNLIMITED if group.max_count < 0 else group.max_count
        types.append(Nodes({k: float(v) for k, v in group.resources.items()}, count))
    return types, None
