"""Where runs are stored (a local path or a pyarrow URI: ``s3://``, ``gs://``), and
writing and reading files there completely or not at all. (Whether every node of a
cluster sees the storage is checked by ``cluster.check_shared_storage``.)

A URI is anything pyarrow's ``FileSystem.from_uri`` understands, options included:
``s3://bucket/runs?endpoint_override=minio:9000&scheme=http`` reaches an S3-compatible
server (MinIO, R2, Ceph), as does a plain ``s3://`` URI with ``AWS_ENDPOINT_URL`` set.
Paths inside a URI are joined before its ``?query`` (:func:`join`), so the options stay
with every path derived from it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit


def is_uri(path: str) -> bool:
    return "://" in path


def storage_location(path: str) -> str:
    """An absolute local path or a URI (Ray requires one or the other)."""
    if is_uri(path):
        return path
    return os.path.abspath(os.path.expanduser(path))


def join(base: str, *parts: str) -> str:
    """``base/part/...`` for a local path or a URI; a URI keeps its ``?query`` (the
    filesystem's options) at the end."""
    if not is_uri(base):
        return os.path.join(base, *parts)
    scheme, netloc, path, query, fragment = urlsplit(base)
    for part in parts:
        if part:
            path = f"{path.rstrip('/')}/{part.strip('/')}"
    return urlunsplit((scheme, netloc, path, query, fragment))


def uri_of(root: str, fs_path: str) -> str:
    """The full URI of ``fs_path``, a path on the filesystem of storage ``root`` as Ray
    gives it (``Result.path``, ``Checkpoint.path``: the scheme and options stripped, e.g.
    ``bucket/runs/x/checkpoint_1`` under ``s3://bucket/runs?scheme=http``). A local
    ``root``, or a path outside ``root``, is returned as it is."""
    if not is_uri(root) or is_uri(fs_path):
        return fs_path
    scheme, netloc, path, query, fragment = urlsplit(root)
    path = path.rstrip("/")
    for prefix in (f"{netloc}{path}", path):  # s3/gs paths hold the bucket, hdfs's not
        if prefix and (fs_path == prefix or fs_path.startswith(prefix + "/")):
            rest = fs_path[len(prefix) :]
            return urlunsplit((scheme, netloc, path + rest, query, fragment))
    return fs_path


def filesystem(path: str):
    """``(pyarrow filesystem, path on it)`` for a local path or a URI."""
    import pyarrow.fs

    if not is_uri(path):
        return pyarrow.fs.LocalFileSystem(), os.path.abspath(path)
    return pyarrow.fs.FileSystem.from_uri(path)


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
    completely or not at all: a local file is written beside and renamed; an object is
    written in one call, and an object store's upload only appears once it is complete.
    (Never stream several writes into one object: pyarrow completes the upload of what
    was written when the stream closes, even on an exception.)"""
    if not is_uri(path):
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            f.write(data)
        return
    fs, inner = filesystem(path)
    fs.create_dir(os.path.dirname(inner), recursive=True)
    with fs.open_output_stream(inner) as out:
        out.write(data)


def read_bytes(path: str) -> bytes | None:
    """A file's bytes at a local path or a pyarrow URI; None if there is no such file."""
    if not is_uri(path):
        if not os.path.isfile(path):
            return None
        with open(path, "rb") as f:
            return f.read()
    import pyarrow.fs

    fs, inner = filesystem(path)
    if fs.get_file_info(inner).type != pyarrow.fs.FileType.File:
        return None
    with fs.open_input_stream(inner) as f:
        return f.read()


def read_text(path: str) -> str | None:
    """A file's text at a local path or a pyarrow URI; None if there is no such file."""
    data = read_bytes(path)
    return None if data is None else data.decode()


def exists(path: str) -> bool:
    """A file or directory at a local path or a URI. On an object store a "directory"
    exists when any object lies under its prefix (or a directory marker does)."""
    if not is_uri(path):
        return os.path.exists(path)
    import pyarrow.fs

    fs, inner = filesystem(path)
    return fs.get_file_info(inner).type != pyarrow.fs.FileType.NotFound


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """A local directory holding what directory ``path`` holds: ``path`` itself when it
    is local, else a temporary download of it, removed afterwards. A URI with nothing
    under it gives an empty directory."""
    if not is_uri(path):
        yield path
        return
    import pyarrow.fs

    fs, inner = filesystem(path)
    with tempfile.TemporaryDirectory(prefix="ray_ddp_download_") as local:
        if fs.get_file_info(inner).type == pyarrow.fs.FileType.Directory:
            pyarrow.fs.copy_files(
                inner,
                local,
                source_filesystem=fs,
                destination_filesystem=pyarrow.fs.LocalFileSystem(),
            )
        yield local


def local_files(local_dir: str) -> list[str]:
    """The files under local directory ``local_dir``, as ``/``-separated relative paths."""
    return sorted(
        os.path.relpath(os.path.join(root, name), local_dir).replace(os.sep, "/")
        for root, _, files in os.walk(local_dir)
        for name in files
    )


def upload_dir(local_dir: str, target: str) -> list[str]:
    """Copy the files under local directory ``local_dir`` to ``target`` (a local path or a
    URI), each written completely or not at all; returns the targets written."""
    written = []
    for relative in local_files(local_dir):
        with open(os.path.join(local_dir, relative), "rb") as f:
            data = f.read()
        written.append(join(target, relative))
        write_bytes(written[-1], data)
    return written


def put_files(local_dir: str, fs, inner: str) -> None:
    """Copy the files under local directory ``local_dir`` into directory ``inner`` of
    pyarrow filesystem ``fs``: each in one write (an object appears complete or not at
    all), closed here so that a failed upload raises to the caller (not later, from a
    destructor). No directory markers on an object store. What a failure leaves half
    done is the caller's to remove (``inner`` is not yet anyone's: an unregistered
    checkpoint)."""
    import pyarrow.fs

    if isinstance(fs, pyarrow.fs.LocalFileSystem):
        fs.create_dir(inner, recursive=True)
    for relative in local_files(local_dir):
        with open(os.path.join(local_dir, relative), "rb") as f:
            data = f.read()
        if "/" in relative and isinstance(fs, pyarrow.fs.LocalFileSystem):
            fs.create_dir(f"{inner}/{relative.rsplit('/', 1)[0]}", recursive=True)
        out = fs.open_output_stream(f"{inner}/{relative}")
        try:
            out.write(data)
        finally:
            out.close()


def remove_dir(fs, inner: str) -> str | None:
    """Remove directory ``inner`` of pyarrow filesystem ``fs`` and all under it (nothing
    there is no error); returns why it could not, or None."""
    import pyarrow.fs

    try:
        if fs.get_file_info(inner).type != pyarrow.fs.FileType.NotFound:
            fs.delete_dir(inner)
    except OSError as exc:
        return str(exc)
    return None


def remove_local(path: str) -> None:
    """Remove a local staging directory, quietly (it only held copies)."""
    shutil.rmtree(path, ignore_errors=True)


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
