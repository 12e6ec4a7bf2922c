"""The driver's side of Ray: connect, size the request against the cluster, check that
the storage is shared, in one pipeline that training, tuning and evaluation all go through.

Ray itself would leave an unplaceable request pending forever; here a request larger than
the whole cluster fails at once (unless ``--wait-for-resources`` allows time for nodes to
join), and one that fits the cluster but not what is free now waits a bounded time.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Sequence

from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.preflight import PreparedTask, check_batch_fits, preflight
from ray_ddp.storage import is_uri, storage_location
from ray_ddp.task import Task

DEFAULT_CPU_WORKERS = 2
RESOURCE_POLL_S = 2.0

# A Ray started by this process for itself (not a cluster it joins) runs beside the
# workers on the same cores: the background work that only clusters need is switched off.
# Measured with benchmarks/run.py (2 cores, 2 workers, batch 256): 4751 vs 4506 samples/s
# and the first step 2 s sooner (2 runs each). The dashboard stays: Tune's clean-up of
# placement groups uses its State API.
QUIET_LOCAL_RAY = {
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",  # no spot preemption on one machine
    "RAY_TRAIN_METRICS_ENABLED": "0",  # Train's Prometheus metrics export
    "RAY_USAGE_STATS_ENABLED": "0",  # usage telemetry at start-up
}


def prepare_cluster_run(
    cfg: TrainConfig, batch_sizes: Sequence[int] = (), task: Task | None = None
) -> tuple[TrainConfig, PreparedTask]:
    """Preflight (of ``task``, else the one ``cfg.task`` names), connect, resolve the
    workers, re-check the batch now that the worker count is known, and make the storage
    absolute and shared. Returns the resolved config (``num_workers`` and ``use_gpu`` set,
    ``storage_path`` absolute or a URI) and the checked task."""
    prepared = preflight(cfg, batch_sizes, task)
    connect(cfg.address)
    cfg = resolve_scaling(cfg)
    for batch_size in batch_sizes or [cfg.batch_size]:
        check_batch_fits(cfg, prepared.train_size, batch_size)
    cfg = dataclasses.replace(cfg, storage_path=storage_location(cfg.storage_path))
    check_shared_storage(cfg.storage_path)
    return cfg, prepared


def connect(address: str | None) -> None:
    """Join the cluster at ``address`` (or RAY_ADDRESS), else start a local Ray."""
    import ray

    if ray.is_initialized():
        return
    if not address and not os.environ.get("RAY_ADDRESS"):
        for key, value in QUIET_LOCAL_RAY.items():
            os.environ.setdefault(key, value)  # the user's own setting wins
    ray.init(address=address, logging_level="WARNING", log_to_driver=True)


def resolve_scaling(cfg: TrainConfig) -> TrainConfig:
    """Fill in num_workers and use_gpu from the cluster, and refuse what cannot fit."""
    import ray

    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    use_gpu = cfg.use_gpu if cfg.use_gpu is not None else gpus > 0
    if cfg.amp == "fp16" and not use_gpu:
        raise ConfigError("--amp fp16 needs GPU workers; use --amp bf16 or --amp off on CPU")
    num_workers = cfg.num_workers or (gpus if use_gpu else DEFAULT_CPU_WORKERS)
    cfg = dataclasses.replace(cfg, num_workers=num_workers, use_gpu=use_gpu)

    deadline = time.monotonic() + cfg.wait_for_resources
    said = False
    while missing := _shortage(cfg, ray.cluster_resources(), "the Ray cluster has"):
        if time.monotonic() >= deadline:
            raise ConfigError(missing)
        if not said:
            print(f"{missing}; waiting up to {cfg.wait_for_resources:g} s for nodes", flush=True)
            said = True
        time.sleep(RESOURCE_POLL_S)

    deadline = time.monotonic() + max(30.0, cfg.wait_for_resources)
    while missing := _shortage(cfg, ray.available_resources(), "free now:"):
        if time.monotonic() >= deadline:
            raise ConfigError(f"{missing} (other jobs hold the rest); try again later")
        time.sleep(RESOURCE_POLL_S)
    return cfg


def _shortage(cfg: TrainConfig, resources: dict[str, float], have: str) -> str | None:
    """What the request lacks in ``resources``, as a message; None if it fits."""
    assert cfg.num_workers is not None
    gpus = int(resources.get("GPU", 0))
    cpus = resources.get("CPU", 0)
    if cfg.use_gpu and gpus == 0:
        return "--use-gpu was given but the Ray cluster has no GPUs; drop it or use --no-gpu"
    need_cpus = cfg.num_workers * cfg.cpus_per_worker
    if need_cpus > cpus + 1e-9:
        return (
            f"{cfg.num_workers} workers x {cfg.cpus_per_worker:g} CPUs = {need_cpus:g} CPUs "
            f"asked, {have} {cpus:g}; lower --num-workers or --cpus-per-worker"
        )
    if cfg.use_gpu and cfg.num_workers > gpus:
        return f"{cfg.num_workers} GPU workers asked, {have} {gpus} GPUs; lower --num-workers"
    return None


def _sees(path: str) -> bool:
    return os.path.exists(path)


def check_shared_storage(path: str) -> None:
    """Refuse a local ``path`` that some node of a multi-node cluster cannot see.

    Checkpoints are written by the rank-0 worker, wherever Ray placed it, and read back by
    whichever node a restarted worker lands on: on more than one node the storage must be
    a URI (``s3://``, ``gs://``) or a path every node sees (NFS). A local path is checked
    for real: the driver writes a marker file and a tiny task on every node looks for it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) <= 1 or is_uri(path):
        return
    os.makedirs(path, exist_ok=True)
    marker = os.path.join(path, f".ray_ddp_shared_check_{uuid.uuid4().hex}")
    with open(marker, "w") as f:
        f.write("visible from every node?\n")
    try:
        probe = ray.remote(num_cpus=0)(_sees)
        refs = [
            probe.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(marker)
            for n in nodes
        ]
        seen = ray.get(refs, timeout=120)
    finally:
        os.remove(marker)
    blind = [n["NodeManagerAddress"] for n, ok in zip(nodes, seen, strict=True) if not ok]
    if blind:
        raise ConfigError(
            f"--storage-path {path} is local to this machine: {len(blind)} of {len(nodes)} "
            f"nodes ({', '.join(sorted(set(blind))[:3])}) cannot see it; use s3://, gs:// or "
            "a path mounted on every node"
        )
