"""A named run's recorded config: what a re-run may change and what it may not."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.run_record import RECORD_FILE, check_rerun, write_record


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
    ):
        check_rerun(dataclasses.replace(cfg, **fine))
    for changed, flag in (({"lr": 0.1}, "--lr 0.01 -> 0.1"), ({"num_workers": 4}, "--num-workers")):
        with pytest.raises(ConfigError, match=flag):
            check_rerun(dataclasses.replace(cfg, **changed))
    check_rerun(dataclasses.replace(cfg, lr=0.1, allow_config_change=True))
