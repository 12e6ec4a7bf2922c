import re

import pytest

from ray_ddp.config import ConfigError, TrainConfig, validate
from ray_ddp.optim import default_warmup, lr_factor


def test_defaults_are_valid():
    validate(TrainConfig())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lr": 0.0}, "--lr must be positive"),
        ({"batch_size": -4}, "--batch-size must be positive"),
        ({"epochs": 0}, "--epochs must be positive"),
        ({"accum_steps": 0}, "--accum-steps must be positive"),
        ({"dataset": "imagenet"}, "unknown --dataset 'imagenet'"),
        ({"amp": "fp8"}, "unknown --amp 'fp8'"),
        ({"amp": "fp16", "use_gpu": False}, "--amp fp16 needs GPUs"),
        ({"dataset": "cifar10"}, "--dataset cifar10 needs --data-dir"),
        ({"name": "a/b"}, "--name must be a plain directory name"),
        ({"momentum": 1.0}, "--momentum must be in [0, 1)"),
    ],
)
def test_bad_values_are_refused_with_the_flag_named(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(TrainConfig(**change))


def test_round_trip_through_the_dict_ray_passes():
    cfg = TrainConfig(lr=0.1, accum_steps=3, num_workers=2)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.global_batch_size == cfg.batch_size * 2 * 3
    with pytest.raises(ConfigError, match="unknown config keys: bogus"):
        TrainConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_warmup_then_cosine():
    total, warmup = 100, 10
    factors = [lr_factor(s, warmup, total, 0.01) for s in range(total + 5)]
    assert factors[0] == pytest.approx(0.1)
    assert factors[warmup - 1] == pytest.approx(1.0)  # peak at the end of warm-up
    assert all(a <= b for a, b in zip(factors[:warmup], factors[1:warmup], strict=False))
    decay = factors[warmup:total]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
    assert factors[total] == pytest.approx(0.01)  # floor reached, then flat
    assert factors[-1] == pytest.approx(0.01)
    assert default_warmup(1000) == 50 and default_warmup(3) == 1
