"""Where runs are stored (a local path or a pyarrow URI: ``s3://``, ``gs://``), and
writing and reading files there completely or not at all. (Whether every node of a
cluster sees the storage is checked by ``cluster.check_shared_storage``.)
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator


def is_uri(path: str) -> bool:
    return "://" in path


def storage_location(path: str) -> str:
    """An absolute local path or a URI (Ray requires one or the other)."""
    if is_uri(path):
        return path
    return os.path.abspath(os.path.expanduser(path))


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A temporary name beside local ``path`` to write to; renamed over ``path`` only when
    the block finishes, so ``path`` is never seen half-written (a crash leaves the old
    file, or none). Parents are created."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    head, tail = os.path.split(path)
    tmp = os.path.join(head, f".partial.{uuid.uuid4().hex[:8]}.{tail}")  # keeps the suffix
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_bytes(path: str, data: bytes) -> None:
    """Write a file at a local path or a pyarrow URI (s3://, gs://), parents included,
    completely or not at all: a local file is written beside and renamed (an object
    store's upload only appears once it is complete)."""
    if not is_uri(path):
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            f.write(data)
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
