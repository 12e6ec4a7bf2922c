"""`ray job submit` against a real local Ray head with token authentication on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from ports import free_port

pytestmark = [pytest.mark.ray, pytest.mark.own_cluster]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


@pytest.fixture(scope="module")
def head(no_shared_ray):
    """A head started with `ray start --head --block` (its processes end with it), with
    token auth; always stopped, whatever the test did."""
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    subprocess.run([RAY, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    port, dashboard = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="rdh", dir="/tmp")
    proc = subprocess.Popen(
        [RAY, "start", "--head", "--block", f"--port={port}", f"--dashboard-port={dashboard}",
         "--dashboard-host=127.0.0.1", "--num-cpus=2", f"--temp-dir={temp_dir}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/version", timeout=2)
                break
            except urllib.error.HTTPError:
                break  # answering (401 without a token): the dashboard is up
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError("the Ray head did not come up") from None
                time.sleep(1)
        yield url
    finally:
        # The head's graceful stop takes ~30 s on 2 cores; its whole process group is
        # killed after a short grace (nothing of it is needed afterwards).
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_unauthenticated_requests_are_refused(head):
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{head}/api/jobs/", timeout=10)
    assert refused.value.code == 401


def test_submitted_training_job_succeeds_and_leaves_its_checkpoint(head, tmp_path):
    """The README's command: `ray job submit --address ... --working-dir . -- python
    jobs/train.py ...`, with the token-auth environment the client needs."""
    storage, summary_path = tmp_path / "runs", tmp_path / "summary.json"
    started = time.perf_counter()
    proc = subprocess.run(
        [RAY, "job", "submit", "--address", head, "--working-dir", ROOT,
         "--runtime-env-json", json.dumps({"excludes": [".venv", ".git", "runs", "*.egg-info"]}),
         "--", sys.executable, "jobs/train.py", "--epochs", "2", "--train-samples", "1000",
         "--val-samples", "101", "--storage-path", str(storage), "--name", "submitted",
         "--summary-json", str(summary_path)],
        env={**os.environ, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True,
        timeout=420, cwd=ROOT,
    )  # fmt: skip
    print(f"submitted job: {time.perf_counter() - started:.0f} s")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "succeeded" in out.lower() and "epoch   2/2" in out
    summary = json.loads(summary_path.read_text())
    assert summary["epochs_completed"] == 2 and summary["world_size"] == 2
    assert os.path.isfile(os.path.join(summary["latest_checkpoint"], "state.pt"))
    assert summary["latest_checkpoint"].startswith(str(storage))


USER_TASK = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from ray_ddp import Sum, Task


class Line(Task):
    """y = 2x + 1 from 64 points: a task that exists only in the user's directory."""

    def datasets(self, cfg, facts):
        x = torch.linspace(-1, 1, 64).unsqueeze(1)
        return TensorDataset(x, 2 * x + 1), TensorDataset(x[::4], 2 * x[::4] + 1)

    def model(self, cfg, facts):
        return nn.Linear(1, 1)

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x).float(), y)

    def metrics(self, model, batch):
        x, y = batch
        return {"loss": Sum(((model(x).float() - y) ** 2).sum(), y.numel())}
'''


def test_a_task_module_of_your_own_travels_with_the_working_dir(head, tmp_path):
    """`ray job submit --working-dir <your project>`: the task module exists only there,
    and both the job's driver (the check before Ray) and the workers import it."""
    project, storage = tmp_path / "project", tmp_path / "runs"
    project.mkdir()
    (project / "line_task.py").write_text(USER_TASK)
    entry = "import sys; from ray_ddp.driver.cli import train_main; sys.exit(train_main())"
    proc = subprocess.run(
        [RAY, "job", "submit", "--address", head, "--working-dir", str(project),
         "--", sys.executable, "-c", entry, "--task", "line_task:Line", "--epochs", "2",
         "--batch-size", "16", "--lr", "0.05", "--storage-path", str(storage),
         "--name", "line", "--no-export"],
        env={**os.environ, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True,
        timeout=420, cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "data: line, 64 train / 16 val samples" in out and "epoch   2/2" in out, out[-3000:]
    assert os.path.isfile(storage / "line" / "metrics.csv")
