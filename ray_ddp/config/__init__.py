"""What a run is asked to do: the typed configuration of a training run and of a sweep, each
field defined once (its flag, help, limits and whether a re-run may change it), and the
checks that refuse what cannot work before any Ray work."""

from ray_ddp.config.sweep import SweepConfig, validate_sweep
from ray_ddp.config.train import BUILTIN_TASK, ConfigError, TrainConfig, validate

__all__ = [
    "BUILTIN_TASK",
    "ConfigError",
    "SweepConfig",
    "TrainConfig",
    "validate",
    "validate_sweep",
]
