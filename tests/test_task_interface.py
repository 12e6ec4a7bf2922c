"""The task interface without Ray: a broken --task is refused before Ray starts with one
line naming what is wrong; the parts of the interface ray_ddp relies on behave as
documented (batch sizes, exact sums, optimizer groups)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.driver.cli import train_main
from ray_ddp.driver.preflight import preflight
from ray_ddp.task import Sum, Task
from ray_ddp.worker.evaluate import evaluate
from ray_ddp.worker.optim import (
    apply_hyperparameters,
    build_optimizer,
    build_scheduler,
    hyperparameters,
)

BROKEN = [
    ("no_such_module_xyz:Task", "cannot import no_such_module_xyz (ModuleNotFoundError"),
    ("task_import_error:Task", "cannot import task_import_error (RuntimeError: the task module"),
    ("broken_tasks.Good", "expected package.module:Name"),
    ("broken_tasks:Missing", "broken_tasks has no attribute 'Missing'"),
    ("broken_tasks:NoLoss", "NoLoss does not implement loss(), metrics() (see ray_ddp.Task)"),
    ("broken_tasks:NotATask", "is NotATask, not a ray_ddp.Task subclass or instance"),
    ("broken_tasks:NOT_A_TASK_INSTANCE", "is int, not a ray_ddp.Task subclass or instance"),
    ("broken_tasks:NeedsArguments", "NeedsArguments() failed (TypeError"),
    ("broken_tasks:ModelNotModule", "model() returned str, not a torch.nn.Module"),
    ("broken_tasks:LossNotScalar", "loss() returned (2,), not a scalar tensor"),
    ("broken_tasks:MetricsNotSums", "metrics() must return a dict of name -> ray_ddp.Sum"),
    ("broken_tasks:ShapeBug", "loss() fails on a batch of 2 samples (RuntimeError"),
    ("broken_tasks:EmptyVal", "task EmptyVal: the val split is empty"),
    ("broken_tasks:BadBest", "best_metric 'acc' is not among its metrics (loss)"),
    ("broken_tasks:FactsNotJson", "describe() must return plain JSON values"),
    ("broken_tasks:DataMissing", "datasets() failed (FileNotFoundError"),
]


@pytest.mark.parametrize(("spec", "message"), BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_task_exits_2_with_one_line_before_ray_starts(spec, message, tmp_path, capsys):
    runs = tmp_path / "runs"
    code = train_main(["--task", spec, "--storage-path", str(runs), "--num-workers", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and message in err, err
    assert "\n" not in err, err
    assert not runs.exists(), "nothing is written for a refused task"


def test_image_flags_with_a_task_of_your_own_are_refused_not_ignored(tmp_path, capsys):
    argv = ["--task", "broken_tasks:Good", "--model", "resnet18", "--storage-path", str(tmp_path)]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert "--model configures the built-in image classification" in err


def test_a_working_task_passes_with_its_sizes_and_a_named_instance_keeps_its_settings(tmp_path):
    prepared = preflight(TrainConfig(task="broken_tasks:Good", storage_path=str(tmp_path)))
    assert (prepared.train_size, prepared.val_size) == (16, 4)
    wide = preflight(TrainConfig(task="broken_tasks:WIDE", storage_path=str(tmp_path))).task
    assert wide.width == 8  # the module's instance, not a fresh class


def test_a_task_object_is_recorded_by_the_name_it_is_found_at():
    import broken_tasks

    from ray_ddp.task.loading import spec_of

    assert spec_of(broken_tasks.WIDE) == "broken_tasks:WIDE"  # the instance, with its width
    assert spec_of(broken_tasks.Good()) == "broken_tasks:Good"


def test_a_batch_too_large_for_a_custom_tasks_data_is_refused(tmp_path):
    cfg = TrainConfig(task="broken_tasks:Good", num_workers=2, batch_size=9, storage_path=".")
    with pytest.raises(ConfigError, match="larger than a worker's share of the 16 training"):
        preflight(cfg)


def test_the_batch_size_is_the_first_tensors_leading_dimension():
    task = _Counting()
    assert task.batch_size((torch.zeros(5, 3), torch.zeros(5))) == 5
    assert task.batch_size({"ids": torch.zeros(7, 2, dtype=torch.long)}) == 7
    with pytest.raises(TypeError, match="override batch_size"):
        task.batch_size({"name": "no tensors"})


class _Counting(Task):
    """Sums whose exact value is known: every sample's value, and a count of them."""

    def datasets(self, cfg, facts):
        values = torch.arange(10, dtype=torch.float32).unsqueeze(1)
        return values, values

    def model(self, cfg, facts):
        return nn.Identity()

    def loss(self, model, batch):
        return model(batch).mean()

    def metrics(self, model, batch):
        return {"loss": Sum(model(batch).sum(), batch.shape[0]), "big": Sum((batch > 4).sum(), 1)}

    def summarize(self, values):
        return {**values, "double": 2 * values["loss"]}


def test_evaluation_sums_each_metric_once_and_divides_once():
    """Batches of 3 over 10 samples: the mean is of the samples (4.5), not the mean of
    the batch means (4.875); a metric's own count is its denominator."""
    task = _Counting()
    values, _ = task.datasets(None, {})
    result = evaluate(nn.Identity(), DataLoader(values, batch_size=3), torch.device("cpu"), task)
    assert result.sums == {"loss": (45.0, 10.0), "big": (5.0, 4.0)}
    assert result.means == {"loss": 4.5, "big": 1.25}
    assert result.samples == 10
    assert task.summarize(result.means)["double"] == 9.0


def test_param_groups_keep_their_own_weight_decay_and_lr_scale_across_a_resume():
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    groups = [
        {"params": list(model[0].parameters())},
        {"params": list(model[1].parameters()), "weight_decay": 0.0, "lr_scale": 0.1},
    ]
    cfg = TrainConfig(lr=1e-2, weight_decay=0.05)
    optimizer = build_optimizer(cfg.optim, groups)
    assert [g["lr"] for g in optimizer.param_groups] == [1e-2, 1e-3]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    scheduler = build_scheduler(cfg.optim, optimizer, total_steps=10)
    saved = (optimizer.state_dict(), scheduler.state_dict())
    # The resumed run asks for another peak lr and decay: the task's own settings stay.
    new = TrainConfig(lr=2e-2, weight_decay=0.1)
    optimizer = build_optimizer(new.optim, groups)
    scheduler = build_scheduler(new.optim, optimizer, total_steps=10)
    fresh = hyperparameters(optimizer)
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    changes = apply_hyperparameters(new.optim, optimizer, scheduler, fresh)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert scheduler.base_lrs == pytest.approx([2e-2, 2e-3])
    assert "peak lr 0.01 -> 0.02" in changes and "weight decay 0.05 -> 0.1" in changes
