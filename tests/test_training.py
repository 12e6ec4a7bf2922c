"""The real path: a local Ray instance, 2 CPU workers, DDP over gloo, real files."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from formats import write_imagefolder

from ray_ddp.checkpoint import load_model, load_state
from ray_ddp.config import TrainConfig
from ray_ddp.datasets import build_datasets
from ray_ddp.evaluation import evaluate
from ray_ddp.run_logs import read_metrics
from ray_ddp.trainer import run_training

pytestmark = pytest.mark.ray

# Small enough for ~10 s of training per run on 2 cores, big enough to learn.
BASE = dict(num_workers=2, train_samples=3000, val_samples=301, batch_size=64, epochs=3)


@pytest.fixture(scope="module")
def first_run(ray_session, tmp_path_factory):
    storage = str(tmp_path_factory.mktemp("runs"))
    cfg = TrainConfig(**BASE, storage_path=storage, name="first")
    return cfg, run_training(cfg)


def test_loss_falls_and_accuracy_rises(first_run):
    _, summary = first_run
    history = summary["history"]
    assert [m["epoch"] for m in history] == [1, 2, 3]
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
    a single-process evaluation of the same weights, every sample counted once."""
    cfg, summary = first_run
    model = load_model(summary["latest_checkpoint"])  # unwrapped: no DDP, no Ray
    assert not isinstance(model, torch.nn.parallel.DistributedDataParallel)
    _, val, _ = build_datasets(cfg)
    loader = torch.utils.data.DataLoader(val, batch_size=50)
    single = evaluate(model, loader, torch.device("cpu"))
    final = summary["final"]
    assert final["val_count"] == single.count == 301
    assert final["val_correct"] == single.correct
    assert final["val_loss"] == pytest.approx(single.loss, rel=1e-5)


def test_rerunning_the_name_resumes_from_the_last_epoch(first_run):
    cfg, first = first_run
    summary = run_training(dataclasses.replace(cfg, epochs=4))
    assert [m["epoch"] for m in summary["history"]] == [4]  # epochs 1-3 not redone
    steps_per_epoch = first["steps"] // 3
    assert summary["steps"] == 4 * steps_per_epoch
    state = load_state(summary["latest_checkpoint"])
    assert state["progress"]["epoch"] == 4
    # Resuming continued from the trained weights: better than epoch 1 of the first run.
    assert summary["history"][0]["val_loss"] < first["history"][0]["val_loss"]


def test_resume_from_a_checkpoint_directory(first_run, storage):
    cfg, first = first_run
    summary = run_training(
        dataclasses.replace(
            cfg,
            name="branch",
            storage_path=storage,
            epochs=4,
            resume_from=first["latest_checkpoint"],
        )
    )
    assert [m["epoch"] for m in summary["history"]] == [4]
    assert summary["run_dir"].startswith(storage)


def _weights(summary: dict) -> dict[str, torch.Tensor]:
    return load_state(summary["latest_checkpoint"])["model"]


def test_accumulation_equals_the_big_batch_with_one_allreduce_per_step(ray_session, storage):
    """4 micro-batches of 8 per worker = one batch of 32 per worker: same first update;
    and the comm hook counts exactly one gradient all-reduce per optimizer step.

    SGD, because its update is linear in the gradient: float-rounding differences in the
    summed gradient stay float-sized (AdamW divides by sqrt(v) and can magnify them on
    near-zero gradients)."""
    common = dict(
        num_workers=2,
        train_samples=512,
        val_samples=64,
        epochs=1,
        max_steps=2,
        storage_path=storage,
        comm_stats=True,
        seed=5,
        optimizer="sgd",
        lr=0.05,
    )
    accumulated = run_training(TrainConfig(**common, batch_size=8, accum_steps=4, name="acc"))
    big = run_training(TrainConfig(**common, batch_size=32, accum_steps=1, name="big"))
    assert accumulated["steps"] == big["steps"] == 2
    for key, value in _weights(big).items():
        torch.testing.assert_close(_weights(accumulated)[key], value, rtol=1e-5, atol=1e-6)
    assert accumulated["history"][0]["allreduces_per_step"] == 1.0  # 4 backwards, 1 sync
    assert big["history"][0]["allreduces_per_step"] == 1.0


def test_bf16_autocast_trains_on_cpu(ray_session, storage):
    summary = run_training(
        TrainConfig(
            num_workers=2,
            amp="bf16",
            train_samples=1024,
            val_samples=101,
            epochs=2,
            storage_path=storage,
            name="bf16",
        )
    )
    history = summary["history"]
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(m["train_loss"])) for m in history)
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert summary["final"]["val_count"] == 101


def test_imagefolder_files_train_across_workers(ray_session, storage, tmp_path):
    """Real PNG files decoded in DataLoader worker processes inside Ray workers."""
    write_imagefolder(str(tmp_path / "data"), train=16, val=5, size=20)
    summary = run_training(
        TrainConfig(
            num_workers=2,
            dataset="imagefolder",
            data_dir=str(tmp_path / "data"),
            image_size=16,
            batch_size=8,
            epochs=2,
            loader_workers=1,
            lr=1e-2,
            storage_path=storage,
            name="folder",
        )
    )
    assert summary["final"]["val_count"] == 15
    assert load_model(summary["latest_checkpoint"]).head.out_features == 3
