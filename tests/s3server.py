"""The S3-compatible server the tests use: moto's standalone server on a free port of
127.0.0.1, one bucket, dummy credentials (nothing leaves the machine). One per test
session (``conftest.s3``): the shared Ray is started after the environment points at it,
so its workers read and write the same buckets as the tests.

:data:`FAULTS` makes it a storage that fails for a while, as a throttled S3 does: the next
PUTs of matching keys are answered 503 SlowDown (the test sets it in its own process; the
server runs in a thread of it)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

BUCKET = "bucket"


class Faults:
    """Failures for the server to answer with: PUT requests (objects and multipart parts)
    whose path contains a rule's ``match`` are refused with 503 SlowDown, the error a
    throttled S3 gives (and that AWS clients and Ray retry): the next ``times`` of them,
    all of them for ``seconds`` from the first one refused, or all of them until the test
    clears the rules (a store that fails for a while, however often its clients retry)."""

    SLOW_DOWN = (
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
        b"<Message>Please reduce your request rate.</Message></Error>"
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rules: list[dict[str, Any]] = []
        self.refused: list[str] = []
        """Every path refused, in order."""

    def fail_puts(self, match: str, times: int | None = None, seconds: float | None = None):
        assert times is None or seconds is None, "a count, a time or until cleared"
        with self.lock:
            self.rules.append({"match": match, "times": times, "seconds": seconds, "until": None})

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()
            self.refused.clear()

    def _refuse(self, environ: dict[str, Any]) -> bool:
        if environ.get("REQUEST_METHOD") != "PUT":
            return False
        path, now = environ.get("PATH_INFO", ""), time.monotonic()
        with self.lock:
            for rule in self.rules:
                if rule["match"] not in path:
                    continue
                if rule["times"] is not None:
                    if rule["times"] == 0:
                        continue
                    rule["times"] -= 1
                elif rule["seconds"] is not None:
                    if rule["until"] is None:  # the window opens at the first refusal
                        rule["until"] = now + rule["seconds"]
                    if now >= rule["until"]:
                        continue
                self.refused.append(path)
                return True
        return False

    def wrap(self, app: Callable) -> Callable:
        def serve(environ: dict[str, Any], start_response: Callable) -> Any:
            if not self._refuse(environ):
                return app(environ, start_response)
            environ["wsgi.input"].read()  # the body, so the connection stays usable
            length = str(len(self.SLOW_DOWN))
            headers = [("Content-Type", "application/xml"), ("Content-Length", length)]
            start_response("503 Slow Down", headers)
            return [self.SLOW_DOWN]

        return serve


FAULTS = Faults()
"""The session server's failures (none until a test asks; it clears them when it ends)."""


@contextlib.contextmanager
def serving() -> Iterator[str]:
    """The server, running, with the environment set as for any S3-compatible endpoint
    (``AWS_ENDPOINT_URL``, credentials, region) and the bucket made; yields its
    ``host:port``. Everything is restored when it ends."""
    import pytest
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    from ray_ddp.io import storage

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    app = FAULTS.wrap(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"127.0.0.1:{server.server_address[1]}"
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
        server.shutdown()
        thread.join()
