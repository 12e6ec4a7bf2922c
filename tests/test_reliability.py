"""Faults during training: workers killed with SIGKILL, Ctrl-C on the driver.

The reference is the session's uninterrupted run (``straight_run``, ``ledgers.EXACT_RUN``).
Runs that lose a worker (resumed by --max-failures) or are stopped and re-run with the same
--name must end with bit-identical weights, which needs the mid-epoch checkpoints
(--checkpoint-every) to carry the exact data position (the step's randomness is seeded per
micro-batch, so no RNG state is needed).

Faults are placed, not raced: the test's harness stops a rank at a chosen optimizer step
(``ray_ddp.testing``; it writes a marker with its pid), the test waits until Ray Train's
controller has registered the checkpoint before that step (its snapshot file), then kills
the process or interrupts the driver. So each resume starts from a known step.
(A non-finite loss, which stops a run at once, is test_world_size_resume's.)
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
from ledgers import EXACT_FLAGS, STEPS_PER_EPOCH, stalls
from ray.train import ControllerError, TrainingFailedError

from ray_ddp.checkpoint.format import load_state
from ray_ddp.config import TrainConfig
from ray_ddp.driver.cli import train_main
from ray_ddp.driver.run import fit
from ray_ddp.reliability.retry_policy import RepeatedFailureError
from ray_ddp.testing.harness import stall_marker

pytestmark = pytest.mark.ray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Driver:
    """``jobs/train.py`` in a subprocess attached to the test's Ray, its output collected
    as it comes (rank 0's lines), with a test's harness (``RAY_DDP_HARNESS``)."""

    def __init__(self, address: str, argv: list[str], env: dict[str, str]):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "jobs", "train.py"), "--address", address, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **env},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(re.sub(r"^(\x1b\[\d+m)?\([^)]*\)(\x1b\[0m)? ", "", line.rstrip()))

    def wait(self, timeout: float = 300) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code


def _until(what: str, check, timeout: float = 180.0, driver: Driver | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if driver is not None and driver.proc.poll() is not None:
            break
        time.sleep(0.1)
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


def _stalled(run_dir: str, step: int, rank: int, checkpoint: int):
    """The pid of rank ``rank`` stopped at ``step``, once the controller has registered the
    checkpoint of step ``checkpoint`` (the one a restart resumes from)."""

    def check() -> int | None:
        try:
            with open(stall_marker(run_dir, step, rank)) as file:
                pid = int(file.read().split()[1])
        except (OSError, IndexError, ValueError):
            return None
        registered = _registered(run_dir)
        return pid if registered and registered["step"] == checkpoint else None

    return check


def _final_weights(summary_path: str) -> dict[str, torch.Tensor]:
    with open(summary_path) as f:
        summary = json.load(f)
    assert summary["epochs_completed"] == 2
    print(f"{summary['name']}: fit {summary['wall_s']:.1f} s")  # the cost, with pytest -s
    return load_state(summary["latest_checkpoint"])["model"]


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def _straight_weights(straight_run) -> dict[str, torch.Tensor]:
    return load_state(straight_run["latest_checkpoint"])["model"]


# Kill 1: rank 1 at step 13 of epoch 1 (checkpoint 10); kill 2: rank 0 of the restarted
# group at step 53, inside epoch 2 (checkpoint 50, 10 steps into the epoch); then Ctrl-C
# while rank 0 of the third group is at step 63 (checkpoint 60).
KILLS = ((13, 1, 10), (53, 0, 50))
CTRL_C = (63, 0, 60)


def test_sigkilled_workers_then_ctrl_c_and_the_same_command_end_with_identical_weights(
    ray_session, straight_run, tmp_path, capsys
):
    """One run of jobs/train.py meets both faults a user sees: workers killed with SIGKILL
    (--max-failures restarts them, twice, each time from the data position of the
    checkpoint before the kill), then Ctrl-C on the driver (exit 130, the workers stopped,
    the command to continue named); the same command again finishes the run. The weights
    are bit-identical to the uninterrupted run's."""
    storage, run_dir = str(tmp_path), str(tmp_path / "faults")
    summary = str(tmp_path / "summary.json")
    argv = [*EXACT_FLAGS, "--max-failures", "2", "--storage-path", storage, "--name", "faults",
            "--summary-json", summary]  # fmt: skip
    harness = stalls(*((step, rank) for step, rank, _ in (*KILLS, CTRL_C)), ledger=False)
    driver = Driver(ray_session.get_runtime_context().gcs_address, argv, harness.to_env())
    try:
        for step, rank, checkpoint in KILLS:
            pid = _until(
                f"rank {rank} stopped at step {step}",
                _stalled(run_dir, step, rank, checkpoint), driver=driver,
            )  # fmt: skip
            os.kill(pid, signal.SIGKILL)
        step, rank, checkpoint = CTRL_C
        _until(f"rank {rank} stopped at step {step}", _stalled(run_dir, step, rank, checkpoint),
               driver=driver)  # fmt: skip
        driver.proc.send_signal(signal.SIGINT)
        code = driver.wait(timeout=60)
    finally:
        if driver.proc.poll() is None:
            driver.proc.kill()
    assert code == 130, "\n".join(driver.lines[-20:])
    # Rank 0 alone speaks by default (--log-all-ranks is tested in test_training).
    assert sum(line.startswith("epoch   1/2") for line in driver.lines) == 1
    assert not any("[rank" in line for line in driver.lines)
    resumed = [line for line in driver.lines if line.startswith("resumed from")]
    # Both inside an epoch, from the data position of the checkpoint before the kill.
    assert len(resumed) == 2, resumed
    assert "10 steps done, 640 samples into epoch 1" in resumed[0], resumed
    into = (50 - STEPS_PER_EPOCH) * 64
    assert f"50 steps done, {into} samples into epoch 2" in resumed[1], resumed
    assert any("interrupted: the workers were stopped" in line for line in driver.lines)
    assert "--name faults" in driver.lines[-1]
    latest = _registered(run_dir)
    assert latest["mid_epoch"] and latest["epoch"] == 1 and latest["step"] == 60
    assert not os.path.exists(summary)

    capsys.readouterr()
    assert train_main(argv) == 0  # the same command again (no harness: nothing stops it)
    out = capsys.readouterr().out
    into = (60 - STEPS_PER_EPOCH) * 64
    assert f"60 steps done, {into} samples into epoch 2" in out
    _assert_identical(_final_weights(summary), _straight_weights(straight_run))


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
