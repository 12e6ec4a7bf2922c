"""Model construction by name: a small ResNet, a small CNN, an MLP, or any torchvision
classifier."""

from __future__ import annotations

import math

import torch
from torch import nn

from ray_ddp.config import ConfigError

BUILTIN_MODELS = ("small_resnet", "small_cnn", "mlp")


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


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, added to the input (through a strided 1x1
    convolution where the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """The default model: a 3x3 stem and three residual stages (widths w, 2w, 4w; the last
    two halve the resolution), BatchNorm after every convolution, global average pooling
    and a linear head. Any image size and channel count (images under 8 pixels are not
    downsampled further).

    BatchNorm is what lets it train in the few hundred steps a small real dataset gives,
    where small_cnn (no normalisation) is still far from converged: 1,437 handwritten
    digits, 15 epochs, see ``benchmarks/results/default_model.md``. Width 16 runs at
    small_cnn's speed on CPU (about 4,300 samples/s on one thread at 16x16, 900 at 32x32;
    widths 24 and 32 ran 2.5x and 3x slower). The last BN of each block starts at the usual
    scale 1, not 0: zero-initialised, a one-process run on the digits (Parquet, 15 epochs)
    reached 92% instead of 99%.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        width: int = 16,
        blocks: int = 1,
        image_size: int | None = None,
    ) -> None:
        super().__init__()
        widths = (width, 2 * width, 4 * width)
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        layers: list[nn.Module] = []
        channels = width
        size = image_size or 32
        for stage, out in enumerate(widths):
            for block in range(blocks):
                # Halve the resolution only down to 4 pixels: BatchNorm in training needs
                # more than one value per channel, and a last micro-batch may be 1 sample.
                stride = 2 if stage > 0 and block == 0 and size >= 8 else 1
                size = -(-size // stride)
                layers.append(ResidualBlock(channels, out, stride))
                channels = out
        self.stages = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


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
            f"unknown --model {model_name!r}; use small_resnet, small_cnn, mlp or a torchvision "
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
    if model_name == "small_resnet":
        return SmallResNet(input_shape[0], num_classes, image_size=min(input_shape[1:]))
    if model_name == "small_cnn":
        return SmallCNN(input_shape[0], num_classes)
    import torchvision

    return torchvision.models.get_model(model_name, weights=None, num_classes=num_classes)
