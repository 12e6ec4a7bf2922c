"""Tasks that are wrong in one way each, for the --task refusal tests (and one that is
right, to change one thing at a time)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from ray_ddp import Sum, Task


class Good(Task):
    """Linear regression on 16 generated samples of 3 features."""

    def datasets(self, cfg, facts):
        x = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
        y = x.sum(dim=1, keepdim=True)
        return TensorDataset(x, y), TensorDataset(x[:4], y[:4])

    def model(self, cfg, facts):
        return nn.Linear(3, 1)

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x).float(), y)

    def metrics(self, model, batch):
        x, y = batch
        return {"loss": Sum(((model(x).float() - y) ** 2).sum(), y.numel())}


class NoLoss(Task):  # loss() and metrics() missing
    def datasets(self, cfg, facts):
        return Good().datasets(cfg, facts)

    def model(self, cfg, facts):
        return nn.Linear(3, 1)


class NotATask:  # the right methods, but not a ray_ddp.Task
    def loss(self, model, batch):
        return 0.0


class ModelNotModule(Good):
    def model(self, cfg, facts):
        return "linear"


class LossNotScalar(Good):
    def loss(self, model, batch):
        x, y = batch
        return (model(x) - y).pow(2).squeeze(1)  # per sample, not the mean


class MetricsNotSums(Good):
    def metrics(self, model, batch):
        return 0.5


class ShapeBug(Good):
    def model(self, cfg, facts):
        return nn.Linear(4, 1)  # the data has 3 features


class EmptyVal(Good):
    def datasets(self, cfg, facts):
        train, _ = super().datasets(cfg, facts)
        return train, TensorDataset(torch.zeros(0, 3), torch.zeros(0, 1))


class BadBest(Good):
    best_metric = "acc"


class FactsNotJson(Good):
    def describe(self, cfg):
        return {"features": torch.tensor(3)}


class DataMissing(Good):
    def datasets(self, cfg, facts):
        with open("/nonexistent/ray_ddp/train.bin", "rb") as f:
            return f.read(), None


class NeedsArguments(Good):
    def __init__(self, width: int):
        self.width = width


NOT_A_TASK_INSTANCE = 42
WIDE = NeedsArguments(width=8)  # an instance is named, so it needs no arguments


class SampleBug(Good):
    """Good's regression, with a bug in its training set's code at one sample (a KeyError):
    not an unreadable sample to skip, an error that must stop the run."""

    def datasets(self, cfg, facts):
        train, val = super().datasets(cfg, facts)
        return _BugAt(train, index=5), val


class _BugAt(torch.utils.data.Dataset):
    def __init__(self, dataset, index: int) -> None:
        self.dataset, self.index = dataset, index

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        if index == self.index:
            return {"x": 1}["label"]
        return self.dataset[index]
