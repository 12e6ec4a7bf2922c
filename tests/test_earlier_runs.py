"""Runs made before the redesign (issue 26) continue after it: a checkpoint and a run
record written by ray_ddp at d86bdea (tests/data, made by that commit's own save_state and
write_record, testing-aid fields and all) load, check, restore and guard re-runs as they
did. No Ray: the restore is the worker's own, on a model and optimizer built here."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from ray_ddp.checkpoint.format import check_compatible, load_model, load_state, saved_config
from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.driver.elastic import keep_global_batch
from ray_ddp.driver.rerun_guard import RECORD_FILE, check_rerun, recorded_config
from ray_ddp.image_classification.models import build_model
from ray_ddp.worker.identity import Worker
from ray_ddp.worker.optim import build_optimizer, build_scheduler
from ray_ddp.worker.precision import grad_scaler
from ray_ddp.worker.resume import Restored, restore_training
from ray_ddp.worker.state import TrainState

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CHECKPOINT = os.path.join(DATA, "checkpoint_d86bdea")
# The run's flags then: what a re-run gives again.
FLAGS = dict(model="small_cnn", num_workers=2, batch_size=32, epochs=3, seed=7, lr=0.01,
             augment="none", checkpoint_every=5)  # fmt: skip


def test_an_earlier_checkpoint_loads_checks_and_restores():
    state = load_state(CHECKPOINT)
    assert "stall_step" in state["config"]  # an earlier config, with its testing aids
    cfg = saved_config(state)
    assert (cfg.model, cfg.lr, cfg.seed, cfg.batch_size) == ("small_cnn", 0.01, 7, 32)
    facts = {"model": "small_cnn", "num_classes": 10, "input_shape": [3, 16, 16]}
    check_compatible(state, {"task": cfg.task, "facts": facts}, "the checkpoint")
    model = load_model(CHECKPOINT)  # the built-in task, by the spec it recorded
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state["model"].items())

    now = TrainConfig(**FLAGS)
    net = build_model("small_cnn", (3, 16, 16), 10)
    optimizer = build_optimizer(now, net.parameters())
    train = TrainState(
        net,
        optimizer,
        build_scheduler(now, optimizer, 100),
        grad_scaler("off", torch.device("cpu")),
    )
    worker = Worker(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))
    restore_training(Restored(state, CHECKPOINT), train, worker, now, steps_per_epoch=10)
    assert (train.progress.epoch, train.progress.sample, train.progress.step) == (1, 160, 8)
    assert train.scheduler.last_epoch == 3  # the optimizer steps it had taken
    assert set(train.optimizer.state_dict()["state"]) == set(state["optimizer"]["state"])


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
    kept = keep_global_batch(fewer, recorded_config(fewer), "run old")
    assert kept.accum_steps == 2 and kept.global_batch_size == 64
