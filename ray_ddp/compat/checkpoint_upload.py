"""Ray Train's asynchronous checkpoint upload (Ray 2.60's ``CheckpointUploadMode.ASYNC``),
used so that the training thread only takes a snapshot: the file is written and uploaded
in Ray's upload thread, and Ray registers the checkpoint once the upload is complete.

``ray.train.report`` and its ``checkpoint_upload_fn`` are public; the upload itself is the
storage context's ``persist_current_checkpoint`` (a DeveloperAPI whose interface may change
between minor releases): the same copy Ray makes for a synchronous report, to the same
place, so the checkpoint is Ray's own, kept and pruned like any other."""

from __future__ import annotations

import functools
import inspect
import tempfile
from collections.abc import Callable
from typing import Any

import ray.train


@functools.cache
def async_upload_supported() -> bool:
    """This Ray's ``report`` takes an upload mode and an upload function."""
    params = inspect.signature(ray.train.report).parameters
    return {"checkpoint_upload_mode", "checkpoint_upload_fn"} <= set(params) and hasattr(
        ray.train, "CheckpointUploadMode"
    )


def report_async(
    metrics: dict[str, Any], write: Callable[[str], None], done: Callable[[], None]
) -> None:
    """``ray.train.report(metrics)`` with a checkpoint that ``write(directory)`` fills, in
    Ray's upload thread: written to a local temporary directory, copied to the run's
    storage by Ray, then registered (in report order). ``done()`` is called once the copy
    is complete or failed; a failure reaches the training thread, and the run restarts
    from the checkpoint before (this one was never registered)."""

    def upload(checkpoint: ray.train.Checkpoint, dir_name: str) -> ray.train.Checkpoint:
        try:
            write(checkpoint.path)
            storage = ray.train.get_context().get_storage()
            return storage.persist_current_checkpoint(checkpoint, dir_name)
        finally:
            done()

    local = tempfile.mkdtemp(prefix="ray_ddp_ckpt_")  # removed by Ray once uploaded
    ray.train.report(
        metrics,
        checkpoint=ray.train.Checkpoint.from_directory(local),
        checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
        checkpoint_upload_fn=upload,
        delete_local_checkpoint_after_upload=True,
    )
