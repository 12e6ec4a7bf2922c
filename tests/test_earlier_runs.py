"""Runs made before the redesign (issue 26) continue after it: a checkpoint and a run
record written by ray_ddp at d86bdea (tests/data, made by that commit's own save_state and
write_record, testing-aid fields and all) load, check, restore and guard re-runs as they
did, and its epoch is finished in the order it was counted in (``torch.randperm``, order
version 1; issue 47), as a streamed Parquet checkpoint's is in the whole-list order of
order versions 1 and 2. A run record written by 71e8b1a's write_record (before issue 46's
typed config) reads into the same config, field by field, and guards its re-runs. No Ray:
the restore is the worker's own, on a model and optimizer built here."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from formats import SimulatedLayout
from torch.utils.data import DataLoader

from ray_ddp.checkpoint.format import check_compatible, load_model, load_state, saved_config
from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.data.order.continuation import order_record
from ray_ddp.data.order.global_order import ORDER_VERSION, RANDPERM_VERSION, GlobalOrderBatches
from ray_ddp.data.order.streamed_batches import StreamedBatches
from ray_ddp.data.order.streaming import STREAMED_VERSION, streaming_order
from ray_ddp.data.parquet_stream import StreamingParquet
from ray_ddp.driver.elastic import keep_global_batch
from ray_ddp.driver.rerun_guard import RECORD_FILE, check_rerun, recorded_config
from ray_ddp.image_classification.models import build_model
from ray_ddp.image_classification.synthetic import make_synthetic
from ray_ddp.worker.data import WorkerData
from ray_ddp.worker.identity import Worker
from ray_ddp.worker.optim import build_optimizer, build_scheduler
from ray_ddp.worker.precision import grad_scaler
from ray_ddp.worker.resume import Restored, continue_epoch, restore_training
from ray_ddp.worker.state import EpochSums, TrainProgress, TrainState

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CHECKPOINT = os.path.join(DATA, "checkpoint_d86bdea")
# The run's flags then: what a re-run gives again.
FLAGS = dict(model="small_cnn", num_workers=2, batch_size=32, epochs=3, seed=7, lr=0.01,
             augment="none", checkpoint_every=5)  # fmt: skip


def _restored(now: TrainConfig) -> TrainState:
    net = build_model("small_cnn", (3, 16, 16), 10)
    optimizer = build_optimizer(now.optim, net.parameters())
    return TrainState(
        net,
        optimizer,
        build_scheduler(now.optim, optimizer, 100),
        grad_scaler("off", torch.device("cpu")),
    )


def test_an_earlier_checkpoint_loads_checks_and_restores():
    state = load_state(CHECKPOINT)
    assert "stall_step" in state["config"]  # an earlier config, with its testing aids
    cfg = saved_config(state)
    assert (cfg.target.model, cfg.optim.lr, cfg.optim.seed, cfg.optim.batch_size) == (
        "small_cnn",
        0.01,
        7,
        32,
    )
    facts = {"model": "small_cnn", "num_classes": 10, "input_shape": [3, 16, 16]}
    check_compatible(state, {"task": cfg.target.task, "facts": facts}, "the checkpoint")
    model = load_model(CHECKPOINT)  # the built-in task, by the spec it recorded
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state["model"].items())

    now = TrainConfig(**FLAGS)
    train = _restored(now)
    worker = Worker(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))
    restore_training(Restored(state, CHECKPOINT), train, worker, now.optim, now.global_batch_size,
                     steps_per_epoch=10)  # fmt: skip
    assert (train.progress.epoch, train.progress.sample, train.progress.step) == (1, 160, 8)
    assert train.scheduler.last_epoch == 3  # the optimizer steps it had taken
    assert set(train.optimizer.state_dict()["state"]) == set(state["optimizer"]["state"])


def test_an_earlier_checkpoint_finishes_its_epoch_in_its_own_order(capsys):
    """The checkpoint stopped 160 samples into epoch 2 of an order made by
    ``torch.randperm`` (it records no order version): that epoch is finished in it, from
    its sample 160, and the next epoch takes today's keyed permutation; its checkpoints
    say which (the version is in their order record)."""
    now = TrainConfig(**FLAGS)
    train, state = _restored(now), load_state(CHECKPOINT)
    worker = Worker(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))
    restored = Restored(state, CHECKPOINT)
    restore_training(restored, train, worker, now.optim, now.global_batch_size, steps_per_epoch=188)
    splits = make_synthetic(now.optim.seed)
    order = GlobalOrderBatches(len(splits[0]), batch_size=32, global_batch=64, seed=7, rank=0,
                               world_size=2, tag_epoch=False)  # fmt: skip
    record = order_record(order.plan, None)
    loaders = (DataLoader(splits[0], batch_sampler=order), DataLoader(splits[1]))
    data = WorkerData(loaders[0], order, loaders[1], 12_000, 2_000, 188, 1, record)
    continue_epoch(restored, train, worker, now.checkpointing.restart_epoch, data, EpochSums())
    assert "epoch 2 is finished in the order its checkpoint counted in (order version 1)" in (
        capsys.readouterr().out
    )
    assert train.progress.sample == 160
    order.set_position(train.progress.epoch, train.progress.sample)
    assert order.plan.version == RANDPERM_VERSION
    then = torch.randperm(12_000, generator=torch.Generator().manual_seed(7 + 1)).tolist()
    assert [s.indices for s in order.slots[:3]] == [then[160:192], then[224:256], then[288:320]]
    order.set_position(2, 0)
    assert order.plan.version == ORDER_VERSION
    assert record["version"] == ORDER_VERSION


def test_a_streamed_checkpoint_of_the_whole_list_order_finishes_its_epoch_in_it(capsys):
    """A streamed Parquet checkpoint of order version 2 (the whole-list order that
    versions 1 and 2 share, ``streaming.streaming_order``) stopped 3 steps into epoch 2:
    that epoch is finished in it, said in one line, and the next takes today's (version
    3, computed by position); today's checkpoints record version 3. Row groups simulated
    (no files): the order depends only on their sizes."""
    now = TrainConfig(**FLAGS)
    sizes = [16, 16, 9, 16, 16, 5, 16, 16, 16, 10] * 3
    split = StreamingParquet(SimulatedLayout(sizes), lambda x, y: (x, y))
    order = StreamedBatches(split, buffer=40, batch_size=8, global_batch=32, seed=7, rank=0,
                            world_size=2, tag_epoch=False)  # fmt: skip
    record = order_record(order.plan, "f")
    assert record["version"] == STREAMED_VERSION and record["streamed"]
    train, worker = _restored(now), Worker(rank=0, local_rank=0, world_size=2,
                                           device=torch.device("cpu"))  # fmt: skip
    saved = {**record, "version": ORDER_VERSION}  # what a run before version 3 recorded
    train.progress = TrainProgress(epoch=1, sample=96, step=order.plan.steps + 3, order=saved)
    data = WorkerData(None, order, None, len(split), 0, order.plan.steps, 2, record)
    continue_epoch(Restored({}, "the checkpoint"), train, worker, now.checkpointing.restart_epoch,
                   data, EpochSums())  # fmt: skip
    lines = [line for line in capsys.readouterr().out.splitlines() if "order version" in line]
    assert len(lines) == 1 and "epoch 2 is finished in the order its checkpoint" in lines[0]
    assert "(order version 2); the epochs after it take version 3" in lines[0]
    order.set_position(1, 96)
    then = streaming_order(tuple(sizes), 40, 7, 1, 4, 8)
    assert order.plan.version == ORDER_VERSION
    assert [[r.index for r in rows] for rows in order][:2] == [then[96:104], then[112:120]]
    order.set_position(2, 0)
    assert order.plan.version == STREAMED_VERSION
    assert list(order.plan.order()) != streaming_order(tuple(sizes), 40, 7, 2, 4, 8)


def test_an_earlier_run_record_guards_its_re_runs(tmp_path):
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    shutil.copy(os.path.join(DATA, "ray_ddp_config_d86bdea.json"), run_dir / RECORD_FILE)
    same = TrainConfig(**FLAGS, storage_path=str(tmp_path), name="old")
    assert "sample_ledger" in json.loads((run_dir / RECORD_FILE).read_text())
    check_rerun(same)  # the same flags: it resumes
    with pytest.raises(ConfigError, match=r"--lr 0.01 -> 0.02"):
        check_rerun(TrainConfig(**{**FLAGS, "lr": 0.02}, storage_path=str(tmp_path), name="old"))
    fewer = TrainConfig(**{**FLAGS, "num_workers": 1}, storage_path=str(tmp_path), name="old")
    saved = recorded_config(fewer.checkpointing)
    optim = keep_global_batch(fewer.scaling, fewer.optim, saved, "run old")
    kept = fewer.replace(optim=optim)
    assert kept.optim.accum_steps == 2 and kept.global_batch_size == 64


# A run record written by today's write_record (at 71e8b1a, before the typed-config
# refactor of issue 46), for a run whose every field has a value of its own: a later
# version must read it into the same config and resume it.
RECORD_71E8B1A = os.path.join(DATA, "ray_ddp_config_71e8b1a.json")
KEPT = dict(
    num_workers=4, min_workers=2, resize_check_s=30.0, cpus_per_worker=2.0,
    resources_per_worker={"trainer_slot": 1.0}, use_gpu=False, strategy="ddp",
    address="ray://head:10001", placement_strategy="SPREAD", wait_for_resources=120.0,
    max_failures=3, preemption_check_steps=5, hang_timeout=300.0, hang_grace=900.0,
    epochs=7, batch_size=32, accum_steps=2, lr=0.02, optimizer="sgd", momentum=0.8,
    weight_decay=0.0005, warmup_steps=40, min_lr_ratio=0.05, grad_clip=0.5, amp="bf16",
    seed=11, max_steps=500, task="ray_ddp.image_classification:ImageClassification",
    model="small_cnn", compile=True, dataset="parquet", data_dir="/data/shards",
    download=True, train_samples=6000, val_samples=800, image_size=24, augment="crop",
    label_column="y", image_column="png", feature_column=None, parquet_read="memory",
    shuffle_buffer=4096, data_engine="torch", max_bad_samples=7, loader_workers=2,
    channels_last=False, pin_memory=False, storage_path="runs", name="kept-run",
    allow_config_change=True, resume_from="/runs/other/checkpoint_000002",
    restart_epoch=True, keep_checkpoints=3, checkpoint_every=25, checkpoint_mode="sync",
    export=False, summary_json="summary.json", progress_interval_s=5.0, tensorboard=False,
    log_every_steps=10, log_all_ranks=True, comm_stats=True, tracking="mlflow",
    tracking_uri="http://mlflow:5000", experiment="kept", profile_steps="3-5",
    log_prefix="[trial 1]",
)  # fmt: skip


def test_a_record_of_today_reads_into_the_same_config_and_resumes(tmp_path):
    with open(RECORD_71E8B1A) as file:
        saved = json.load(file)
    assert set(saved) == set(KEPT)  # every field the config had when it was written
    defaults = TrainConfig()
    assert sum(value != defaults.value(name) for name, value in KEPT.items()) >= 60

    read, kept = TrainConfig.from_dict(saved), TrainConfig(**KEPT)
    differ = [n for n in KEPT if read.value(n) != kept.value(n)]
    assert not differ, differ
    assert read == kept
    assert {k: v for k, v in read.to_dict().items() if k in saved} == saved  # written the same

    run_dir = tmp_path / "kept-run"
    run_dir.mkdir()
    shutil.copy(RECORD_71E8B1A, run_dir / RECORD_FILE)
    again = TrainConfig(**{**KEPT, "storage_path": str(tmp_path), "allow_config_change": False})
    check_rerun(again)  # the same flags: it resumes
    with pytest.raises(ConfigError, match=r"--optimizer sgd -> adamw"):
        check_rerun(TrainConfig(**{**KEPT, "storage_path": str(tmp_path), "optimizer": "adamw",
                                   "allow_config_change": False}))  # fmt: skip
    fewer = TrainConfig(**{**KEPT, "storage_path": str(tmp_path), "num_workers": 2,
                           "min_workers": None})  # fmt: skip
    saved = recorded_config(fewer.checkpointing)
    assert keep_global_batch(fewer.scaling, fewer.optim, saved, "run kept-run").accum_steps == 4
