"""The real path: a local Ray instance, 2 CPU workers, DDP over gloo, real files."""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
import torch
from formats import write_imagefolder

from ray_ddp.checkpoint.format import load_model, load_state
from ray_ddp.config import TrainConfig
from ray_ddp.driver.run import run_training
from ray_ddp.image_classification.datasets import build_datasets
from ray_ddp.image_classification.models import build_model
from ray_ddp.image_classification.task import ImageClassification
from ray_ddp.io.run_logs import read_metrics
from ray_ddp.worker.evaluate import evaluate

pytestmark = pytest.mark.ray

# Small enough for ~10 s of training per run on 2 cores, big enough to learn.
BASE = dict(num_workers=2, train_samples=3000, val_samples=301, batch_size=64, epochs=3)


# Ray actors by class, counted (dead ones too) before and after first_run; whether its
# controller's process loaded torch, by pid.
ACTORS: dict[str, dict[str, int]] = {}
CONTROLLER_TORCH: dict[str, bool] = {}


def _actor_classes() -> dict[str, int]:
    from collections import Counter

    import ray
    from ray.util.state import list_actors

    # This session's Ray by its address: another Ray on the machine must not confuse it.
    address = ray.get_runtime_context().gcs_address
    actors = list_actors(address=address, limit=10_000, raise_on_missing_output=False)
    return dict(Counter(a.class_name for a in actors))


class ControllerWatch(threading.Thread):
    """Every 0.1 s, the processes titled ``ray::LocalTrainController`` that were not one
    when the watch started (an earlier fit's may still be exiting): whether each has
    loaded torch's library (its memory map names ``libtorch``)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.earlier = set(self._controllers())
        self.torch_loaded: dict[str, bool] = {}
        self.stop = threading.Event()

    @staticmethod
    def _controllers() -> list[str]:
        pids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::LocalTrainController"):
                        pids.append(pid)
            except OSError:
                continue
        return pids

    def run(self) -> None:
        while not self.stop.wait(0.1):
            for pid in self._controllers():
                if pid in self.earlier:
                    continue
                try:
                    with open(f"/proc/{pid}/maps") as f:
                        loaded = "libtorch" in f.read()
                except OSError:
                    continue
                self.torch_loaded[pid] = self.torch_loaded.get(pid, False) or loaded


@pytest.fixture(scope="module")
def first_run(ray_session, tmp_path_factory):
    storage = str(tmp_path_factory.mktemp("runs"))
    cfg = TrainConfig(**BASE, storage_path=storage, name="first")
    ACTORS["before"] = _actor_classes()
    watch = ControllerWatch()
    watch.start()
    try:
        summary = run_training(cfg)
    finally:
        watch.stop.set()
        watch.join()
    ACTORS["after"] = _actor_classes()
    CONTROLLER_TORCH.update(watch.torch_loaded)
    return cfg, summary


def test_a_local_run_starts_only_the_actors_it_uses(first_run):
    """Ray Train's DatasetManager (no Ray Data here) and PlacementGroupCleaner (the Ray
    this process started ends with it) are left out: each is a process importing Ray
    Train, seconds of CPU on 2 cores (ray_ddp/compat/lean_trainer.py)."""
    started = {
        name: count - ACTORS["before"].get(name, 0)
        for name, count in ACTORS["after"].items()
        if count > ACTORS["before"].get(name, 0)
    }
    # The run's own actors: the controller, its synchronisation actor, two workers.
    assert started == {"LocalTrainController": 1, "SynchronizationActor": 1, "RayTrainWorker": 2}
    # The controller runs the whole fit without importing torch (about 2 CPU-seconds
    # before it asks for the workers: ray_ddp/compat/local_controller.py).
    assert list(CONTROLLER_TORCH.values()) == [False]


def test_loss_falls_and_accuracy_rises(first_run):
    _, summary = first_run
    history = summary["history"]
    assert [m["epoch"] for m in history] == [1, 2, 3]
    # 3000 samples, 1500 per worker = 23 micro-batches of 64 and one of 28: all trained.
    assert all(m["train_samples"] == 3000 for m in history)
    assert history[-1]["train_loss"] < 0.8 * history[0]["train_loss"]
    assert history[-1]["val_loss"] < history[0]["val_loss"]
    assert history[-1]["val_acc"] > history[0]["val_acc"]
    assert summary["final"]["val_acc"] > 0.5  # 10 classes: chance is 0.1
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 128
    assert summary["best"]["val_acc"] == max(m["val_acc"] for m in history)
    assert os.path.isfile(os.path.join(summary["best"]["checkpoint"], "state.pt"))


def _event_tags(directory: str) -> set[str]:
    """Scalar tags in TensorBoard event files, read from the TFRecord framing directly."""
    import glob
    import struct

    from tensorboardX.proto.event_pb2 import Event

    tags = set()
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        with open(path, "rb") as f:
            while header := f.read(12):  # uint64 length + uint32 length crc
                (length,) = struct.unpack("<Q", header[:8])
                event = Event.FromString(f.read(length))
                f.read(4)  # data crc
                tags |= {v.tag for v in event.summary.value}
    return tags


def test_run_logs_and_per_worker_balance(first_run):
    _, summary = first_run
    rows = read_metrics(os.path.join(summary["run_dir"], "metrics.csv"))
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert [r["val_acc"] for r in rows] == [m["val_acc"] for m in summary["history"]]
    with open(os.path.join(summary["run_dir"], "curves.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    tags = _event_tags(os.path.join(summary["run_dir"], "tensorboard"))
    assert {"train/loss", "train/lr", "epoch/val_acc", "epoch/val_loss"} <= tags
    assert {"ranks/samples_per_s/0", "ranks/samples_per_s/1"} <= tags
    per_rank = summary["per_rank"]
    assert sorted(r["rank"] for r in per_rank) == [0, 1]  # one row per rank
    assert all(r["samples_per_s"] > 0 and r["peak_memory_mb"] > 50 for r in per_rank)
    last = summary["history"][-1]
    assert last["speed_max_min"] >= 1.0 and last["memory_max_min"] >= 1.0
    assert last["peak_memory_mb"] == max(r["peak_memory_mb"] for r in per_rank)


def test_checkpoint_loads_into_a_plain_model_and_distributed_eval_is_exact(first_run):
    """301 validation samples over 2 ranks (151 + 150): the 2-worker figures must equal
    a single-process evaluation of the same weights, every sample counted once. The
    small ResNet has BatchNorm: each rank's running statistics drift apart in training,
    and validation must use the ones the checkpoint holds (rank 0's)."""
    cfg, summary = first_run
    model = load_model(summary["latest_checkpoint"])  # unwrapped: no DDP, no Ray
    saved = load_state(summary["latest_checkpoint"])["model"]
    assert not any(key.startswith("module.") for key in saved), "saved without DDP's prefix"
    assert (
        type(model) is type(build_model(cfg.target.model, (3, 16, 16), 10)) and not model.training
    )
    _, val, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    loader = torch.utils.data.DataLoader(val, batch_size=50)
    single = evaluate(model, loader, torch.device("cpu"), ImageClassification())
    final = summary["final"]
    assert single.sums["acc"][1] == single.samples == 301  # every sample once
    assert summary["final"]["evaluated_samples"] == 301
    # The same integer count of correct predictions over the same 301: the same float.
    assert final["val_acc"] == single.means["acc"]
    assert final["val_loss"] == pytest.approx(single.means["loss"], rel=1e-5)


def test_evaluate_job_matches_the_training_validation(first_run, storage):
    """jobs/evaluate.py with 2 workers on the final checkpoint: the same figures as the
    run's last validation, per-class counts that add up, one prediction per sample."""
    import json

    import pyarrow.parquet as pq

    from ray_ddp.driver.cli import evaluate_main

    _, summary = first_run
    predictions, results_json = os.path.join(storage, "p.parquet"), os.path.join(storage, "r.json")
    code = evaluate_main(
        [summary["latest_checkpoint"], "--num-workers", "2", "--storage-path", storage,
         "--predictions", predictions, "--summary-json", results_json]
    )  # fmt: skip
    assert code == 0
    with open(results_json) as f:
        results = json.load(f)
    final, sums = summary["final"], results["sums"]
    correct, count = sums["acc"]
    assert count == 301 and results["metrics"]["acc"] == final["val_acc"]
    assert results["metrics"]["loss"] == pytest.approx(final["val_loss"], rel=1e-5)
    per_class = [pair for name, pair in sums.items() if name.startswith("acc/")]
    assert len(per_class) == 10  # the built-in dataset's classes, each with its sums
    assert sum(c for _, c in per_class) == 301 and sum(t for t, _ in per_class) == correct
    table = pq.read_table(predictions).to_pydict()
    assert table["index"] == list(range(301))  # every sample once, none padded in
    hits = sum(p == y for p, y in zip(table["predicted"], table["label"], strict=True))
    assert hits == correct


def test_exported_model_loads_without_ray_and_predicts_the_same(first_run, tmp_path):
    import subprocess
    import sys

    _, summary = first_run
    export = summary["export"]
    assert os.path.dirname(export["program"]) == os.path.join(summary["run_dir"], "export")
    inputs = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    torch.save(inputs, tmp_path / "x.pt")
    script = (
        "import sys, torch\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r})\n"
        f"program = torch.export.load({export['program']!r}).module()\n"
        f"torch.save(program(x), {str(tmp_path / 'y.pt')!r})\n"
        f"state = torch.load({export['state_dict']!r}, weights_only=True)\n"
        "assert not any(k.startswith('module.') for k in state)\n"
        "assert 'ray' not in sys.modules and 'ray_ddp' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, cwd=tmp_path)
    expected = load_model(summary["best"]["checkpoint"])(inputs)
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), expected)


def test_bf16_autocast_trains_on_cpu_with_rays_stock_trainer(ray_session, storage, monkeypatch):
    """Also the one run on Ray Train's stock TorchTrainer (RAY_DDP_STOCK_TRAINER=1): what a
    Ray release ray_ddp's lean start-up was not verified on gets (ray_ddp.compat)."""
    from ray_ddp.compat import versions

    monkeypatch.setenv(versions.STOCK_ENV, "1")
    versions.lean_trainer_ok.cache_clear()
    try:
        assert versions.torch_trainer_class().__name__ == "TorchTrainer"
        summary = _bf16_run(storage)
    finally:
        versions.lean_trainer_ok.cache_clear()
    history = summary["history"]
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(m["train_loss"])) for m in history)
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert summary["final"]["evaluated_samples"] == 101


def _bf16_run(storage: str) -> dict:
    return run_training(
        TrainConfig(
            num_workers=2, amp="bf16", train_samples=1024, val_samples=101, epochs=2,
            storage_path=storage, name="bf16", export=False, tensorboard=False,
        )
    )  # fmt: skip


def test_imagefolder_files_train_across_workers_and_every_rank_speaks_when_asked(
    ray_session, storage, tmp_path
):
    """Real PNG files decoded in DataLoader worker processes inside Ray workers, a
    torchvision model by name (resnet18, BatchNorm), trained by jobs/train.py;
    --log-all-ranks shows every rank's lines, tagged (rank 0 only, untagged, is the
    default: test_reliability checks that on its drivers' output). (Validation with rank
    0's BatchNorm statistics, equal to one process's, is checked on first_run, whose small
    ResNet has BatchNorm too.)"""
    import json
    import subprocess
    import sys

    write_imagefolder(str(tmp_path / "data"), train=16, val=5, size=20)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    address = ray_session.get_runtime_context().gcs_address
    summary_json = os.path.join(storage, "folder.json")
    loud = subprocess.run(
        [sys.executable, os.path.join(root, "jobs", "train.py"), "--address", address,
         "--dataset", "imagefolder", "--data-dir", str(tmp_path / "data"), "--image-size", "16",
         "--model", "resnet18",
         "--batch-size", "8", "--epochs", "2", "--loader-workers", "1", "--lr", "1e-2",
         "--storage-path", storage, "--name", "folder", "--log-all-ranks",
         "--summary-json", summary_json],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert loud.returncode == 0, loud.stderr[-2000:]
    assert "[rank 0] epoch   1/2" in loud.stdout and "[rank 1] epoch   1/2" in loud.stdout
    with open(summary_json) as file:
        summary = json.load(file)
    assert summary["final"]["evaluated_samples"] == 15
    model = load_model(summary["latest_checkpoint"])
    assert type(model).__name__ == "ResNet" and model(torch.zeros(1, 3, 16, 16)).shape == (1, 3)


# ------------------------------------------------- the first run, continued (last: they add
# checkpoints to it, and Ray keeps only the best two and the latest)
@pytest.fixture(scope="module")
def rerun(first_run):
    """first_run re-run under its name with one more epoch: it resumes."""
    cfg, _ = first_run
    return run_training(dataclasses.replace(cfg, epochs=4))


def test_rerunning_the_name_resumes_from_the_last_epoch(first_run, rerun):
    _, first = first_run
    summary = rerun
    assert [m["epoch"] for m in summary["history"]] == [4]  # epochs 1-3 not redone
    steps_per_epoch = first["steps"] // 3
    assert summary["steps"] == 4 * steps_per_epoch
    state = load_state(summary["latest_checkpoint"])
    assert state["progress"]["epoch"] == 4
    # Resuming continued from the trained weights: better than epoch 1 of the first run.
    assert summary["history"][0]["val_loss"] < first["history"][0]["val_loss"]


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(first_run, rerun):
    """The re-run's latest checkpoint truncated, as a crash mid-copy would leave it: the
    next re-run resumes from the newest older one that reads, never from scratch."""
    import pyarrow.fs

    from ray_ddp.io.storage import list_checkpoints

    cfg, _ = first_run
    latest = rerun["latest_checkpoint"]
    state_file = os.path.join(latest, "state.pt")
    with open(state_file, "r+b") as f:
        f.truncate(os.path.getsize(state_file) // 2)
    older = [p for p in list_checkpoints(pyarrow.fs.LocalFileSystem(), rerun["run_dir"])
             if p != latest]  # fmt: skip
    assert older, "older checkpoints are kept (keep_checkpoints=2)"
    fallback = load_state(older[-1])["progress"]["epoch"]
    assert fallback < 4
    summary = run_training(dataclasses.replace(cfg, epochs=5))
    # Resumed from the newest readable checkpoint: the epochs after it trained, no others.
    assert [m["epoch"] for m in summary["history"]] == list(range(fallback + 1, 6))
    assert load_state(summary["latest_checkpoint"])["progress"]["epoch"] == 5
