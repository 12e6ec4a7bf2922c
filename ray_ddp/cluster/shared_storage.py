"""Storage every node sees: a run's storage on a multi-node cluster must be a URI or a path
mounted everywhere (checked for real), and a local checkpoint a worker must read is copied
into it first."""

from __future__ import annotations

import os
import uuid

from ray_ddp.config import ConfigError
from ray_ddp.io.storage import is_uri, join, upload_dir


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


def shared_checkpoint(path: str, run_dir: str, nodes: int, folder: str, flag: str) -> str:
    """A checkpoint at ``path`` as every worker can read it. A URI already is. A local path
    is made absolute (workers run in directories of their own), and on a cluster of more
    than one node it is copied into ``<run_dir>/<folder>/<checkpoint>``: a worker on
    another node than the driver's may not have the path, while every node sees the run's
    storage (``cluster.check_shared_storage``). Each file of the copy is written whole."""
    if is_uri(path):
        return path
    source = os.path.abspath(os.path.expanduser(path))
    if nodes <= 1:
        return source
    target = join(run_dir, folder, os.path.basename(source.rstrip(os.sep)))
    upload_dir(source, target)
    print(f"{flag} {source} copied to {target}, where every node sees it", flush=True)
    return target
