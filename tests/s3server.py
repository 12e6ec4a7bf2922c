"""The S3-compatible server the tests use: moto's standalone server on a free port of
127.0.0.1, one bucket, dummy credentials (nothing leaves the machine). One per test
session (``conftest.s3``): the shared Ray is started after the environment points at it,
so its workers read and write the same buckets as the tests."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

BUCKET = "bucket"


@contextlib.contextmanager
def serving() -> Iterator[str]:
    """The server, running, with the environment set as for any S3-compatible endpoint
    (``AWS_ENDPOINT_URL``, credentials, region) and the bucket made; yields its
    ``host:port``. Everything is restored when it ends."""
    import pytest
    from moto.server import ThreadedMotoServer

    from ray_ddp.io import storage

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"{host}:{port}"
    try:
        with pytest.MonkeyPatch.context() as env:
            for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE"):
                env.delenv(key, raising=False)
            env.setenv("AWS_ACCESS_KEY_ID", "testing")
            env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            env.setenv("AWS_DEFAULT_REGION", "us-east-1")
            env.setenv("AWS_REGION", "us-east-1")
            env.setenv("AWS_EC2_METADATA_DISABLED", "true")
            env.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
            env.setenv("AWS_ENDPOINT_URL", f"http://{endpoint}")
            fs, _ = storage.filesystem(f"s3://{BUCKET}?allow_bucket_creation=true")
            fs.create_dir(BUCKET)
            yield endpoint
    finally:
        server.stop()
