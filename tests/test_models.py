"""Models by name: the default small ResNet fits any image size and channel count and has
normalisation layers; small_cnn stays free of them (the accumulation-equivalence test needs
an update from k micro-batches to equal one from a k-times larger batch)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.image_classification.models import (
    BUILTIN_MODELS,
    build_model,
    check_model_name,
    needs_rgb,
)

NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


def test_the_default_model_is_the_small_resnet():
    assert TrainConfig().target.model == "small_resnet"
    assert "small_resnet" in BUILTIN_MODELS and not needs_rgb("small_resnet")
    check_model_name("small_resnet")


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("size", [2, 4, 5, 8, 16, 28, 32, 64])
def test_small_resnet_builds_for_any_channels_and_size(channels, size):
    torch.manual_seed(0)
    model = build_model("small_resnet", (channels, size, size), 7)
    x = torch.randn(3, channels, size, size)
    assert model(x).shape == (3, 7)
    model.eval()
    assert model(x[:1]).shape == (1, 7)
    # A last micro-batch of one sample still trains (BN has H x W values per channel).
    model.train()
    model(torch.randn(1, channels, size, size)).sum().backward()


def test_small_resnet_normalises_and_trains_its_norm_layers():
    model = build_model("small_resnet", (3, 16, 16), 10)
    norms = [m for m in model.modules() if isinstance(m, NORMS)]
    assert len(norms) >= 7  # stem, two per block, the shortcuts that change shape
    assert any(isinstance(m, nn.Conv2d) for m in model.modules())
    residual = [m for m in model.modules() if type(m).__name__ == "ResidualBlock"]
    assert len(residual) == 3
    # Initial weights follow the seed only (identical on every rank).
    torch.manual_seed(4)
    a = build_model("small_resnet", (3, 16, 16), 10).state_dict()
    torch.manual_seed(4)
    b = build_model("small_resnet", (3, 16, 16), 10).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_small_cnn_stays_free_of_normalisation():
    model = build_model("small_cnn", (3, 16, 16), 10)
    assert not [m for m in model.modules() if isinstance(m, NORMS)]
    assert not [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert not any(b.numel() for b in model.buffers())  # no running statistics


def test_small_resnet_exports_for_inference_without_ray():
    """What ``export.py`` does with the best checkpoint: ``torch.export`` with a dynamic
    batch dimension, in eval mode (running statistics, no batch dependence)."""
    model = build_model("small_resnet", (1, 32, 32), 10).eval()
    example = torch.randn(2, 1, 32, 32)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: torch.export.Dim.AUTO},))
    x = torch.randn(5, 1, 32, 32)
    assert torch.allclose(program.module()(x), model(x), atol=1e-5)


def test_feature_vectors_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="use --model mlp"):
        build_model("small_resnet", (20,), 3)
