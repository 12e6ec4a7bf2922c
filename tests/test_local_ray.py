"""A local Ray that ray_ddp starts for a run (``cluster.connect``) stops with everything
it started (``cluster.shutdown``, also at the program's exit), even a worker process that
hangs in its own exit after Ray has let it go, which Ray's own shutdown leaves running
(seen in Ray's C++ teardown after about 1 in 40 worker groups; here an actor whose exit
sleeps makes it happen)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
from waits import gone

pytestmark = [pytest.mark.ray, pytest.mark.own_cluster]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import atexit, json, os, sys, time
sys.path.insert(0, {root!r})
import ray
from ray_ddp.cluster.connect import _process, connect

@ray.remote(num_cpus=0)
class HangsInItsExit:
    def __init__(self):
        atexit.register(time.sleep, 600)

    def pid(self):
        return os.getpid()

connect(None)
actor = HangsInItsExit.remote()
pid = ray.get(actor.pid.remote())
del actor  # Ray lets it go: its process starts its exit, and hangs there
time.sleep(3)
print(json.dumps({{"pid": pid, "hung": _process(pid) != ()}}))
# and this program ends without stopping Ray, as one calling ray_ddp.fit may
"""


def _run() -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(root=ROOT)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_worker_hung_in_its_exit_goes_with_the_ray_started_for_the_run(no_shared_ray):
    """The program exits without a word about Ray: ``connect``'s exit hook stops it through
    ``shutdown``. (With Ray's own exit hook alone the hung process is still there: checked
    when this was written, Ray 2.60.)"""
    found = _run()
    try:
        assert found["hung"], "the actor's process did not hang: nothing was tested"
        assert gone(found["pid"]), f"pid {found['pid']} outlived the Ray of the run"
    finally:
        with contextlib.suppress(OSError):
            os.kill(found["pid"], signal.SIGKILL)
