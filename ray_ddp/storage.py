"""Where runs are stored, and whether every node can reach it.

Checkpoints are written by the rank-0 worker, wherever Ray placed it, and read back by
whichever node a restarted worker lands on; the driver reads the summary. On more than one
node the storage must therefore be shared: a pyarrow URI (``s3://``, ``gs://``, ...) or a
path every node sees (an NFS mount). A plain local path is checked for real: the driver
writes a marker file and a tiny task on every node looks for it.
"""

from __future__ import annotations

import os
import uuid

from ray_ddp.config import ConfigError


def is_uri(path: str) -> bool:
    return "://" in path


def storage_location(path: str) -> str:
    """An absolute local path or a URI (Ray requires one or the other)."""
    if is_uri(path):
        return path
    return os.path.abspath(os.path.expanduser(path))


def _sees(path: str) -> bool:
    return os.path.exists(path)


def check_shared_storage(path: str) -> None:
    """Refuse a local ``path`` that some node of a multi-node cluster cannot see."""
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


def write_bytes(path: str, data: bytes) -> None:
    """Write a file at a local path or a pyarrow URI (s3://, gs://), parents included,
    completely or not at all: a local file is written beside and renamed (an object
    store's upload only appears once it is complete)."""
    if not is_uri(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(f"{path}.tmp", "wb") as f:
            f.write(data)
        os.replace(f"{path}.tmp", path)
        return
    import pyarrow.fs

    fs, inner = pyarrow.fs.FileSystem.from_uri(path)
    fs.create_dir(os.path.dirname(inner), recursive=True)
    with fs.open_output_stream(inner) as out:
        out.write(data)


def read_text(path: str) -> str | None:
    """A file's text at a local path or a pyarrow URI; None if there is no such file."""
    if not is_uri(path):
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return f.read()
    import pyarrow.fs

    fs, inner = pyarrow.fs.FileSystem.from_uri(path)
    if fs.get_file_info(inner).type != pyarrow.fs.FileType.File:
        return None
    with fs.open_input_stream(inner) as f:
        return f.read().decode()


def list_checkpoints(fs, run_dir: str) -> list[str]:
    """The ``checkpoint_*`` directories in ``run_dir`` on pyarrow filesystem ``fs``, oldest
    first (Ray names them by time)."""
    import pyarrow.fs

    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(run_dir))
    except FileNotFoundError:
        return []
    names = sorted(
        i.base_name
        for i in infos
        if i.type == pyarrow.fs.FileType.Directory and i.base_name.startswith("checkpoint_")
    )
    return [f"{run_dir}/{name}" for name in names]
