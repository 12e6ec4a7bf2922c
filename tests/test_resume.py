"""Restoring a checkpoint's training state into a new run (no Ray cluster needed): the
flags win over the saved hyperparameters, another world size continues the same schedule
and says how the global batch is kept, another global batch continues the schedule at the
epochs done, and a precision change does not crash the scaler."""

from __future__ import annotations

import pytest
import torch

from ray_ddp.config import TrainConfig
from ray_ddp.image_classification.models import build_model
from ray_ddp.worker.identity import Worker
from ray_ddp.worker.optim import build_optimizer, build_scheduler, lr_factor
from ray_ddp.worker.precision import grad_scaler
from ray_ddp.worker.resume import Restored, restore_training
from ray_ddp.worker.state import TrainProgress, TrainState

STEPS_PER_EPOCH = 10


def _state(cfg: TrainConfig, scaler: torch.amp.GradScaler | None = None) -> TrainState:
    model = build_model("small_cnn", (3, 16, 16), 10)
    optimizer = build_optimizer(cfg.optim, model.parameters())
    scheduler = build_scheduler(cfg.optim, optimizer, STEPS_PER_EPOCH * cfg.optim.epochs)
    return TrainState(
        model, optimizer, scheduler, scaler or grad_scaler("off", torch.device("cpu"))
    )


def _saved(cfg: TrainConfig, epochs_done: int, world: int) -> Restored:
    """What a checkpoint holds after ``epochs_done`` epochs of ``cfg`` on ``world`` ranks."""
    state = _state(cfg)
    for _ in range(epochs_done * STEPS_PER_EPOCH):
        state.optimizer.step()
        state.scheduler.step()
    progress = TrainProgress(epoch=epochs_done, step=epochs_done * STEPS_PER_EPOCH)
    return Restored(
        {
            "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "scaler": state.scaler.state_dict(),
            "progress": progress.__dict__,
            "config": cfg.to_dict(),
            "world_size": world,
            "epoch_partial": [[0.0, 0]] * world,
        },
        "saved-checkpoint",
    )


def _worker(world: int = 2) -> Worker:
    return Worker(rank=0, local_rank=0, world_size=world, device=torch.device("cpu"))


def test_the_flags_hyperparameters_replace_the_saved_ones_and_are_named(capsys):
    old = TrainConfig(lr=3e-3, weight_decay=0.01, optimizer="sgd", momentum=0.9, epochs=4)
    new = TrainConfig(lr=1e-5, weight_decay=0.05, optimizer="sgd", momentum=0.5, epochs=4)
    old.scaling.num_workers = new.scaling.num_workers = 2
    state = _state(new)
    restore_training(
        _saved(old, 2, world=2), state, _worker(), new.optim, new.global_batch_size, STEPS_PER_EPOCH
    )
    group = state.optimizer.param_groups[0]
    # Half way through the schedule (20 of 40 steps), at the new peak lr.
    assert group["lr"] == pytest.approx(1e-5 * lr_factor(20, 2, 40, new.optim.min_lr_ratio))
    assert (group["weight_decay"], group["momentum"]) == (0.05, 0.5)
    line = capsys.readouterr().out
    assert "peak lr 0.003 -> 1e-05 (from the flags)" in line
    assert "weight decay 0.01 -> 0.05" in line and "momentum 0.9 -> 0.5" in line


def test_an_unchanged_config_resumes_with_the_saved_lr_to_the_bit():
    cfg = TrainConfig(epochs=4, num_workers=2)
    restored = _saved(cfg, 1, world=2)
    state = _state(cfg)
    restore_training(restored, state, _worker(), cfg.optim, cfg.global_batch_size, STEPS_PER_EPOCH)
    saved_lr = restored.state["optimizer"]["param_groups"][0]["lr"]
    assert state.optimizer.param_groups[0]["lr"] == saved_lr
    assert state.scheduler.last_epoch == STEPS_PER_EPOCH


@pytest.mark.parametrize(
    ("saved_world", "world", "words"), [(2, 1, "lost 1 worker"), (2, 4, "gained 2 workers")]
)
def test_another_world_size_continues_the_same_schedule_and_says_so(
    saved_world, world, words, capsys
):
    """The global batch is kept across world sizes, so the steps per epoch, the schedule
    and the saved lr carry on unchanged; the line says what changed."""
    cfg = TrainConfig(epochs=10, num_workers=4, batch_size=8)
    restored = _saved(cfg, 5, world=saved_world)
    state = _state(cfg)
    restore_training(
        restored, state, _worker(world), cfg.optim, cfg.global_batch_size, STEPS_PER_EPOCH
    )
    assert state.scheduler.last_epoch == 5 * STEPS_PER_EPOCH
    saved_lr = restored.state["optimizer"]["param_groups"][0]["lr"]
    assert state.optimizer.param_groups[0]["lr"] == saved_lr
    line = capsys.readouterr().out
    accum = {1: 4, 2: 2, 4: 1}
    assert (
        f"{words} since the checkpoint: continuing on {world} "
        f"{'worker' if world == 1 else 'workers'}, accumulation "
        f"{accum[saved_world]} -> {accum[world]}, global batch 32 kept, same data order"
    ) in line


def test_another_global_batch_continues_the_schedule_at_the_epochs_done():
    """5 of 10 epochs done with a global batch of 64, continued (--allow-config-change)
    with 128: half as many steps per epoch, and the schedule resumes half way, not at the
    raw step count (which would put it at the end)."""
    saved_cfg = TrainConfig(epochs=10, num_workers=2, batch_size=32)
    cfg = TrainConfig(epochs=10, num_workers=2, batch_size=64)
    restored = _saved(saved_cfg, 5, world=2)
    steps_now = STEPS_PER_EPOCH // 2
    state = TrainState(*_scaled(cfg, steps_now * 10))
    restore_training(restored, state, _worker(2), cfg.optim, cfg.global_batch_size, steps_now)
    assert state.scheduler.last_epoch == 5 * steps_now
    warmup = max(1, round(0.05 * steps_now * 10))
    expected = cfg.optim.lr * lr_factor(
        5 * steps_now, warmup, steps_now * 10, cfg.optim.min_lr_ratio
    )
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(expected)


def _scaled(cfg: TrainConfig, total_steps: int):
    model = build_model("small_cnn", (3, 16, 16), 10)
    optimizer = build_optimizer(cfg.optim, model.parameters())
    return (
        model,
        optimizer,
        build_scheduler(cfg.optim, optimizer, total_steps),
        grad_scaler("off", torch.device("cpu")),
    )


def test_fp16_resumes_a_checkpoint_saved_without_a_scaler(capsys):
    """An off/bf16 run saves a disabled scaler's empty state, which an enabled GradScaler
    refuses; the fp16 run starts from the initial loss scale instead of crashing."""
    cfg = TrainConfig(epochs=2, num_workers=2)
    restored = _saved(cfg, 1, world=2)
    assert restored.state["scaler"] == {}
    enabled = torch.amp.GradScaler("cpu", enabled=True)
    with pytest.raises(RuntimeError):  # what every worker hit before
        torch.amp.GradScaler("cpu", enabled=True).load_state_dict({})
    restore_training(
        restored, _state(cfg, enabled), _worker(), cfg.optim, cfg.global_batch_size, STEPS_PER_EPOCH
    )
    assert enabled.get_scale() == 2.0**16
    assert "fp16 starts from the initial loss scale" in capsys.readouterr().out
