"""Faults during training: a worker killed with SIGKILL, Ctrl-C on the driver, a NaN loss.

The reference is an uninterrupted run. Runs that lose a worker (resumed by --max-failures)
or are stopped and re-run with the same --name must end with bit-identical weights, which
needs the mid-epoch checkpoints (--checkpoint-every) to carry the exact data position (the
step's randomness is seeded per micro-batch, so no RNG state is needed). Faults are timed
by what the Ray Train controller has registered (its checkpoint snapshot file), since a
worker lost within Ray's 2 s poll of a report may restart from the checkpoint before it;
either way the result must be the same.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from ray.train import ControllerError, TrainingFailedError

from ray_ddp.checkpoint import load_state
from ray_ddp.cli import train_main
from ray_ddp.config import TrainConfig
from ray_ddp.loss_guard import NonFiniteLossError
from ray_ddp.retry_policy import RepeatedFailureError
from ray_ddp.trainer import fit, run_training

pytestmark = pytest.mark.ray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 250 micro-batches (optimizer steps) per worker per epoch, a few seconds each epoch.
COMMON = [
    "--epochs", "2", "--train-samples", "16000", "--val-samples", "400", "--batch-size", "32",
    "--seed", "3", "--no-export", "--no-tensorboard", "--model", "small_cnn",
]  # fmt: skip
FAULTY = ["--checkpoint-every", "40"]


class Driver:
    """``jobs/train.py`` in a subprocess attached to the test's Ray, its output collected
    as it comes (rank 0's lines and the rank table, whose pid column names the workers)."""

    def __init__(self, address: str, argv: list[str]):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "jobs", "train.py"), "--address", address, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(re.sub(r"^(\x1b\[\d+m)?\([^)]*\)(\x1b\[0m)? ", "", line.rstrip()))

    def worker_pids(self, tables_seen: int) -> dict[int, int]:
        """rank -> pid from the ``tables_seen``-th rank table (1-based), once printed."""
        tables, current = [], None
        for line in list(self.lines):
            if line.split()[:2] == ["rank", "local"]:
                current = {}
                tables.append(current)
                continue
            parts = line.split()
            if current is not None and len(parts) == 7 and parts[0].isdigit():
                current[int(parts[0])] = int(parts[5])
        return tables[tables_seen - 1] if len(tables) >= tables_seen else {}

    def wait(self, timeout: float = 300) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code


def _until(what: str, check, timeout: float = 120.0, driver: Driver | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    tail = "\n".join(driver.lines[-40:]) if driver else ""
    raise AssertionError(f"timed out waiting for {what}\n{tail}")


def _registered(run_dir: str) -> dict | None:
    """The metrics of the newest checkpoint the controller has registered."""
    try:
        with open(os.path.join(run_dir, "checkpoint_manager_snapshot.json")) as f:
            snapshot = json.load(f)
    except (OSError, ValueError):  # not there yet, or being rewritten
        return None
    latest = snapshot.get("latest_checkpoint_result")
    return latest["metrics"] if latest else None


def _mid_epoch_registered(run_dir: str, epochs_done: int, after_step: int = 0):
    def check():
        m = _registered(run_dir)
        ok = m and m.get("mid_epoch") and m["epoch"] == epochs_done and m["step"] > after_step
        return m if ok else None

    return check


def _final_weights(summary_path: str) -> dict[str, torch.Tensor]:
    with open(summary_path) as f:
        summary = json.load(f)
    assert summary["epochs_completed"] == 2
    print(f"{summary['name']}: fit {summary['wall_s']:.1f} s")  # the cost, with pytest -s
    return load_state(summary["latest_checkpoint"])["model"]


def _last_step_before(lines: list[str], marker: str) -> int:
    """The step of the last "checkpoint: step N" line before the line holding ``marker``."""
    step = 0
    for line in lines:
        if marker in line:
            return step
        if line.startswith("checkpoint: step "):
            step = int(line.split()[2])
    return step


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory):
    """The uninterrupted run: no mid-epoch checkpoints, no faults."""
    storage = str(tmp_path_factory.mktemp("reference"))
    summary = os.path.join(storage, "summary.json")
    argv = [*COMMON, "--storage-path", storage, "--name", "straight", "--summary-json", summary]
    assert train_main(argv) == 0
    return _final_weights(summary)


def test_sigkilled_workers_resume_to_bit_identical_weights(ray_session, reference, tmp_path):
    storage, run_dir = str(tmp_path), str(tmp_path / "killed")
    summary = str(tmp_path / "summary.json")
    driver = Driver(
        ray_session.get_runtime_context().gcs_address,
        [*COMMON, *FAULTY, "--max-failures", "2", "--storage-path", storage, "--name", "killed"]
        + ["--summary-json", summary],
    )
    try:
        # Kill 1: rank 1, in epoch 1, once a mid-epoch checkpoint is registered.
        pids = _until("the rank table", lambda: driver.worker_pids(1))
        first = _until("a checkpoint in epoch 1", _mid_epoch_registered(run_dir, 0))
        os.kill(pids[1], signal.SIGKILL)
        # Kill 2: rank 0 of the restarted group, in epoch 2.
        pids = _until("the restarted workers", lambda: driver.worker_pids(2), 180, driver)
        second = _until("a checkpoint in epoch 2", _mid_epoch_registered(run_dir, 1, first["step"]))
        os.kill(pids[0], signal.SIGKILL)
        _until("the second restart", lambda: driver.worker_pids(3), 180, driver)
        assert driver.wait() == 0, "\n".join(driver.lines[-30:])
    finally:
        if driver.proc.poll() is None:
            driver.proc.kill()
    # Rank 0 alone speaks by default (--log-all-ranks is tested in test_training).
    assert sum(line.startswith("epoch   2/2") for line in driver.lines) == 1
    assert not any("[rank" in line for line in driver.lines)
    resumed = [line for line in driver.lines if line.startswith("resumed from")]
    assert len(resumed) == 2, resumed
    # Both resumed inside an epoch: from the data position, not the epoch's start.
    assert all("samples into epoch" in line for line in resumed), resumed
    assert "into epoch 1" in resumed[0] and "into epoch 2" in resumed[1], resumed
    for line, registered in zip(resumed, (first, second), strict=True):  # what each loss cost
        done = int(re.search(r"(\d+) steps done", line).group(1))
        seen = _last_step_before(driver.lines, line)
        # Resumed from a --checkpoint-every 40 checkpoint no older than the one the
        # controller had registered when the worker was killed, and at most one interval
        # past the last checkpoint line rank 0 printed: the steps trained again are those
        # since that checkpoint, fewer than 40 plus Ray's 2 s report poll.
        assert done % 40 == 0 and registered["step"] <= done <= seen + 40, (done, registered, seen)
        print(f"resumed at step {done}; checkpoint lines had reached step {seen} (+<40)")
    _assert_identical(_final_weights(summary), reference)


def test_ctrl_c_then_the_same_command_resumes_to_identical_weights(
    ray_session, reference, tmp_path
):
    storage, run_dir = str(tmp_path), str(tmp_path / "stopped")
    summary = str(tmp_path / "summary.json")
    argv = [*COMMON, *FAULTY, "--storage-path", storage, "--name", "stopped"]
    argv += ["--summary-json", summary]
    driver = Driver(ray_session.get_runtime_context().gcs_address, argv)
    try:
        _until("a checkpoint in epoch 1", _mid_epoch_registered(run_dir, 0, 40))
        driver.proc.send_signal(signal.SIGINT)
        code = driver.wait(timeout=60)
    finally:
        if driver.proc.poll() is None:
            driver.proc.kill()
    assert code == 130, "\n".join(driver.lines[-20:])
    assert any("interrupted: the workers were stopped" in line for line in driver.lines)
    assert "--name stopped" in driver.lines[-1]
    latest = _registered(run_dir)
    assert latest["mid_epoch"] and latest["epoch"] == 0  # stopped inside epoch 1
    assert not os.path.exists(summary)

    assert train_main(argv) == 0  # the same command again
    _assert_identical(_final_weights(summary), reference)


def test_a_nan_loss_stops_the_run_naming_step_and_rank(ray_session, tmp_path):
    cfg = TrainConfig(
        epochs=1,
        train_samples=4000,
        val_samples=200,
        batch_size=32,
        num_workers=2,
        model="small_cnn",
        checkpoint_every=10,
        max_failures=1,  # a NaN is not a lost worker: retrying would only repeat it
        export=False,
        tensorboard=False,
        storage_path=str(tmp_path),
        name="diverged",
        inject_nan_step=27,
        inject_nan_rank=1,
    )
    started = time.monotonic()
    with pytest.raises(TrainingFailedError) as failure:
        run_training(cfg)
    elapsed = time.monotonic() - started
    assert "non-finite training loss at optimizer step 27 on rank 1" in str(failure.value)
    # Stopped by ray_ddp's rule in the controller, not by running out of --max-failures.
    assert isinstance(failure.value, ControllerError), type(failure.value)
    assert isinstance(failure.value.controller_failure, NonFiniteLossError)
    latest = _registered(str(tmp_path / "diverged"))
    assert latest["step"] == 20 and latest["mid_epoch"]
    state = load_state(_newest_checkpoint(str(tmp_path / "diverged")))
    assert state["progress"]["step"] == 20
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert elapsed < 60, f"no retry of a deterministic fault ({elapsed:.0f} s)"


def _newest_checkpoint(run_dir: str) -> str:
    names = sorted(
        n
        for n in os.listdir(run_dir)
        if n.startswith("checkpoint_") and os.path.isdir(os.path.join(run_dir, n))
    )
    return os.path.join(run_dir, names[-1])


def test_the_same_error_twice_is_not_retried_forever(ray_session, tmp_path):
    """A bug in a task's data code (unlike an unreadable image, which is skipped: see
    test_bad_samples) fails every attempt at the same step: with --max-failures -1 the
    run still ends, after the second identical failure, with the error named (and the
    first attempt's restart shows lost workers still resume)."""
    import broken_tasks
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(broken_tasks)
    cfg = TrainConfig(num_workers=2, batch_size=4, epochs=1, loader_workers=0, max_failures=-1,
                      storage_path=str(tmp_path / "runs"), name="sample-bug", export=False,
                      tensorboard=False)  # fmt: skip
    started = time.monotonic()
    try:
        with pytest.raises(TrainingFailedError) as failure:
            fit(broken_tasks.SampleBug(), cfg)
    finally:
        cloudpickle.unregister_pickle_by_value(broken_tasks)
    message = str(failure.value)
    assert isinstance(failure.value, ControllerError), type(failure.value)
    assert isinstance(failure.value.controller_failure, RepeatedFailureError)
    assert "the same error stopped two attempts" in message
    assert "KeyError: 'label' | ray_ddp: raised at optimizer step" in message
    assert time.monotonic() - started < 120
