"""A real MLflow tracking server for the tests: ``mlflow server`` with a SQLite backend
store and a local artifact root, on a free port of 127.0.0.1, started and stopped by the
test (nothing leaves the machine); ready once its ``/health`` answers.

The server comes from the ``mlflow`` package (the ``test`` extra installs it). Where the
test's interpreter has only the client (``mlflow-skinny``), ``RAY_DDP_MLFLOW_SERVER``
names an ``mlflow`` executable of another environment."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import time
import urllib.request

from ports import free_port


def server_command() -> list[str] | None:
    """How to start ``mlflow server`` here; None where no MLflow server is installed."""
    given = os.environ.get("RAY_DDP_MLFLOW_SERVER")
    if given:
        return [given]
    # Asked of the installed packages, not by importing the server (2 s at every
    # collection, the fast tier's included): the full ``mlflow`` distribution, not only
    # ``mlflow-skinny``, and the server's database layer.
    try:
        importlib.metadata.distribution("mlflow")
        server_parts = all(importlib.util.find_spec(m) for m in ("alembic", "sqlalchemy"))
    except importlib.metadata.PackageNotFoundError:
        server_parts = False
    if not server_parts:
        found = shutil.which("mlflow")
        return [found] if found else None
    return [sys.executable, "-m", "mlflow"]


class MlflowServer:
    """One server over ``folder`` (its database and artifacts stay there)."""

    def __init__(self, folder: str, port: int | None = None) -> None:
        self.folder, self.port = folder, port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> MlflowServer:
        command = server_command()
        assert command, "no MLflow server: pip install -e '.[test]'"
        os.makedirs(self.folder, exist_ok=True)
        self.log = open(os.path.join(self.folder, "server.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*command, "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.folder}/mlflow.db",
             "--artifacts-destination", os.path.join(self.folder, "artifacts"),
             "--workers", "1"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            # No job runner: its seven polling processes would take a third of a core
            # from the 2 the tests run on, and tracking needs none of its jobs.
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self.proc.returncode}: "
                                   f"see {self.folder}/server.log")  # fmt: skip
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"mlflow server not ready in {timeout:.0f} s")

    def stop(self) -> None:
        """Stop it and every process it started (uvicorn's workers)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        import signal

        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
