"""A user changes something between two calls of the same run (issue 27): a position
inside an epoch is continued only on the order it was counted in.

The first tests need no Ray (the rule, on real Parquet layouts); the last trains for real
on 2 Ray workers: a streamed split re-run inside an epoch with another batch, or after it
grew, is refused in one line, not retried, and ``--restart-epoch`` starts the epoch over
on the new split."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from formats import class_image, png_bytes

from ray_ddp.data.order.continuation import order_change, order_record, split_fingerprint
from ray_ddp.data.order.global_order import EpochPlan
from ray_ddp.data.parquet_stream import SplitLayout
from ray_ddp.driver.cli import train_main
from ray_ddp.reliability.attempts import last_attempt


def _write(folder: str, part: int, rows: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed + part)
    labels = [int(x) for x in rng.integers(0, 3, size=rows)]
    images = [png_bytes(class_image(y, 16, rng)) for y in labels]
    os.makedirs(folder, exist_ok=True)
    table = pa.table({"image": pa.array(images, pa.binary()), "label": labels})
    pq.write_table(table, os.path.join(folder, f"part-{part}.parquet"), row_group_size=4)


class _Split:
    def __init__(self, folder: str) -> None:
        self.layout = SplitLayout(folder, ["image", "label"])


def _record(size, files="f", seed=0, streamed=False, batch=4, global_batch=8, buffer=0):
    pieces = (size,) if streamed else None
    plan = EpochPlan(size, batch, global_batch, seed, 0, pieces=pieces, buffer=buffer)
    return order_record(plan, files)


def test_a_position_continues_only_on_the_order_it_was_counted_in():
    saved = _record(100)
    assert order_change(saved, _record(100)) is None
    assert order_change(saved, _record(110)) == (
        "the training split has 110 samples, the checkpoint's had 100"
    )
    assert "other files" in order_change(saved, _record(100, files="g"))
    assert order_change(saved, _record(100, files=None)) is None  # a task's own dataset
    assert order_change(saved, _record(100, seed=1)) == "--seed 1, the checkpoint's was 0"
    # The in-memory permutation does not depend on how it is cut; a streamed order does.
    assert order_change(saved, _record(100, batch=2, global_batch=16)) is None
    streamed = _record(100, streamed=True, buffer=32)
    assert "--parquet-read" in order_change(saved, streamed)
    assert order_change(streamed, _record(100, streamed=True, buffer=32)) is None
    for other in (dict(batch=2), dict(global_batch=16), dict(buffer=64)):
        change = order_change(streamed, _record(100, streamed=True, **{"buffer": 32, **other}))
        assert change.startswith("a streamed order is cut by the per-worker batch"), other


def test_a_splits_fingerprint_follows_its_files_and_row_groups(tmp_path):
    folder = str(tmp_path / "train")
    _write(folder, 0, 8)
    first = split_fingerprint(_Split(folder))
    assert first is not None and first == split_fingerprint(_Split(folder))
    _write(folder, 1, 8)  # a shard added
    grown = split_fingerprint(_Split(folder))
    _write(folder, 1, 8, seed=5)  # rewritten alike: the same files, groups and rows
    assert split_fingerprint(_Split(folder)) == grown != first
    assert split_fingerprint([1, 2, 3]) is None


@pytest.mark.ray
def test_a_mid_epoch_position_on_changed_data_or_cut_is_refused_then_restarted(
    ray_session, storage, tmp_path, capsys, tracking_server
):
    """A streamed split stopped 8 samples into epoch 1, then re-run: with another per-worker
    batch (the streamed order is cut by it), and with a shard added (16 -> 20 rows), each
    refused in one line and not retried; then --restart-epoch trains the new split once.
    Tracked in MLflow throughout (issue 44): the restarted epoch's steps are logged again,
    the first of them at a step the stopped run had logged."""
    root = str(tmp_path / "data")
    _write(os.path.join(root, "train"), 0, 16)
    _write(os.path.join(root, "val"), 0, 8, seed=9)
    argv = [
        "--dataset", "parquet", "--parquet-read", "stream", "--data-dir", root,
        "--image-size", "16", "--batch-size", "4", "--epochs", "1", "--num-workers", "2",
        "--max-failures", "2", "--storage-path", storage, "--name", "grew", "--no-export",
        "--no-tensorboard", "--tracking", "mlflow", "--tracking-uri", tracking_server.uri,
        "--experiment", "restarted", "--log-every-steps", "1",
    ]  # fmt: skip
    assert train_main([*argv, "--max-steps", "1"]) == 0  # stopped 8 samples into epoch 1
    stopped = "stopped 8 samples into epoch 1, a position in an order that no longer names the "

    def refused(more: list[str]) -> str:
        capsys.readouterr()
        assert train_main([*argv, *more]) == 1
        failed = [ln for ln in capsys.readouterr().err.splitlines() if "training failed" in ln]
        assert len(failed) == 1 and stopped in failed[0] and "--restart-epoch" in failed[0]
        return failed[0]

    line = refused(["--allow-config-change", "--batch-size", "2"])
    assert "same samples: a streamed order is cut by the per-worker batch, the global " in line
    _write(os.path.join(root, "train"), 1, 4)  # a new shard: 16 -> 20 rows
    # The refused run recorded --batch-size 2 as the run's config: back to 4 needs the flag.
    line = refused(["--allow-config-change"])
    assert "same samples: the training split has 20 samples, the checkpoint's had 16" in line
    # Not retried: the stopped run was attempt 1, the refused re-runs 2 and 3, and no more.
    assert last_attempt(os.path.join(storage, "grew"))["attempt"] == "3"

    summary_json = ["--summary-json", str(tmp_path / "s.json")]
    assert train_main([*argv, "--allow-config-change", "--restart-epoch", *summary_json]) == 0
    out = capsys.readouterr().out
    assert "epoch 1 restarts from its first sample (--restart-epoch: the training split" in out
    with open(tmp_path / "s.json") as f:
        summary = json.load(f)
    (epoch,) = summary["history"]
    assert epoch["train_samples"] == 20 and summary["steps"] == 3  # the whole new split, once
    _assert_restarted_steps_tracked(tracking_server.uri, summary)


def _assert_restarted_steps_tracked(uri: str, summary: dict) -> None:
    """MLflow keeps each step's history: the stopped run's step 1, then the restarted
    epoch's steps 1-3, trained again on the new split (the high-water mark of the stopped
    run's step 1 must not hide the new step 1), and the epoch's loss as the run has it."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run_id = summary["tracking"]["run_id"]
    history = sorted(client.get_metric_history(run_id, "train_loss"), key=lambda m: m.timestamp)
    assert [m.step for m in history] == [1, 1, 2, 3], [(m.step, m.timestamp) for m in history]
    # The stopped run's figures of its part of the epoch, at step 1; the restarted epoch's.
    epochs = sorted(client.get_metric_history(run_id, "epoch_train_loss"),
                    key=lambda m: m.timestamp)  # fmt: skip
    assert [m.step for m in epochs] == [1, 3]
    assert epochs[-1].value == pytest.approx(summary["history"][0]["train_loss"])
    assert summary["tracking"]["complete"] and summary["tracking"]["dropped"] == 0
