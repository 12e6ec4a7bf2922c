"""The configuration of a Ray Tune sweep: its search space and scheduler (every other
setting is the trials' TrainConfig), and its checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ray_ddp.config.fields import POSITIVE, Bound, first_problem, option
from ray_ddp.config.train import ConfigError, TrainConfig


@dataclass
class SweepConfig:
    """The search space and the scheduler of a Tune sweep; everything else comes from
    TrainConfig."""

    TITLE: ClassVar[str] = "search space and scheduler"

    lr_min: float = 1e-4
    """Lowest lr of the sweep. Trials draw their lr log-uniformly from --lr-min to
    --lr-max."""
    lr_max: float = 1e-2
    """Highest lr of the sweep. The upper end of the log-uniform range."""
    batch_sizes: list[int] = field(default_factory=lambda: [32, 64, 128])
    """Per-worker batch sizes to try. Comma-separated, one chosen per trial."""
    num_samples: int = option(8, bound=POSITIVE)
    """Trials to run."""
    max_concurrent_trials: int | None = option(None, bound=POSITIVE)
    """At most this many trials at once. Auto: as many as the cluster fits."""
    grace_period: int = 1
    """ASHA: epochs before stopping a trial. Every trial runs this many epochs before it can
    be stopped."""
    reduction_factor: float = option(2.0, bound=Bound("must be greater than 1", lambda v: v > 1))
    """ASHA: keep the top 1/this per rung. The top 1/reduction_factor of trials at each rung
    goes on."""
    early_stop: bool = True
    """Stop weak trials early with ASHA. Off: run every trial to the last epoch."""
    scale_lr: bool = False
    """Scale lr with the global batch. Each trial's lr is multiplied by its global batch /
    the global batch of --batch-size."""
    resume: bool = False
    """Continue an interrupted sweep. The sweep --name in --storage-path."""
    trial_cpus: float = option(0.1, cli=False)
    """CPU share reserved for each trial's driver (Tune rejects 0; Train's controller
    takes none)."""


def validate_sweep(sweep: SweepConfig, cfg: TrainConfig) -> None:
    """Refuse a sweep that cannot work, with one line that says what to change."""
    if not 0 < sweep.lr_min <= sweep.lr_max:
        raise ConfigError(
            f"need 0 < --lr-min <= --lr-max, got {sweep.lr_min:g} and {sweep.lr_max:g}"
        )
    if not sweep.batch_sizes or min(sweep.batch_sizes) <= 0:
        raise ConfigError("--batch-sizes must be a list of positive integers, e.g. 32,64,128")
    problem = first_problem(sweep)
    if problem:
        raise ConfigError(problem)
    if not 1 <= sweep.grace_period <= cfg.optim.epochs:
        raise ConfigError(f"--grace-period must be in 1..--epochs ({cfg.optim.epochs})")
    if sweep.resume and not cfg.checkpointing.name:
        raise ConfigError("--resume needs the --name of the sweep to continue")
