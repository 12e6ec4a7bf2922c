"""Model construction by name: a small CNN, an MLP, or any torchvision classifier."""

from __future__ import annotations

import math

import torch
from torch import nn

from ray_ddp.config import ConfigError

BUILTIN_MODELS = ("small_cnn", "mlp")


class SmallCNN(nn.Module):
    """Three conv layers and a linear head: trains in seconds per epoch on one CPU core.

    It has no BatchNorm and no dropout on purpose: an update from k accumulated
    micro-batches of b samples is then exactly the update from one batch of k*b samples,
    which the tests check.
    """

    def __init__(self, in_channels: int, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class MLP(nn.Module):
    """Flattens its input; for feature vectors (Parquet feature columns) or tiny images."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def torchvision_model_names() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def needs_rgb(model_name: str) -> bool:
    """torchvision classifiers take 3-channel input; grey images are repeated to 3."""
    return model_name not in BUILTIN_MODELS


def check_model_name(model_name: str) -> None:
    """Refuse an unknown model before any cluster work, naming a few that exist."""
    if model_name in BUILTIN_MODELS:
        return
    names = torchvision_model_names()
    if model_name not in names:
        raise ConfigError(
            f"unknown --model {model_name!r}; use small_cnn, mlp or a torchvision "
            f"classification model such as resnet18, mobilenet_v3_small, efficientnet_b0 "
            f"({len(names)} available)"
        )


def build_model(model_name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A freshly initialised model (no pretrained weights: nothing is downloaded).

    ``input_shape`` is one sample's shape without the batch dimension: (C, H, W) for
    images, (F,) for feature vectors.
    """
    check_model_name(model_name)
    if model_name == "mlp":
        return MLP(math.prod(input_shape), num_classes)
    if len(input_shape) != 3:
        raise ConfigError(
            f"--model {model_name} needs image input, the data has shape {input_shape}; "
            "use --model mlp for feature vectors"
        )
    if model_name == "small_cnn":
        return SmallCNN(input_shape[0], num_classes)
    import torchvision

    return torchvision.models.get_model(model_name, weights=None, num_classes=num_classes)
