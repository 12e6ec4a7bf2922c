"""A named run's recorded config: what a re-run may change and what it may not."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.config.fields import flag_of
from ray_ddp.driver.rerun_guard import RECORD_FILE, RESUME_SAFE, check_rerun, write_record


def test_rerun_may_extend_and_relocate_but_not_change_training(tmp_path):
    cfg = TrainConfig(storage_path=str(tmp_path), name="r", num_workers=2, lr=0.01)
    check_rerun(cfg)  # nothing recorded yet
    write_record(cfg)
    assert json.loads((tmp_path / "r" / RECORD_FILE).read_text())["lr"] == 0.01
    assert os.listdir(tmp_path / "r") == [RECORD_FILE]  # no temp file left behind

    for fine in (
        {"epochs": 20},
        {"max_failures": 3, "checkpoint_every": 50},
        {"num_workers": None},
        {"num_workers": 1, "accum_steps": 2},  # the same global batch on fewer workers
    ):
        check_rerun(dataclasses.replace(cfg, **fine))
    for changed, flag in (
        ({"lr": 0.1}, "--lr 0.01 -> 0.1"),
        ({"num_workers": 4}, "global batch 128 -> 256"),
        ({"accum_steps": 2}, "global batch 128 -> 256"),
    ):
        with pytest.raises(ConfigError, match=flag):
            check_rerun(cfg.replace(**changed))
    check_rerun(cfg.replace(lr=0.1, allow_config_change=True))


# Before the list was derived from the field definitions it was written out by hand; the
# derivation must keep it (``extra`` became the three typed fields at the end).
HAND_WRITTEN = {
    "epochs", "max_steps", "address", "use_gpu", "cpus_per_worker", "placement_strategy",
    "max_failures", "download", "loader_workers", "pin_memory", "storage_path", "name",
    "resume_from", "restart_epoch", "keep_checkpoints", "checkpoint_every", "summary_json",
    "progress_interval_s", "tensorboard", "log_every_steps", "log_all_ranks", "export",
    "comm_stats", "allow_config_change", "log_prefix",
    # Added since: how long to wait for an autoscaling cluster changes nothing trained.
    "wait_for_resources",
    # Which nodes' resources the workers ask for (where they run), not what is trained.
    "resources_per_worker",
    # Issue 15: the global batch is what is trained (compared on its own), not the worker
    # count or the accumulation that make it; elastic settings.
    "num_workers", "accum_steps", "min_workers", "resize_check_s",
    # Issue 16: when a rank counts as hung.
    "hang_timeout", "hang_grace",
    # Issue 17: how many unreadable samples to skip. Issue 18: compiling changes how the
    # same steps run, not what they compute. (The testing aids listed here until issue 25
    # are no config fields any more: ray_ddp.testing's Harness.)
    "max_bad_samples", "compile",
    # Issue 28: how checkpoints are written and how often a reclaim is asked about.
    "checkpoint_mode", "preemption_check_steps",
    # Issue 29: where the run is tracked and which steps are profiled.
    "tracking", "tracking_uri", "experiment", "profile_steps",
}  # fmt: skip


def test_resume_safety_is_read_from_the_field_definitions():
    marked = {f.name for f in TrainConfig.fields() if flag_of(f).resume_safe}
    assert RESUME_SAFE == marked == HAND_WRITTEN


def _other(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    return f"{value}-other"


def test_a_rerun_may_change_exactly_the_resume_safe_fields(tmp_path):
    cfg = TrainConfig(storage_path=str(tmp_path), name="r")
    # Unresolved (None) values are not compared: record a value for every field.
    cfg = dataclasses.replace(
        cfg, **{f.name: 1 for f in TrainConfig.fields() if cfg.value(f.name) is None}
    )
    write_record(cfg)
    for f in TrainConfig.fields():
        if f.name in ("name", "storage_path"):  # they say which record is read
            continue
        rerun = dataclasses.replace(cfg, **{f.name: _other(cfg.value(f.name))})
        if f.name in ("num_workers", "accum_steps"):  # they make the global batch
            with pytest.raises(ConfigError, match="global batch 64 -> 128"):
                check_rerun(rerun)
        elif f.name in RESUME_SAFE:
            check_rerun(rerun)
        else:
            with pytest.raises(ConfigError, match=f"--{f.name.replace('_', '-')} "):
                check_rerun(rerun)
