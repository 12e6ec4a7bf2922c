"""``--checkpoint-mode async``: training takes a snapshot in host memory and goes on while
Ray's upload thread writes and uploads it; Ray registers it once it is complete.

No Ray for the first tests (the snapshot's copies, reused memory; the upload against an S3
server that refuses writes for a while, ``s3server.FAULTS``). The last runs the
exactness run (``ledgers.EXACT_RUN``) with asynchronous checkpoints on the session's S3
server, holds the upload of the checkpoint at step 20 (the harness), and while it is held:
the checkpoint of step 10 is still the registered one and nothing of step 20's is in the
bucket; then a worker is SIGKILLed, the restart resumes from step 10, and the run ends with
the weights of the uninterrupted run, bit for bit. Step 10's upload had been refused by the
server for a while (503 SlowDown) and tried again, while the snapshot of step 20 was
taken: the checkpoint resumed from holds step 10's weights."""

from __future__ import annotations

import json
import os
import signal

import pytest
import s3server
import torch
from ledgers import EXACT_FLAGS
from test_reliability import Driver, _assert_identical, _straight_weights, _until
from test_s3_storage import _keys

from ray_ddp.checkpoint.format import Snapshots, load_checkpoint_state
from ray_ddp.compat.checkpoint_upload import CheckpointUploadError, put_checkpoint
from ray_ddp.io import storage
from ray_ddp.testing.harness import Harness, Stall, upload_marker


def test_a_snapshot_is_a_copy_training_cannot_change_in_memory_it_reuses():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}
    snapshots = Snapshots()
    first = snapshots.take(saved)
    held = [b.data_ptr() for b in snapshots.buffers]
    before = {k: v.clone() for k, v in first["model"].items()}
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on
    optimizer.step()
    assert all(torch.equal(first["model"][k], before[k]) for k in before)
    assert (
        first["optimizer"]["state"][0]["exp_avg"] is not saved["optimizer"]["state"][0]["exp_avg"]
    )
    assert snapshots.nbytes == sum(t.numel() * t.element_size() for t in snapshots.buffers) > 0
    second = snapshots.take({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "step": 2})  # fmt: skip
    assert [b.data_ptr() for b in snapshots.buffers] == held  # the same host memory
    assert torch.equal(second["model"]["weight"], model.weight.detach())


def _impatient_s3():
    """The session's S3 server through a client that does not retry a request itself (the
    AWS SDK's default tries each for about 6 s): every refusal reaches the upload's code."""
    import pyarrow.fs

    endpoint = os.environ["AWS_ENDPOINT_URL"].removeprefix("http://")
    return pyarrow.fs.S3FileSystem(
        endpoint_override=endpoint, scheme="http", region="us-east-1",
        retry_strategy=pyarrow.fs.AwsStandardS3RetryStrategy(max_attempts=1),
    )  # fmt: skip


def test_an_upload_refused_for_a_while_is_tried_again_and_one_refused_to_the_end_leaves_nothing(
    s3, tmp_path, capfd
):
    local = tmp_path / "checkpoint"
    local.mkdir()
    (local / "extra.bin").write_bytes(b"e" * 100)  # uploaded before state.pt (sorted)
    (local / "state.pt").write_bytes(os.urandom(3000))
    fs, prefix = _impatient_s3(), f"{s3server.BUCKET}/upload-{os.getpid()}"
    said: list[str] = []
    try:
        s3server.FAULTS.fail_puts("checkpoint_a/state.pt", 2)
        put_checkpoint(str(local), fs, f"{prefix}/checkpoint_a", said.append, 3, 0.05)
        assert len(s3server.FAULTS.refused) == 2
        assert [line.split(" (")[0] for line in said] == [
            "checkpoint checkpoint_a: the upload failed"
        ] * 2
        assert "SLOW_DOWN" in said[0] and said[1].endswith("try 3 of 3 in 0 s")
        uri = f"s3://{prefix}/checkpoint_a"
        assert storage.read_bytes(f"{uri}/state.pt") == (local / "state.pt").read_bytes()

        s3server.FAULTS.fail_puts("checkpoint_b/state.pt", 10**6)  # to the end
        with pytest.raises(CheckpointUploadError) as failed:
            put_checkpoint(str(local), fs, f"{prefix}/checkpoint_b", said.append, 2, 0.05)
        message = str(failed.value)
        assert message.startswith("checkpoint checkpoint_b could not be uploaded in 2 tries (")
        assert message.endswith("; nothing of it is left") and "SLOW_DOWN" in message
        # Ray tries an upload function again when its error names a retryable AWS error.
        assert "AWS Error" not in message
        assert _keys(f"s3://{prefix}/checkpoint_b") == []  # extra.bin was written, then removed
    finally:
        s3server.FAULTS.clear()
    assert "Error ignored" not in capfd.readouterr().err  # no error swallowed by a destructor


@pytest.mark.ray
def test_an_upload_in_flight_is_never_registered_and_a_kill_resumes_bit_identical(
    ray_session, straight_run, tmp_path
):
    storage_path = f"s3://{s3server.BUCKET}/async-{os.getpid()}"
    run_dir = storage.join(storage_path, "held")
    summary = str(tmp_path / "summary.json")
    harness = Harness(stalls=(Stall(23, rank=1),), hold_upload_step=20)
    driver = Driver(
        ray_session.get_runtime_context().gcs_address,
        [*EXACT_FLAGS, "--checkpoint-mode", "async", "--max-failures", "2",
         "--storage-path", storage_path, "--name", "held", "--summary-json", summary],
        harness.to_env(),
    )  # fmt: skip
    stall = storage.join(run_dir, "stalled-step-23-rank-1")
    # Step 10's upload is refused until it is said to be tried again: the AWS SDK's own
    # retries give up first (pyarrow's copy_files, Ray's copy, then swallowed the error in a
    # destructor), and training goes on to step 20, whose snapshot must not take the memory
    # step 10's is still written from.
    s3server.FAULTS.fail_puts(f"/async-{os.getpid()}/held/checkpoint_")
    try:
        _until("step 10's upload tried again", lambda: _retried(driver.lines), driver=driver)
        s3server.FAULTS.clear()  # the store is back
        snapshot_file = storage.join(run_dir, "checkpoint_manager_snapshot.json")
        text = _until("the held upload, rank 1 at step 23 and the controller's snapshot",
               lambda: storage.exists(upload_marker(run_dir, 20)) and storage.exists(stall)
               and storage.read_text(snapshot_file), driver=driver)  # fmt: skip
        # Held: step 10's is the registered checkpoint, step 20's has nothing in the bucket.
        snapshot = json.loads(text)  # as read once all three were there
        assert snapshot["latest_checkpoint_result"]["metrics"]["step"] == 10
        files = [k for k in _keys(run_dir) if k.startswith("checkpoint_") and "/" in k]
        assert len({k.split("/")[0] for k in files}) == 1, files  # step 10's alone
        pid = int(storage.read_text(stall).split()[1])
        os.kill(pid, signal.SIGKILL)
        assert driver.wait() == 0, "\n".join(driver.lines[-30:])
    finally:
        s3server.FAULTS.clear()
        if driver.proc.poll() is None:
            driver.proc.kill()
    assert any("checkpoints are asynchronous: each takes a" in ln for ln in driver.lines)
    resumed = [line for line in driver.lines if line.startswith("resumed from")]
    assert len(resumed) == 1 and "10 steps done, 640 samples into epoch 1" in resumed[0], resumed
    with open(summary) as f:
        result = json.load(f)
    assert result["epochs_completed"] == 2
    weights = load_checkpoint_state(result["latest_checkpoint"])["model"]
    _assert_identical(weights, _straight_weights(straight_run))
    (retried,) = _retried(driver.lines)
    assert "SLOW_DOWN" in retried and "try 2 of 4 in 2 s" in retried, retried
    assert not any("Error ignored" in ln for ln in driver.lines)  # none swallowed


def _retried(lines: list[str]) -> list[str]:
    """The lines that say an upload failed and is tried again."""
    return [line for line in lines if ": the upload failed (" in line]
