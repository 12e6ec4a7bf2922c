"""A slow network in front of a real server, for the tests: an HTTP proxy on a free port
of 127.0.0.1 that forwards every request to the server at once and holds chosen
responses back. The server has done the work (a run made, a batch logged); the client
waits for the answer, or gives up on it. Nothing leaves the machine.

``hold("/runs/create", seconds=4)``: the next answer to a request whose path ends so
comes 4 s late (``until=event``: once the event is set). ``seen("/runs/create")``: how
many such requests reached the server."""

from __future__ import annotations

import http.client
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ports import free_port


class _Hold:
    def __init__(self, path: str, seconds: float, until: threading.Event | None) -> None:
        self.path, self.seconds, self.until = path, seconds, until


class SlowProxy:
    """A proxy to ``upstream`` (``http://host:port``); ``uri`` is where clients go."""

    def __init__(self, upstream: str) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self.host, self.port_up = parsed.hostname, parsed.port
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.holds: list[_Hold] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> SlowProxy:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def hold(self, path: str, seconds: float = 0.0, until: threading.Event | None = None):
        """The next answer to a request whose path ends with ``path``: ``seconds`` late,
        or (``until``) once the event is set (60 s at most)."""
        with self.lock:
            self.holds.append(_Hold(path, seconds, until))

    def seen(self, path: str) -> int:
        with self.lock:
            return sum(p.endswith(path) for p in self.paths)

    def _held(self, path: str) -> _Hold | None:
        with self.lock:
            self.paths.append(path)
            for hold in self.holds:
                if path.endswith(hold.path):
                    self.holds.remove(hold)
                    return hold
        return None

    def _forward(self, method: str, path: str, body: bytes | None, headers: dict[str, str]):
        upstream = http.client.HTTPConnection(self.host, self.port_up, timeout=60)
        try:
            upstream.request(method, path, body=body, headers=headers)
            answer = upstream.getresponse()
            return answer.status, answer.getheaders(), answer.read()
        finally:
            upstream.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                path = urllib.parse.urlsplit(self.path).path
                status, answer_headers, data = proxy._forward(self.command, self.path, body,
                                                              headers)  # fmt: skip
                hold = proxy._held(path)  # after the server did the work
                if hold is not None:
                    if hold.until is not None:
                        hold.until.wait(60)
                    time.sleep(hold.seconds)
                try:
                    self.send_response(status)
                    for key, value in answer_headers:
                        if key.lower() not in ("transfer-encoding", "connection",
                                               "content-length", "date", "server"):  # fmt: skip
                            self.send_header(key, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up waiting: the server's work stands

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _any

            def log_message(self, *args: object) -> None:
                pass

        return Handler
