"""The worker count as a way to run a training (no Ray): an elastic range is refused
unless every count in it keeps the global batch, and a re-run on another count keeps the
run's global batch by changing the accumulation, or is refused when it cannot."""

from __future__ import annotations

import re

import pytest

from ray_ddp.config import ConfigError, TrainConfig, validate
from ray_ddp.driver.cli import train_config, train_parser, tune_main
from ray_ddp.driver.elastic import keep_global_batch, scaling_workers


def _parsed(*argv: str) -> TrainConfig:
    return train_config(train_parser().parse_args(list(argv)))


def test_num_workers_min_max_makes_an_elastic_config():
    cfg = _parsed("--num-workers", "2-4", "--accum-steps", "3")
    assert (cfg.scaling.min_workers, cfg.scaling.num_workers) == (2, 4)
    assert cfg.scaling.elastic and cfg.scaling.worker_range == (2, 4)
    validate(cfg)  # 4 x 3 = 12 micro-batches per step: 2, 3 and 4 workers divide it
    assert scaling_workers(cfg.scaling) == (2, 4)
    fixed = _parsed("--num-workers", "3")
    assert not fixed.scaling.elastic and scaling_workers(fixed.scaling) == 3
    assert not _parsed("--num-workers", "2-2").scaling.elastic


@pytest.mark.parametrize(
    ("workers", "batch", "message"),
    [
        (
            "4-8",
            64,
            re.escape("7 workers: the 8 micro-batches of 64 per step (64 x 8 workers x 1)"),
        ),
        ("4-8", 64, "split 2/1 over 7 workers keep them 57% busy"),
        ("4-8", 64, re.escape("Use --batch-size 32 --accum-steps 2 (the same global batch of 512")),
        ("1-4", 64, "idle on 3 workers.*67% busy"),
        ("1-8", 1, "Use --accum-steps 2 \\(a global batch of 16"),
        ("4-2", 64, "need 1 <= MIN <= MAX"),
    ],
)
def test_a_range_that_would_leave_workers_idle_is_refused(workers, batch, message):
    cfg = _parsed("--num-workers", workers, "--batch-size", str(batch))
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


@pytest.mark.parametrize(("low", "high", "batch"), [(4, 8, 64), (1, 4, 64), (1, 8, 1), (2, 5, 63)])
def test_the_suggested_settings_keep_every_count_busy(low, high, batch):
    """What a refusal suggests is accepted, and keeps the global batch where it says so."""
    cfg = TrainConfig(num_workers=high, min_workers=low, batch_size=batch)
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    words = str(refused.value).split("Use ")[1].split(" (")[0].split()
    fixed = dict(zip(words[::2], map(int, words[1::2]), strict=True))
    suggested = TrainConfig(
        num_workers=high,
        min_workers=low,
        batch_size=fixed.get("--batch-size", batch),
        accum_steps=fixed["--accum-steps"],
    )
    validate(suggested)
    if "--batch-size" in fixed:
        assert suggested.global_batch_size == cfg.global_batch_size


def test_a_range_whose_counts_split_well_enough_is_accepted():
    for workers, accum in (("2-3", 1), ("4-8", 2), ("1-2", 1), ("6-8", 3)):
        validate(_parsed("--num-workers", workers, "--accum-steps", str(accum)))


SAVED = TrainConfig(num_workers=2, batch_size=32, accum_steps=2).to_dict()  # global 128


def _kept(cfg: TrainConfig, saved, what: str) -> TrainConfig:
    """``cfg`` with the optimisation ``keep_global_batch`` keeps (as the driver puts it)."""
    return cfg.replace(optim=keep_global_batch(cfg.scaling, cfg.optim, saved, what))


def test_a_rerun_on_fewer_or_more_workers_keeps_the_global_batch(capsys):
    fewer = _kept(TrainConfig(num_workers=1, batch_size=32, accum_steps=2), SAVED, "run r")
    assert (fewer.optim.accum_steps, fewer.global_batch_size) == (4, 128)
    more = _kept(TrainConfig(num_workers=4, batch_size=32, accum_steps=2), SAVED, "run r")
    assert (more.optim.accum_steps, more.global_batch_size) == (1, 128)
    out = capsys.readouterr().out
    assert "run r continues on 1 worker: accumulation 2 -> 4 keeps its global batch of 128" in out
    assert "run r continues on 4 workers: accumulation 2 -> 1" in out


def test_a_count_that_cannot_make_the_global_batch_is_refused():
    with pytest.raises(
        ConfigError, match="which 3 workers of --batch-size 32 cannot make: use 1, 2, 4 workers"
    ):
        _kept(TrainConfig(num_workers=3, batch_size=32, accum_steps=2), SAVED, "run r")


def test_a_changed_batch_is_left_to_the_rerun_guard():
    """A re-run that also changes --batch-size or --accum-steps asks for another training:
    it is not rewritten (the guard refuses it without --allow-config-change)."""
    for cfg in (
        TrainConfig(num_workers=1, batch_size=64, accum_steps=2),
        TrainConfig(num_workers=1, batch_size=32, accum_steps=8),
        TrainConfig(num_workers=2, batch_size=32, accum_steps=2),  # nothing changed
    ):
        assert _kept(cfg, SAVED, "run r") == cfg


def test_an_elastic_run_retries_without_limit_unless_told_and_sweeps_refuse_it(capsys):
    assert TrainConfig(num_workers=2).failures_allowed == 0
    assert TrainConfig(num_workers=2, min_workers=1).failures_allowed == -1
    assert TrainConfig(num_workers=2, min_workers=1, max_failures=3).failures_allowed == 3
    assert tune_main(["--num-workers", "1-2"]) == 2
    assert "a sweep's trials take a fixed --num-workers" in capsys.readouterr().err
