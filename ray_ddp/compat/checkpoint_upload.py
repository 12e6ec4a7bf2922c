"""A checkpoint's upload to the run's storage, ours rather than Ray's copy, for rank 0's
reports (``--checkpoint-mode sync`` and ``async``; a sharded checkpoint's ranks keep Ray's):
tried again on a storage error, and on the last failure removed from storage before the
error is raised, so that a failed upload leaves nothing behind.

``ray.train.report`` and its ``checkpoint_upload_fn`` are public (Ray 2.60); where the
files go is the storage context's (``get_storage()``, a DeveloperAPI): the directory Ray
would copy to, on Ray's filesystem, so the checkpoint is Ray's own, kept and pruned like
any other. Asynchronous (Ray 2.60's ``CheckpointUploadMode.ASYNC``): the training thread
only takes a snapshot, and the file is written and uploaded in Ray's upload thread; Ray
registers the checkpoint once the upload is complete.

Retries: Ray calls an upload function again when its error names a retryable AWS error
(``SLOW_DOWN``, ``SERVICE_UNAVAILABLE``...: three tries, 1 and 2 s apart). Ours owns them
instead (the AWS SDK in pyarrow has already retried each request for about 6 s before an
error reaches it): it knows when a failure is final, which is when the snapshot's memory
may be handed back and the partial checkpoint removed. Its final error is worded so that
Ray does not try once more."""

from __future__ import annotations

import functools
import inspect
import tempfile
import time
from collections.abc import Callable
from typing import Any

import ray.train

from ray_ddp.io.storage import put_files, remove_dir

UPLOAD_TRIES = 4
"""How many times one checkpoint's upload is tried (a throttled object store clears in
seconds; each try is itself the AWS SDK's retries of each request)."""
RETRY_S = 2.0
"""The wait before the second try; doubled before each later one (2, 4, 8 s)."""


class CheckpointUploadError(RuntimeError):
    """A checkpoint's upload failed at every try (and nothing of it is left in storage)."""


@functools.cache
def async_upload_supported() -> bool:
    """This Ray's ``report`` takes an upload mode and an upload function."""
    params = inspect.signature(ray.train.report).parameters
    return {"checkpoint_upload_mode", "checkpoint_upload_fn"} <= set(params) and hasattr(
        ray.train, "CheckpointUploadMode"
    )


def upload(local: str, dir_name: str, log: Callable[[str], None]) -> ray.train.Checkpoint:
    """Copy the checkpoint files in local directory ``local`` into the run's checkpoint
    directory ``dir_name`` on Ray's storage filesystem (:func:`put_checkpoint`)."""
    storage = ray.train.get_context().get_storage()
    fs = storage.storage_filesystem
    target = storage.build_checkpoint_path_from_name(dir_name)
    put_checkpoint(local, fs, target, log)
    return ray.train.Checkpoint(target, filesystem=fs)


def put_checkpoint(
    local: str,
    fs: Any,
    target: str,
    log: Callable[[str], None],
    tries: int = UPLOAD_TRIES,
    retry_s: float = RETRY_S,
) -> None:
    """Copy the files in local directory ``local`` into directory ``target`` of pyarrow
    filesystem ``fs`` (``io.storage.put_files``: each file complete or not at all),
    ``tries`` times at most on a storage error (``OSError``), ``retry_s`` before the second
    and twice as long before each later one, saying each retry; after the last, remove
    whatever reached storage and raise ``CheckpointUploadError``."""
    name = target.rstrip("/").rsplit("/", 1)[-1]
    for attempt in range(1, tries + 1):
        try:
            put_files(local, fs, target)
            return
        except OSError as exc:
            # Ray retries an error whose text names a retryable AWS error: this one, ours
            # to retry, must not (its original words are kept, less that prefix).
            error = str(exc).replace("AWS Error ", "")
        if attempt < tries:
            wait_s = retry_s * 2 ** (attempt - 1)
            log(f"checkpoint {name}: the upload failed ({error}); try {attempt + 1} of "
                f"{tries} in {wait_s:.0f} s")  # fmt: skip
            time.sleep(wait_s)
    left = remove_dir(fs, target)
    after = f"its partial files could not be removed: {left}" if left else "nothing of it is left"
    raise CheckpointUploadError(
        f"checkpoint {name} could not be uploaded in {tries} tries ({error}); {after}"
    )


def report_sync(metrics: dict[str, Any], local: str, log: Callable[[str], None]) -> None:
    """``ray.train.report(metrics)`` with the checkpoint in local directory ``local``,
    uploaded by :func:`upload` before it returns (Ray's own copy where this Ray takes no
    upload function)."""
    checkpoint = ray.train.Checkpoint.from_directory(local)
    if not async_upload_supported():
        ray.train.report(metrics, checkpoint=checkpoint)
        return
    ray.train.report(
        metrics,
        checkpoint=checkpoint,
        checkpoint_upload_mode=ray.train.CheckpointUploadMode.SYNC,
        checkpoint_upload_fn=lambda ckpt, dir_name: upload(ckpt.path, dir_name, log),
    )


def report_async(
    metrics: dict[str, Any],
    write: Callable[[str], None],
    done: Callable[[], None],
    log: Callable[[str], None],
) -> None:
    """``ray.train.report(metrics)`` with a checkpoint that ``write(directory)`` fills, in
    Ray's upload thread: written to a local temporary directory once, uploaded by
    :func:`upload`, then registered (in report order). ``done()`` is called once the
    upload has finally succeeded or finally failed (the snapshot ``write`` reads is its
    own until then); a failure reaches the training thread, and the run restarts from the
    checkpoint before (this one was never registered)."""
    written: list[bool] = []

    def upload_once(checkpoint: ray.train.Checkpoint, dir_name: str) -> ray.train.Checkpoint:
        try:
            if not written:  # were Ray to call again, the file holds the snapshot still
                write(checkpoint.path)
                written.append(True)
            return upload(checkpoint.path, dir_name, log)
        finally:
            done()

    local = tempfile.mkdtemp(prefix="ray_ddp_ckpt_")  # removed by Ray once uploaded
    ray.train.report(
        metrics,
        checkpoint=ray.train.Checkpoint.from_directory(local),
        checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
        checkpoint_upload_fn=upload_once,
        delete_local_checkpoint_after_upload=True,
    )
