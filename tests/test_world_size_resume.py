"""A 2-worker run stopped by a non-finite loss (at once, naming the step and the rank,
not retried, its last checkpoint intact) and continued on 1 worker is the same
optimisation: the same samples in the same optimizer steps (a ledger gathered from every
rank), every sample once per epoch, and the same final weights as the uninterrupted
2-worker run. And an elastic run whose 3 micro-batches per step fall unevenly on the 2
workers it got (2 and 1) makes the steps of 1 worker accumulating all 3.

Tolerance: see tests/ledgers.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from ledgers import EXACT_RUN, LEDGER, assert_every_sample_once, assert_same_weights, ledger
from ray.train import ControllerError

from ray_ddp.checkpoint.format import load_state
from ray_ddp.driver.run import fit
from ray_ddp.io.storage import list_checkpoints
from ray_ddp.reliability.attempts import last_attempt
from ray_ddp.reliability.loss_guard import NonFiniteLossError
from ray_ddp.testing.harness import Harness

pytestmark = pytest.mark.ray

TASK = "ray_ddp.image_classification:ImageClassification"


def test_a_run_stopped_by_a_nan_continued_on_one_worker_is_the_same_run(
    straight_run, tmp_path, capsys
):
    import pyarrow.fs

    storage = str(tmp_path)
    run_dir = os.path.join(storage, "moved")
    # Rank 1's loss turns NaN at step 53 (epoch 2, after the checkpoint at step 50).
    # A restart would meet it again: not retried, though --max-failures allows one.
    # Synchronous checkpoints: step 50's is uploaded and reported by both ranks before
    # either trains step 51, so the controller registers it before it reads the NaN.
    # (Asynchronous, one still uploading when another rank fails is never registered and
    # the one before stays the latest, checkpointer.py's contract: which one that is would
    # hang on the upload's speed. test_async_checkpoints holds that contract.)
    nan = Harness(nan_step=53, nan_rank=1, sample_ledger=True)
    with pytest.raises(ControllerError) as failure:
        fit(TASK, num_workers=2, storage_path=storage, name="moved", max_failures=1,
            harness=nan, checkpoint_mode="sync", **EXACT_RUN)  # fmt: skip
    assert "non-finite training loss at optimizer step 53 on rank 1" in str(failure.value)
    # Stopped by ray_ddp's rule in the controller, not by running out of --max-failures.
    assert isinstance(failure.value.controller_failure, NonFiniteLossError)
    assert last_attempt(run_dir)["attempt"] == "1"
    with open(os.path.join(run_dir, "checkpoint_manager_snapshot.json")) as file:
        latest = json.load(file)["latest_checkpoint_result"]["metrics"]
    assert latest["step"] == 50 and latest["mid_epoch"]
    newest = list_checkpoints(pyarrow.fs.LocalFileSystem(), run_dir)[-1]
    state = load_state(newest)
    assert state["progress"]["step"] == 50  # the newest on disk: nothing after the NaN
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    capsys.readouterr()

    summary = fit(TASK, num_workers=1, storage_path=storage, name="moved", harness=LEDGER,
                  **EXACT_RUN)  # fmt: skip
    out = capsys.readouterr().out
    assert (
        "run moved continues on 1 worker: accumulation 1 -> 2 keeps its global batch of 64" in out
    )
    assert "samples into epoch 2" in out  # resumed inside the epoch, not at its start
    assert (
        "lost 1 worker since the checkpoint: continuing on 1 worker, accumulation 1 -> 2, " in out
    )
    assert summary["world_size"] == 1 and summary["global_batch_size"] == 64

    steps = ledger(summary["run_dir"])
    assert_every_sample_once(steps, EXACT_RUN["train_samples"])
    assert steps == ledger(straight_run["run_dir"]), "the same samples in the same steps"
    history = [(row["epoch"], row["world_size"], row["accum_steps"]) for row in summary["history"]]
    assert history == [(2, 1, 2)]
    assert_same_weights(
        load_state(summary["latest_checkpoint"])["model"],
        load_state(straight_run["latest_checkpoint"])["model"],
    )


UNEVEN = {
    "model": "small_cnn",
    "epochs": 2,
    "train_samples": 960,  # 10 optimizer steps of 96 per epoch
    "val_samples": 100,
    "batch_size": 32,
    "seed": 5,
    "harness": LEDGER,
    "export": False,
    "tensorboard": False,
    "progress_interval_s": 0,
}


@pytest.fixture
def fresh_ray(no_shared_ray):
    """A Ray of this test's own, with no other run's resource request at its
    AutoscalingCoordinator. Every Train controller registers its workers' resources there
    and should withdraw them when it ends; a request left behind holds its CPUs for an
    elastic run until it expires, 180 s after its last renewal. In the full suite this
    elastic run waited 154-171 s ("Detected ready resources for 0 workers" while both CPUs
    were free), in a module of its own 18-26 s."""
    import ray

    from ray_ddp.cluster.connect import shutdown

    ray.init(num_cpus=2, logging_level="WARNING")
    yield
    shutdown()


@pytest.mark.own_cluster
def test_an_uneven_split_over_fewer_workers_than_the_max_makes_the_same_steps(
    fresh_ray, tmp_path, capsys
):
    """--num-workers 2-3 on 2 CPUs: Ray starts the 2 workers that fit; each step's 3
    micro-batches go 2 to rank 0, 1 to rank 1. The reference: 1 worker accumulating 3.
    The ranks add their gradients in another order than one worker does (thirds are not
    exact in binary), so the weights agree to rounding, not to the bit: 4e-7 at most here.
    (With BatchNorm, small_resnet, the uneven run matches to ~3e-8 after 2 steps, but AdamW
    turns the rounding of near-zero gradients into whole lr-sized steps, 4e-4 after 10:
    only power-of-two splits, bit-exact, compare well with it.)"""
    storage = str(tmp_path)
    # The elastic run first: a run before it could leave it a request to wait out.
    elastic = fit(TASK, num_workers=3, min_workers=2, storage_path=storage, name="two", **UNEVEN)
    out = capsys.readouterr().out
    alone = fit(TASK, num_workers=1, accum_steps=3, storage_path=storage, name="alone", **UNEVEN)
    assert elastic["world_size"] == 2
    assert (
        "batch: 3 micro-batches of 32 per optimizer step over 2 workers (2 on rank 0, 1 on "
        "the others) = 96 samples (global batch); the workers are busy 75% of each step"
    ) in out
    steps = ledger(elastic["run_dir"])
    assert_every_sample_once(steps, UNEVEN["train_samples"])
    assert steps == ledger(alone["run_dir"])
    assert_same_weights(
        load_state(elastic["latest_checkpoint"])["model"],
        load_state(alone["latest_checkpoint"])["model"],
        rtol=1e-4,
        atol=1e-5,
    )
