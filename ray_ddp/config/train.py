"""The configuration of a training run, and its validation.

The driver builds a :class:`TrainConfig` from the command line, validates it once (before
any Ray work), resolves the "auto" fields against the machine or cluster, and hands it to
every worker as a plain dict of its fields (``to_dict``: the same flat dict a run's record
and its checkpoints hold). The worker turns that dict back into a ``TrainConfig`` on its
first line and uses attributes from then on.

A ``TrainConfig`` is made of typed sections (``ray_ddp.config.sections``: ``cfg.scaling``,
``cfg.reliability``, ``cfg.optim``, ``cfg.target``, ``cfg.data``, ``cfg.checkpointing``,
``cfg.logging``), where each field is defined once: its flag, help text, limits and whether
a re-run may change it are derived from the definition (``ray_ddp.config.fields``). A field
is read from its section (``cfg.optim.lr``, which a type checker sees); code that takes a
part of the run takes the section it reads. A field is still given by its own name
(``TrainConfig(lr=0.1)``, ``cfg.replace(lr=0.1)``, ``ray_ddp.fit(task, lr=0.1)``, the flat
dict of ``to_dict``/``from_dict``), as before the sections existed; a flat read
(``TrainConfig().lr``) still works for tasks written then, with a :class:`FlatFieldWarning`.

This module imports neither Ray nor torch, so it is cheap to test and to import.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ray_ddp.config.batch import MIN_BUSY, busy_share, global_batch
from ray_ddp.config.fields import first_problem
from ray_ddp.config.sections import (
    AMP_MODES,
    AUGMENT_POLICIES,
    BUILTIN_TASK,
    DATA_ENGINES,
    DATASETS,
    IMAGE_TASK_FIELDS,
    OPTIMIZERS,
    PARQUET_READS,
    PLACEMENT_STRATEGIES,
    Checkpointing,
    Data,
    Logging,
    Optimisation,
    Reliability,
    Scaling,
    Target,
    parse_resources,
    parse_workers,
    resources_problem,
    step_range,
)

__all__ = [  # the constants and parsers live with the sections; importers find them here too
    "AMP_MODES", "AUGMENT_POLICIES", "BUILTIN_TASK", "DATA_ENGINES", "DATASETS",
    "IMAGE_TASK_FIELDS", "OPTIMIZERS", "PARQUET_READS", "PLACEMENT_STRATEGIES", "ConfigError",
    "TrainConfig", "parse_resources", "parse_workers", "resources_problem", "validate",
]  # fmt: skip

# Fields of earlier versions that a saved config may still hold (a sweep's trials, a run's
# record): testing aids, now ray_ddp.testing's Harness. Read and dropped.
RETIRED_FIELDS = frozenset(
    {
        "inject_nan_step", "inject_nan_rank", "stall_step", "stall_rank", "stall_s",
        "stall_exit", "stall_frozen", "slow_step_s", "slow_rank", "slow_start_s",
        "slow_checkpoint_s", "hang_loader_sample", "sample_ledger",
    }
)  # fmt: skip


class ConfigError(ValueError):
    """A configuration a person must fix. Its message is one actionable line."""


@dataclass(init=False)
class TrainConfig:
    """Everything one training run needs, in sections. ``None`` means "decide
    automatically". Made from section objects and/or any field by its own name::

        TrainConfig(num_workers=4, lr=0.1)
        TrainConfig(optim=Optimisation(lr=0.1), epochs=3)
    """

    scaling: Scaling
    reliability: Reliability
    optim: Optimisation
    target: Target
    data: Data
    checkpointing: Checkpointing
    logging: Logging

    SECTIONS: ClassVar[dict[str, type]] = {
        "scaling": Scaling,
        "reliability": Reliability,
        "optim": Optimisation,
        "target": Target,
        "data": Data,
        "checkpointing": Checkpointing,
        "logging": Logging,
    }
    """Each section's attribute and type, in the order of ``--help``'s groups."""

    def __init__(self, **given: Any) -> None:
        for name, cls in self.SECTIONS.items():
            section = given.pop(name, None) or cls()
            mine = {f.name: given.pop(f.name) for f in dataclasses.fields(cls) if f.name in given}
            object.__setattr__(self, name, dataclasses.replace(section, **mine))
        if given:
            raise TypeError(f"TrainConfig has no field {', '.join(sorted(given))}")

    @classmethod
    def fields(cls) -> list[dataclasses.Field[Any]]:
        """Every field of every section, in order (what flags and checks iterate)."""
        return [f for section in cls.SECTIONS.values() for f in dataclasses.fields(section)]

    # ------------------------------------------------------------------ helpers
    def to_dict(self) -> dict[str, Any]:
        """Every field by its name (the flat dict of a run's record and checkpoints)."""
        out: dict[str, Any] = {}
        for name in self.SECTIONS:
            out.update(dataclasses.asdict(getattr(self, name)))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in cls.fields()}
        data = {k: v for k, v in data.items() if k not in RETIRED_FIELDS}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys: {', '.join(unknown)}")
        return cls(**data)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` (any field by its own name, or whole sections):
        ``cfg.replace(lr=0.1)`` is ``cfg`` with ``cfg.optim.lr == 0.1``. The sections are
        copied, so the copy shares no section with ``cfg``."""
        sections: dict[str, Any] = {name: getattr(self, name) for name in self.SECTIONS}
        return TrainConfig(**{**sections, **changes})

    @classmethod
    def section_of(cls, name: str) -> str:
        """The section that holds field ``name``: ``section_of("lr") == "optim"``."""
        for section, section_cls in cls.SECTIONS.items():
            if name in {f.name for f in dataclasses.fields(section_cls)}:
                return section
        raise AttributeError(f"TrainConfig has no field {name!r}")

    def value(self, name: str) -> Any:
        """Field ``name``'s value, for code that walks fields by name (validation, the
        re-run guard); code that knows the field reads ``cfg.<section>.<field>``."""
        return getattr(getattr(self, self.section_of(name)), name)

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step across the whole run (needs a resolved num_workers)."""
        if self.scaling.num_workers is None:
            raise ValueError("num_workers is not resolved yet")
        return global_batch(self.optim.batch_size, self.scaling.num_workers, self.optim.accum_steps)

    @property
    def failures_allowed(self) -> int:
        """``max_failures`` resolved: what Ray Train's ``FailureConfig`` gets."""
        if self.reliability.max_failures is not None:
            return self.reliability.max_failures
        return -1 if self.scaling.elastic else 0

    if not TYPE_CHECKING:  # hidden from type checkers: every read in ray_ddp is sectioned

        def __getattr__(self, name: str) -> Any:
            # Tasks and loops written before the sections read ``cfg.optim.lr``: it still works,
            # with a warning naming the sectioned read.
            if name.startswith("__") or name in self.SECTIONS:
                raise AttributeError(name)
            section = self.section_of(name)
            _warn_flat(name, section)
            return getattr(object.__getattribute__(self, section), name)

        def __setattr__(self, name: str, value: Any) -> None:
            if name in self.SECTIONS:
                object.__setattr__(self, name, value)
                return
            section = self.section_of(name)  # refuses a name no section has
            _warn_flat(name, section)
            setattr(getattr(self, section), name, value)


class FlatFieldWarning(DeprecationWarning):
    """A flat read of earlier versions: ``cfg.lr`` for ``cfg.optim.lr``."""  # flat on purpose


def _warn_flat(name: str, section: str) -> None:
    warnings.warn(
        f"TrainConfig.{name} is TrainConfig.{section}.{name}: read it from its section "
        "(the flat attributes will go)",
        FlatFieldWarning,
        stacklevel=3,
    )


def validate(cfg: TrainConfig) -> None:
    """Refuse values that cannot work, with one line that says what to change.

    Each field's own limits (choices, bounds) come from its definition; the checks below
    relate fields to each other. Only checks that need nothing but the config live here;
    the data and the machine are checked by the driver's preflight.
    """
    problem = first_problem(cfg)
    if problem:
        raise ConfigError(problem)
    if cfg.target.task != BUILTIN_TASK:
        defaults = TrainConfig()
        changed = [n for n in IMAGE_TASK_FIELDS if cfg.value(n) != defaults.value(n)]
        # augment "none" is what jobs/evaluate.py sets to evaluate a train split.
        changed = [n for n in changed if (n, cfg.data.augment) != ("augment", "none")]
        if changed:
            flag = "--" + changed[0].replace("_", "-")
            raise ConfigError(
                f"{flag} configures the built-in image classification; --task {cfg.target.task} "
                "builds its own data and model (give it settings in the task itself)"
            )
    if cfg.scaling.min_workers is not None:
        check_worker_range(cfg.scaling, cfg.optim)
    if cfg.scaling.resources_per_worker is not None:
        problem = resources_problem(cfg.scaling.resources_per_worker)
        if problem:
            raise ConfigError(problem)
    if cfg.optim.amp == "fp16" and cfg.scaling.use_gpu is False:
        raise ConfigError(
            "--amp fp16 needs GPUs (GradScaler is CUDA-only); use --amp bf16 on CPU workers"
        )
    problem = strategy_problem(cfg)
    if problem:
        raise ConfigError(problem)
    if (
        cfg.target.task == BUILTIN_TASK
        and cfg.data.dataset != "synthetic"
        and not cfg.data.data_dir
    ):
        raise ConfigError(f"--dataset {cfg.data.dataset} needs --data-dir DIR")
    if cfg.data.data_engine == "ray" and cfg.data.dataset not in ("parquet", "imagefolder"):
        raise ConfigError(
            f"--data-engine ray reads Parquet or ImageFolder data, not --dataset {cfg.data.dataset}"
        )
    if cfg.data.data_engine == "ray":
        problem = ray_engine_problem(cfg)
        if problem:
            raise ConfigError(problem)
    if cfg.data.feature_column and cfg.data.dataset != "parquet":
        raise ConfigError("--feature-column only applies to --dataset parquet")
    if cfg.data.augment not in (None, "none") and (
        cfg.data.dataset == "synthetic" or cfg.data.feature_column
    ):
        what = "a --feature-column" if cfg.data.feature_column else "the built-in dataset"
        raise ConfigError(f"--augment {cfg.data.augment} needs images; {what} takes --augment none")
    problem = tracking_problem(cfg) or profile_problem(cfg.logging, cfg.optim)
    if problem:
        raise ConfigError(problem)
    if cfg.checkpointing.name is not None and (
        not cfg.checkpointing.name
        or "/" in cfg.checkpointing.name
        or cfg.checkpointing.name in (".", "..")
    ):
        raise ConfigError(f"--name must be a plain directory name, got {cfg.checkpointing.name!r}")
    if not cfg.checkpointing.storage_path:
        raise ConfigError("--storage-path must not be empty")


def strategy_problem(cfg: TrainConfig) -> str | None:
    """What ``--strategy fsdp2`` cannot run with, as the line that refuses it; None if
    nothing."""
    if cfg.scaling.strategy != "fsdp2":
        return None
    if cfg.optim.amp == "fp16":
        return (
            "--amp fp16 needs a GradScaler that knows sharded gradients, which --strategy "
            "fsdp2 has not: use --amp bf16 (bf16 parameters, gradients reduced in fp32)"
        )
    if cfg.target.compile:
        return "--compile is not supported with --strategy fsdp2 yet: drop --compile"
    return None


def tracking_problem(cfg: TrainConfig) -> str | None:
    """What is wrong with the tracking flags by themselves, as one line; None if nothing.
    (Whether the tracker's package is installed is the driver's preflight.)"""
    if cfg.logging.tracking == "none":
        given = [f for f in ("tracking_uri", "experiment") if cfg.value(f) is not None]
        if given:
            return f"--{given[0].replace('_', '-')} needs --tracking mlflow or --tracking wandb"
    if cfg.logging.tracking == "wandb" and cfg.logging.tracking_uri:
        return "--tracking-uri is MLflow's; W&B reads its server from WANDB_BASE_URL"
    return None


def profile_problem(
    logging: Logging, optim: Optimisation, total_steps: int | None = None
) -> str | None:
    """What is wrong with ``--profile-steps`` as one line (``total_steps``: the run's
    optimizer steps, once the workers and the data are known); None if nothing."""
    steps = step_range(logging.profile_steps)
    if steps is None:
        return None
    first, last = steps
    given = f"--profile-steps {logging.profile_steps}"
    if not 1 <= first <= last:
        return f"{given}: need 1 <= A <= B (optimizer steps, counted from 1)"
    end = min(total_steps or last, optim.max_steps or last)
    if last > end:
        why = "--max-steps" if optim.max_steps == end else f"{optim.epochs} epochs"
        return f"{given}: the run has {end} optimizer steps ({why}); profile steps within it"
    return None


def ray_engine_problem(cfg: TrainConfig) -> str | None:
    """What ``--data-engine ray`` cannot do (see ``ray_ddp.data.ray_data``), as the line
    that refuses it; None where it can run."""
    if cfg.checkpointing.checkpoint_every:
        return (
            "--checkpoint-every needs a position inside an epoch to resume from, which a Ray "
            "Data stream has not: drop it (--data-engine ray checkpoints at each epoch's "
            "end) or use --data-engine torch"
        )
    if cfg.scaling.min_workers is not None:
        return (
            "--data-engine ray needs a fixed number of workers (--num-workers N): its equal "
            "split of the data is made for one world size"
        )
    if cfg.data.train_samples or cfg.data.val_samples:
        return (
            "--train-samples/--val-samples take seeded subsets, which --data-engine ray does "
            "not make: write a smaller split, or use --data-engine torch"
        )
    return None


def check_worker_range(scaling: Scaling, optim: Optimisation) -> None:
    """An elastic range is refused where some worker count in it cannot keep the global
    batch usefully: more workers than micro-batches per step, or a split that leaves the
    workers idle for more than a quarter of each step (8 micro-batches over 6 workers: 2 on
    ranks 0-1, 1 on the others, 67% busy). The refusal names the smallest --accum-steps
    that keeps every count at least 75% busy."""

    low, high = scaling.min_workers, scaling.num_workers
    batch_size, accum_steps = optim.batch_size, optim.accum_steps
    if high is None:
        raise ConfigError("an elastic run needs its MAX workers: --num-workers MIN-MAX")
    if low is None or not 0 < low <= high:
        raise ConfigError(f"--num-workers {low}-{high}: need 1 <= MIN <= MAX")

    def idle(accum: int) -> list[tuple[int, float]]:
        per_step = high * accum
        shares = [(n, busy_share(per_step, n)) for n in range(low, high + 1)]
        return [(n, share) for n, share in shares if share < MIN_BUSY]

    bad = idle(accum_steps)
    if not bad:
        return
    count, share = bad[-1]
    per_step = high * accum_steps
    most = -(-per_step // count)
    # The same global batch in smaller micro-batches if --batch-size divides, else more of
    # them (a larger global batch).
    split = next(
        (f for f in range(2, batch_size + 1) if batch_size % f == 0 and not idle(accum_steps * f)),
        None,
    )
    if split:
        fix = (
            f"--batch-size {batch_size // split} --accum-steps {accum_steps * split} "
            f"(the same global batch of {per_step * batch_size} in {per_step * split} "
            "micro-batches"
        )
    else:
        accum = next(a for a in range(accum_steps + 1, 10 * high + 1) if not idle(a))
        fix = f"--accum-steps {accum} (a global batch of {high * accum * batch_size}"
    raise ConfigError(
        f"--num-workers {low}-{high} would leave workers idle on {count} workers: the "
        f"{per_step} micro-batches of {batch_size} per step ({batch_size} x {high} "
        f"workers x {accum_steps}) split {most}/{most - 1} over {count} workers keep "
        f"them {share:.0%} busy. Use {fix}: every count from {low} to {high} at least "
        f"{MIN_BUSY:.0%} busy), or a range whose counts divide {per_step}"
    )
