"""Checkpoint contents, atomic writes and weights_only loading (no Ray needed)."""

from __future__ import annotations

import pytest
import torch

from ray_ddp.checkpoint.format import (
    STATE_FILE,
    CheckpointError,
    check_compatible,
    load_model,
    load_state,
    save_state,
    task_meta,
    unwrap,
)
from ray_ddp.config import BUILTIN_TASK, TrainConfig
from ray_ddp.image_classification.models import build_model
from ray_ddp.worker.optim import build_optimizer, build_scheduler
from ray_ddp.worker.precision import grad_scaler
from ray_ddp.worker.state import TrainProgress, TrainState

META = task_meta(
    BUILTIN_TASK, {"model": "small_cnn", "num_classes": 10, "input_shape": [3, 16, 16]}
)


def _write(directory: str, compiled: bool = False) -> torch.nn.Module:
    cfg = TrainConfig()
    model = build_model("small_cnn", (3, 16, 16), 10)
    optimizer = build_optimizer(cfg.optim, model.parameters())
    scheduler = build_scheduler(cfg.optim, optimizer, total_steps=50)
    # --compile trains torch.compile's wrapper (here with the eager backend: the wrapper,
    # not the generated code, is what a checkpoint could carry into its keys).
    trained = torch.compile(model, backend="eager") if compiled else model
    trained(torch.randn(4, 3, 16, 16)).sum().backward()
    optimizer.step()
    scheduler.step()
    state = TrainState(
        trained,
        optimizer,
        scheduler,
        grad_scaler("off", torch.device("cpu")),
        TrainProgress(epoch=3, step=42, best_score=0.5),
    )
    save_state(
        directory,
        state,
        config=cfg.to_dict(),
        task_meta=META,
        world_size=2,
    )
    return model


def test_full_state_round_trips_with_weights_only(tmp_path):
    model = _write(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]  # no temp file left
    state = load_state(str(tmp_path))
    assert state["progress"] == {
        "epoch": 3, "sample": 0, "step": 42, "best_score": 0.5, "order": None,
        "bad_samples": 0, "bad_sample_rows": None, "tracking_run": None, "tracked_since": 0,
    }  # fmt: skip
    assert state["optimizer"]["state"], "AdamW moments are saved"
    assert state["scheduler"]["last_epoch"] == 1
    assert state["config"]["lr"] == TrainConfig().optim.lr
    assert state["world_size"] == 2
    assert not any(k.startswith("module.") for k in state["model"])
    fresh = load_model(str(tmp_path))  # a plain model, no DDP, no Ray
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)


def test_a_compiled_models_checkpoint_loads_into_a_plain_model_and_back(tmp_path):
    model = _write(str(tmp_path), compiled=True)
    state = load_state(str(tmp_path))
    assert not any("_orig_mod" in k for k in state["model"]), list(state["model"])[:3]
    fresh = load_model(str(tmp_path))  # plain
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    # A compiled model's own load_state_dict wants "_orig_mod." keys: weights go into the
    # model inside (as a resume does, before wrapping it).
    again = torch.compile(build_model("small_cnn", (3, 16, 16), 10), backend="eager")
    unwrap(again).load_state_dict(state["model"])
    assert torch.equal(again(torch.ones(1, 3, 16, 16)), fresh(torch.ones(1, 3, 16, 16)))


def test_not_a_checkpoint_and_corrupt_file_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="is not a ray_ddp checkpoint"):
        load_state(str(tmp_path))
    (tmp_path / STATE_FILE).write_bytes(b"\x80\x02 truncated")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_state(str(tmp_path))


def test_a_different_model_is_refused(tmp_path):
    _write(str(tmp_path))
    state = load_state(str(tmp_path))
    check_compatible(state, META, "ckpt")
    other = {**META, "facts": {**META["facts"], "num_classes": 3}}
    with pytest.raises(CheckpointError, match="num_classes=10, this run has num_classes=3"):
        check_compatible(state, other, "ckpt")
    with pytest.raises(CheckpointError, match="saved by task .*ImageClassification, this run"):
        check_compatible(state, {**META, "task": "examples.char_lm:CharLM"}, "ckpt")


def test_a_checkpoint_from_before_tasks_still_loads(tmp_path):
    """Checkpoints written before the task interface held the classifier's facts under
    ``model_meta``: they resume and load as the built-in task's."""
    model = _write(str(tmp_path))
    state = load_state(str(tmp_path))
    state["model_meta"] = state.pop("task_meta")["facts"]
    torch.save(state, tmp_path / STATE_FILE)
    check_compatible(load_state(str(tmp_path)), META, "ckpt")
    fresh = load_model(str(tmp_path))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
