"""An own loop run by ray_ddp (``ray_ddp.Run``, ``docs/own-loop.md``): real Ray, real DDP
over gloo on 2 CPU workers, real checkpoints on disk, nothing mocked.

The GAN example (two models, two optimizers, an EMA registered as state, noise from the
seeded draws) three times on one shared Ray, 3 fits: uninterrupted on 2 workers; the same
command stopped by ``--max-steps`` inside the first epoch on 2 workers, then run again
without it on 1 worker. Every registered tensor of the two final checkpoints must agree
within 1e-6 (norm-relative, tensor by tensor); measured: 0.0, bit for bit.

The stopped run meets, on the way, the faults an own loop must come through (no fit
added): asynchronous checkpoints every 2 steps; rank 1 dies at step 4 (``os._exit``: no
clean-up, as under SIGKILL); rank 0 hangs at step 6, found by the hang watchdog within
``--hang-timeout``. Each time the group restarts from the latest checkpoint.
"""

from __future__ import annotations

import csv
import json
import math
import os

import pytest
import torch

import ray_ddp
from examples.own_loop import gan
from ray_ddp.checkpoint.format import load_checkpoint_state
from ray_ddp.testing.harness import ENV, Harness, Stall

pytestmark = pytest.mark.ray

STEPS_PER_EPOCH = 16  # 512 samples, a global batch of 16 x 2
FAULTS = Harness(stalls=(Stall(4, rank=1, exit=True), Stall(6, rank=0)))
CUT = ["--max-steps", "7", "--checkpoint-every", "2", "--checkpoint-mode", "async",
       "--max-failures", "2", "--hang-timeout", "4", "--hang-grace", "30"]  # fmt: skip


def _gan(storage: str, name: str, workers: int, *more: str) -> dict:
    summary = f"{storage}/{name}-{workers}.json"
    argv = ["--num-workers", str(workers), "--storage-path", storage, "--name", name,
            "--summary-json", summary, "--epochs", "2", *more]  # fmt: skip
    assert gan.main(argv) == 0
    with open(summary) as file:
        return json.load(file)


@pytest.fixture(scope="module")
def gan_runs(ray_session, tmp_path_factory):
    storage = str(tmp_path_factory.mktemp("own_loop"))
    whole = _gan(storage, "whole", 2, "--profile-steps", "3-4")  # profiled: the same math
    os.environ.update(FAULTS.to_env())
    try:
        stopped = _gan(storage, "cut", 2, *CUT)
    finally:
        del os.environ[ENV]
    stopped["run_dir"] = os.path.join(storage, "cut")
    # Read now: the re-run keeps only the run's latest checkpoints (--keep-checkpoints).
    stopped["state"] = load_checkpoint_state(stopped["latest_checkpoint"])
    resumed = _gan(storage, "cut", 1)
    return whole, stopped, resumed


def _differences(a, b, name: str = "") -> list[tuple[str, float]]:
    """Each tensor's norm-relative difference; other values must be equal."""
    if isinstance(a, torch.Tensor):
        scale = max(b.double().norm().item(), 1e-30)
        return [(name, (a.double() - b.double()).norm().item() / scale)]
    if isinstance(a, dict):
        assert set(a) == set(b), name
        return [d for k in a for d in _differences(a[k], b[k], f"{name}.{k}")]
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), name
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in _differences(x, y, f"{name}[{i}]")
        ]
    assert a == b, (name, a, b)
    return []


def test_a_gan_stopped_inside_an_epoch_and_resumed_on_fewer_workers_is_the_same_run(gan_runs):
    whole, stopped, resumed = gan_runs
    # The stop is inside the first epoch: its checkpoint holds that position.
    progress = stopped["state"]["progress"]
    assert (progress["epoch"], progress["step"], progress["sample"]) == (0, 7, 7 * 32)
    assert resumed["world_size"] == 1 and whole["world_size"] == 2
    assert resumed["steps"] == whole["steps"] == 2 * STEPS_PER_EPOCH

    a = ray_ddp.load_state(whole["latest_checkpoint"])
    b = ray_ddp.load_state(resumed["latest_checkpoint"])
    assert sorted(a) == ["d_opt", "discriminator", "ema", "g_opt", "generator"]
    differences = _differences(a, b)
    assert len(differences) > 20  # every weight, both optimizers' moments, the EMA
    worst = max(differences, key=lambda d: d[1])
    assert worst[1] <= 1e-6, worst
    # The EMA moved away from the generator: it is a state of its own, restored as such.
    assert not torch.equal(a["ema"]["average.0.weight"], a["generator"]["0.weight"])


def test_an_own_loop_comes_through_a_dead_rank_and_a_hang_from_its_async_checkpoints(gan_runs):
    """The stopped run's three attempts (the resumed run's equality is the test above): the
    first ends when rank 1 dies at step 4, the second when the watchdog finds rank 0 hung
    at step 6 (its report names it); the third starts from a checkpoint written
    asynchronously (step 4's). (The second starts from step 2's, or from the start where
    Ray had not yet registered it when rank 1 died: the same run either way.)"""
    _, stopped, _ = gan_runs
    with open(os.path.join(stopped["run_dir"], "attempts.csv")) as file:
        attempts = list(csv.DictReader(file))
    assert [(a["attempt"], a["world_size"]) for a in attempts[:3]] == [
        ("1", "2"), ("2", "2"), ("3", "2")
    ]  # fmt: skip
    assert attempts[2]["checkpoint"].startswith("checkpoint_")  # its name (since pruned)
    hang = os.path.join(stopped["run_dir"], "hangs", "attempt-2")
    with open(os.path.join(hang, "rank-0.txt")) as file:
        assert "time.sleep(planned.seconds)" in file.read()  # where it hung
    assert stopped["checkpoints"]["mode"] == "async"


def test_an_own_loop_is_profiled_over_the_steps_asked(gan_runs):
    """``--profile-steps 3-4`` on the uninterrupted run: one trace per rank, rank 0's top
    operators in the summary."""
    whole, _, _ = gan_runs
    folder = os.path.join(whole["run_dir"], "profiles", "attempt-1")
    assert sorted(os.listdir(folder)) == ["rank-0.trace.json", "rank-1.trace.json"]
    with open(os.path.join(folder, "rank-1.trace.json")) as file:
        assert json.load(file)["traceEvents"]
    assert whole["profile"]["steps"] == "3-4" and "Self CPU" in whole["profile"]["top"]


def test_an_own_loop_reports_each_epoch_with_its_checkpoint(gan_runs):
    whole, _, resumed = gan_runs
    assert [row["epoch"] for row in whole["history"]] == [1, 2]
    assert whole["final"]["val_acc"] == pytest.approx(resumed["final"]["val_acc"], abs=1e-9)
    assert whole["best"]["checkpoint"] and whole["latest_checkpoint"]
    state = load_checkpoint_state(whole["latest_checkpoint"])
    assert state["task_meta"]["task"] == "examples.own_loop.gan:train"
    assert (state["progress"]["epoch"], state["progress"]["sample"]) == (2, 0)


def test_the_seed_guides_script_ported_validates_exactly(ray_session, tmp_path):
    """examples/own_loop/seed_port.py, 2 epochs on 2 workers (1 fit): the validation it
    reports equals a single-process evaluation of its checkpoint's weights (float64 sums
    here, each rank's float32 batches there)."""
    from examples.own_loop import seed_port
    from ray_ddp.image_classification.models import build_model
    from ray_ddp.image_classification.synthetic import make_synthetic

    summary = ray_ddp.launch(
        seed_port.main, num_workers=2, epochs=2, batch_size=16, train_samples=480,
        val_samples=203, storage_path=str(tmp_path), name="seed", best_metric="acc",
        best_mode="max",
    )  # fmt: skip
    assert [row["epoch"] for row in summary["history"]] == [1, 2]
    states = ray_ddp.load_state(summary["latest_checkpoint"])
    assert sorted(states) == ["model", "optimizer"]
    model = build_model("small_cnn", (3, 16, 16), 10)
    model.load_state_dict(states["model"])
    _, val = make_synthetic(0, 480, 203)
    images, labels = val.batch(range(len(val)))
    with torch.no_grad():
        output = model.eval()(images)
    loss = torch.nn.functional.cross_entropy(output.double(), labels, reduction="sum") / 203
    correct = int((output.argmax(dim=1) == labels).sum())
    assert summary["final"]["val_loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert summary["final"]["val_acc"] == pytest.approx(correct / 203, abs=1e-12)


def test_a_token_weighted_lm_trains_the_same_weights_at_any_split(
    ray_session, tracking_server, tmp_path
):
    """examples/own_loop/lm.py (a ``Sum`` loss over variable-length sequences, 4 fits): 1
    worker x batch 16 and 2 workers x batch 8 make the same optimizer steps, so the same
    weights, schedule and momentum (within 1e-5; SGD keeps rounding at rounding level).
    The 2-worker run is tracked in a real MLflow server: its params, every step's
    training loss and lr, and its report's metrics, read back through the client. Then
    the same under FSDP2, stopped on 2 workers and resumed on 1 from its shards."""
    from examples.own_loop import lm

    common = ["--epochs", "1", "--max-steps", "12", "--storage-path", str(tmp_path)]
    tracked = ["--tracking", "mlflow", "--tracking-uri", tracking_server.uri,
               "--experiment", "own-loop", "--log-every-steps", "1"]  # fmt: skip
    summaries = []
    for workers, batch in ((1, 16), (2, 8)):
        path = str(tmp_path / f"lm-{workers}.json")
        argv = [*common, "--num-workers", str(workers), "--batch-size", str(batch),
                "--name", f"lm{workers}", "--summary-json", path]  # fmt: skip
        assert lm.main(argv + (tracked if workers == 2 else [])) == 0
        with open(path) as file:
            summaries.append(json.load(file))
    one, two = (ray_ddp.load_state(s["latest_checkpoint"]) for s in summaries)
    assert sorted(one) == ["model", "optimizer", "schedule"]
    assert one["schedule"]["last_epoch"] == two["schedule"]["last_epoch"] == 12
    worst = max(_differences(one["model"], two["model"]), key=lambda d: d[1])
    assert worst[1] <= 1e-5, worst
    momentum = max(_differences(one["optimizer"], two["optimizer"]), key=lambda d: d[1])
    assert momentum[1] <= 1e-5, momentum
    # The model learnt: below a uniform guess over the vocabulary.
    assert summaries[0]["final"]["val_loss"] < math.log(lm.VOCAB)
    _assert_tracked(tracking_server.uri, summaries[1])
    _assert_sharded_run_is_the_same(tmp_path, one["model"])


def _assert_sharded_run_is_the_same(tmp_path, model: dict) -> None:
    """The LM under FSDP2 (2 fits): 2 workers x batch 8 stopped at step 6, its sharded
    checkpoint resumed on 1 worker to step 12: the weights of the 1-worker DDP run."""
    from examples.own_loop import lm

    common = ["--epochs", "1", "--storage-path", str(tmp_path), "--name", "lm-fsdp2",
              "--strategy", "fsdp2"]  # fmt: skip
    path = str(tmp_path / "lm-fsdp2.json")
    assert lm.main([*common, "--num-workers", "2", "--batch-size", "8", "--max-steps", "6"]) == 0
    # The same flags on 1 worker: the run's global batch of 16 is kept (2 micro-batches).
    argv = [*common, "--num-workers", "1", "--batch-size", "8", "--max-steps", "12",
            "--summary-json", path]  # fmt: skip
    assert lm.main(argv) == 0
    with open(path) as file:
        summary = json.load(file)
    assert summary["steps"] == 12 and summary["world_size"] == 1
    sharded = ray_ddp.load_state(summary["latest_checkpoint"])
    assert sorted(sharded) == ["model", "optimizer", "schedule"]
    assert sharded["schedule"]["last_epoch"] == 12
    worst = max(_differences(sharded["model"], model), key=lambda d: d[1])
    assert worst[1] <= 1e-5, worst


def _assert_tracked(uri: str, summary: dict) -> None:
    """The own loop's tracker run, as MLflow's client reads it."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    assert summary["tracking"]["complete"] is True
    run = client.get_run(summary["tracking"]["run_id"])
    assert run.data.params["world_size"] == "2" and run.data.params["batch_size"] == "8"
    losses = client.get_metric_history(run.info.run_id, "train_loss")
    assert sorted(m.step for m in losses) == list(range(1, 13))
    assert all(math.isfinite(m.value) for m in losses)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "lr")] != []
    reported = client.get_metric_history(run.info.run_id, "val_loss")
    assert [(m.step, m.value) for m in reported] == [(12, summary["final"]["val_loss"])]
