"""The built-in task: image classification (and feature-vector classification from
Parquet) on the datasets of ``--dataset`` with the models of ``--model``.

It is an ordinary :class:`ray_ddp.Task`: the training loop, evaluation and checkpoints
treat it exactly as they treat a task of yours. Its ``facts`` are the model name, the
class count and the input shape, which is all a checkpoint needs to rebuild the model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ray_ddp.config import TrainConfig
from ray_ddp.task import Batch, Sum, Task


class ImageClassification(Task):
    """Cross-entropy on class scores; accuracy as the metric that picks the best."""

    best_metric = "acc"
    best_mode = "max"

    def __init__(self) -> None:
        self._info: Any = None  # the driver's describe_dataset, reused by check()
        self.classes: list[str] | None = None  # class names, once datasets() has run

    def name(self, cfg: TrainConfig) -> str:
        return f"{cfg.data.dataset}-{cfg.target.model}"

    def describe(self, cfg: TrainConfig) -> dict[str, Any]:
        from ray_ddp.image_classification.datasets import describe_dataset
        from ray_ddp.image_classification.models import check_model_name

        check_model_name(cfg.target.model)
        self._info = describe_dataset(cfg.data, cfg.target)
        return {
            "model": cfg.target.model,
            "num_classes": self._info.num_classes,
            "input_shape": list(self._info.input_shape),
        }

    def check(self, cfg: TrainConfig, facts: dict[str, Any]) -> tuple[int, int]:
        """The data's files and sizes (``describe``), and whether the model runs on its
        images (a shapes-only forward on the meta device); no dataset is loaded."""
        from ray_ddp.image_classification.probe import check_model_runs

        resizable = cfg.data.dataset != "synthetic"  # the built-in data has one size
        check_model_runs(
            cfg.target.model, tuple(facts["input_shape"]), facts["num_classes"], resizable
        )
        if self._info is None:
            self.describe(cfg)
        return self._info.train_size, self._info.val_size

    def datasets(self, cfg: TrainConfig, facts: dict[str, Any]) -> tuple[Dataset, Dataset]:
        from ray_ddp.image_classification.datasets import build_datasets

        # ``augment="none"`` (jobs/evaluate.py sets it to evaluate the train split) makes
        # the training transform the evaluation one.
        train, val, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
        names = getattr(getattr(val, "dataset", val), "classes", None)
        self.classes = [str(n) for n in names] if names is not None else None
        return train, val

    def model(self, cfg: TrainConfig, facts: dict[str, Any]) -> nn.Module:
        from ray_ddp.image_classification.models import build_model

        return build_model(facts["model"], tuple(facts["input_shape"]), facts["num_classes"])

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(model(inputs).float(), targets)

    def metrics(self, model: nn.Module, batch: Batch) -> dict[str, Sum]:
        inputs, targets = batch
        logits = model(inputs).float()
        return {
            "loss": Sum(F.cross_entropy(logits, targets, reduction="sum"), targets.numel()),
            "acc": Sum((logits.argmax(dim=1) == targets).sum(), targets.numel()),
        }

    def evaluation_metrics(self, model: nn.Module, batch: Batch) -> dict[str, Sum]:
        """Loss and accuracy, and accuracy per class (``acc/<class name>``)."""
        inputs, targets = batch
        logits = model(inputs).float()
        hit = (logits.argmax(dim=1) == targets).double()
        classes = logits.shape[1]
        correct = torch.bincount(targets, weights=hit, minlength=classes)
        count = torch.bincount(targets, minlength=classes)
        names = self.classes if self.classes and len(self.classes) == classes else None
        sums = {
            "loss": Sum(F.cross_entropy(logits, targets, reduction="sum"), targets.numel()),
            "acc": Sum(hit.sum(), targets.numel()),
        }
        for c in range(classes):
            sums[f"acc/{names[c] if names else c}"] = Sum(correct[c], count[c])
        return sums

    def predictions(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        inputs, targets = batch
        probabilities = model(inputs).float().softmax(dim=1)
        confidence, predicted = probabilities.max(dim=1)
        return {"label": targets, "predicted": predicted, "confidence": confidence}

    def random_samples(self, cfg: TrainConfig) -> bool:
        from ray_ddp.image_classification.transforms import has_random_transform

        return has_random_transform(cfg.data)

    def example_inputs(self, cfg: TrainConfig, facts: dict[str, Any]) -> tuple:
        return (torch.zeros(2, *facts["input_shape"]),)

    def __getstate__(self) -> dict[str, Any]:
        # The driver's dataset description stays on the driver.
        return {**self.__dict__, "_info": None}
