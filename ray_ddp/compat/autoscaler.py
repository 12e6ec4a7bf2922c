"""Asking the cluster's autoscaler for nodes while the driver waits for them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

COORDINATOR_TIMEOUT_S = 60  # to start the coordinator actor (a process) and hear back


@contextmanager
def asking_for(bundles: list[Mapping[str, float]], expire_s: float) -> Iterator[None]:
    """Ask the autoscaler for nodes that hold ``bundles`` (one per worker) for the
    duration of the block; the request is withdrawn when it ends, however it ends, and
    expires by itself ``expire_s`` after it was made if this driver dies first.

    Ray's autoscaler keeps one standing request per cluster (``request_resources``: each
    call replaces the last). Since Ray 2.5x a detached ``AutoscalingCoordinator`` actor owns
    it: Ray Train's controllers and Ray Data register their bundles with it, and it sends
    the merged list on every change and every 20 s. A bare ``request_resources`` from
    this driver would be overwritten at its next tick, and clearing one would clear every
    other job's. So the driver registers with the coordinator too, as one more requester.
    """
    import ray

    try:  # the coordinator is Ray Data's, with no public API
        from ray.data._internal.cluster_autoscaler.base_autoscaling_coordinator import (
            ResourceRequestPriority,
        )
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )
    except ImportError as exc:
        with _standing_request(bundles, exc):
            yield
        return
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


@contextmanager
def _standing_request(bundles: list[Mapping[str, float]], missing: Exception) -> Iterator[None]:
    """Where this Ray has no coordinator: Ray's public ``request_resources``, made for the
    block and cleared after it (which clears any other job's request too: said once)."""
    from ray.autoscaler.sdk import request_resources

    from ray_ddp.compat.cluster_state import _fallback

    _fallback("Ray's autoscaling coordinator", missing, "asking with request_resources")
    request_resources(bundles=[dict(bundle) for bundle in bundles])
    try:
        yield
    finally:
        request_resources(bundles=[])
