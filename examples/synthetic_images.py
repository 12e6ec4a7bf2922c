"""ImageNet-shaped images made on the training device: the GPU path measured without a data
pipeline (no decoding, no host-to-device copies of images), as a GPU vendor's benchmark
does. Each sample is an index; the loss looks its image up in a pool of random images
that lives on the device, and its label is the index modulo the class count.

    python jobs/train.py --task examples.synthetic_images:SyntheticImages --use-gpu \\
        --num-workers 1 --amp bf16 --batch-size 256 --max-steps 200

Settings: the environment variables ``SYNTHETIC_MODEL`` (a torchvision model, default
``resnet50``), ``SYNTHETIC_IMAGE_SIZE`` (default 224), ``SYNTHETIC_SAMPLES`` (training
samples per epoch, default 25600) and ``SYNTHETIC_CLASSES`` (default 1000), read when the
task is created on the driver (and then pickled to the workers with it).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ray_ddp import Sum, Task

POOL = 64
"""Distinct images on the device; sample ``i`` is image ``i % POOL``."""


class Indices(Dataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


class SyntheticImages(Task):
    best_metric, best_mode = "loss", "min"

    def __init__(self) -> None:
        self.arch = os.environ.get("SYNTHETIC_MODEL", "resnet50")
        self.size = int(os.environ.get("SYNTHETIC_IMAGE_SIZE", "224"))
        self.samples = int(os.environ.get("SYNTHETIC_SAMPLES", "25600"))
        self.classes = int(os.environ.get("SYNTHETIC_CLASSES", "1000"))
        self._pool: torch.Tensor | None = None

    def describe(self, cfg) -> dict[str, Any]:
        return {"model": self.arch, "image_size": self.size, "num_classes": self.classes}

    def datasets(self, cfg, facts):
        return Indices(cfg.data.train_samples or self.samples), Indices(cfg.data.val_samples or 512)

    def model(self, cfg, facts) -> nn.Module:
        import torchvision

        return getattr(torchvision.models, facts["model"])(num_classes=facts["num_classes"])

    def _inputs(self, model: nn.Module, batch: torch.Tensor):
        weight = next(model.parameters())
        if self._pool is None or self._pool.device != weight.device:
            generator = torch.Generator(device=weight.device).manual_seed(0)
            shape = (POOL, 3, self.size, self.size)
            self._pool = torch.randn(shape, generator=generator, device=weight.device)
        images = self._pool[batch % POOL]
        conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
        if conv is not None and conv.weight.is_contiguous(memory_format=torch.channels_last):
            images = images.contiguous(memory_format=torch.channels_last)
        return images, batch % self.classes

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        images, labels = self._inputs(model, batch)
        return F.cross_entropy(model(images).float(), labels)

    def metrics(self, model: nn.Module, batch: torch.Tensor) -> dict[str, Sum]:
        images, labels = self._inputs(model, batch)
        logits = model(images).float()
        return {
            "loss": Sum(F.cross_entropy(logits, labels, reduction="sum"), labels.numel()),
            "acc": Sum((logits.argmax(dim=1) == labels).sum(), labels.numel()),
        }

    def batch_size(self, batch: torch.Tensor) -> int:
        return len(batch)

    def example_inputs(self, cfg, facts) -> tuple:
        return (torch.zeros(2, 3, facts["image_size"], facts["image_size"]),)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pool": None}  # made again on each worker's device
