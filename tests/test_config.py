import copy
import dataclasses
import pickle
import re

import pytest

from ray_ddp.config import ConfigError, TrainConfig, validate
from ray_ddp.config.batch import global_batch
from ray_ddp.config.fields import flag_of
from ray_ddp.config.sections import Optimisation
from ray_ddp.config.sweep import SweepConfig, validate_sweep
from ray_ddp.config.train import FlatFieldWarning
from ray_ddp.worker.optim import default_warmup, lr_factor


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
    assert cfg.global_batch_size == cfg.optim.batch_size * 2 * 3
    with pytest.raises(ConfigError, match="unknown config keys: bogus"):
        TrainConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_testing_aids_are_no_config_and_old_configs_holding_them_still_load():
    """Faults and ledgers are a test's (ray_ddp.testing.Harness): not fields, flags or saved
    config. A config saved before (a sweep's trials, a run's record) still loads."""
    names = {f.name for f in TrainConfig.fields()}
    aids = ("inject_nan", "stall", "slow_", "hang_loader", "ledger")
    assert not [name for name in names if name.startswith(aids)]
    old = {**TrainConfig(lr=0.1).to_dict(), "stall_step": 13, "sample_ledger": True}
    assert TrainConfig.from_dict(old) == TrainConfig(lr=0.1)


def test_fields_are_read_from_their_sections_and_given_flat():
    cfg = TrainConfig(lr=0.1, num_workers=3, optim=Optimisation(epochs=2))
    assert (cfg.optim.lr, cfg.optim.epochs, cfg.scaling.num_workers) == (0.1, 2, 3)
    assert TrainConfig.section_of("lr") == "optim" and cfg.value("num_workers") == 3
    again = cfg.replace(lr=0.2, storage_path="elsewhere")
    assert (again.optim.lr, again.optim.epochs, again.checkpointing.storage_path) == (
        0.2, 2, "elsewhere")  # fmt: skip
    assert again.optim is not cfg.optim and cfg.optim.lr == 0.1  # a copy, not a view
    # dataclasses.replace goes through the same flat keywords (code written before sections)
    assert dataclasses.replace(cfg, lr=0.2, storage_path="elsewhere") == again  # flat on purpose
    with pytest.raises(TypeError, match="no field bogus"):
        cfg.replace(bogus=1)
    # The flat fallback (below) leaves copying and pickling alone.
    assert pickle.loads(pickle.dumps(cfg)) == cfg == copy.deepcopy(cfg)
    assert not hasattr(cfg, "bogus")


def test_a_flat_read_of_earlier_code_still_works_with_a_warning():
    # Users' tasks written before the sections read a flat field: it still answers, and
    # the warning names the read to write instead. (The suite makes the warning an error.)
    old = TrainConfig(batch_size=16)
    with pytest.warns(FlatFieldWarning, match=r"TrainConfig\.optim\.batch_size"):
        assert old.batch_size == 16  # flat on purpose
    with pytest.warns(FlatFieldWarning, match=r"TrainConfig\.optim\.lr"):
        old.lr = 0.5  # flat on purpose
    assert old.optim.lr == 0.5 and "lr" not in vars(old)  # set in its section, no stray copy
    with pytest.raises(AttributeError, match="no field 'bogus'"):
        old.bogus  # noqa: B018  # flat on purpose
    with pytest.raises(AttributeError):
        old.bogus = 1  # flat on purpose


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


@pytest.mark.parametrize(
    "f",
    [f for f in TrainConfig.fields() if flag_of(f).bound or flag_of(f).choices],
    ids=lambda f: f.name,
)
def test_each_stated_limit_is_refused_naming_the_fields_flag(f):
    facts = flag_of(f)
    if facts.choices:
        value, expected = "bogus", f"unknown --{f.name.replace('_', '-')} 'bogus'; choose one of: "
    else:
        value = next(v for v in (-5, -1, 0, 0.5, 1, 2) if not facts.bound.ok(v))
        expected = f"--{f.name.replace('_', '-')} {facts.bound.text}, got {value}"
    with pytest.raises(ConfigError) as refused:
        validate(dataclasses.replace(TrainConfig(), **{f.name: value}))
    assert str(refused.value).startswith(expected)


def test_global_batch_is_one_formula():
    assert global_batch(64, 2, 3) == 384
    assert TrainConfig(batch_size=64, num_workers=2, accum_steps=3).global_batch_size == 384
    with pytest.raises(ValueError, match="num_workers is not resolved"):
        _ = TrainConfig().global_batch_size


def test_default_sweep_is_valid():
    validate_sweep(SweepConfig(), TrainConfig())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lr_min": 0.0}, "need 0 < --lr-min <= --lr-max, got 0 and 0.01"),
        ({"lr_min": 0.1}, "need 0 < --lr-min <= --lr-max, got 0.1 and 0.01"),
        ({"batch_sizes": []}, "--batch-sizes must be a list of positive integers"),
        ({"batch_sizes": [32, 0]}, "--batch-sizes must be a list of positive integers"),
        ({"num_samples": 0}, "--num-samples must be positive, got 0"),
        ({"max_concurrent_trials": 0}, "--max-concurrent-trials must be positive"),
        ({"grace_period": 11}, "--grace-period must be in 1..--epochs (10)"),
        ({"reduction_factor": 1.0}, "--reduction-factor must be greater than 1"),
        ({"resume": True}, "--resume needs the --name of the sweep to continue"),
    ],
)
def test_bad_sweeps_are_refused_with_the_flag_named(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_sweep(SweepConfig(**change), TrainConfig())
