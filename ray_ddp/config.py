"""The one typed training configuration, and its validation.

The driver builds a :class:`TrainConfig` from the command line, validates it once (before
any Ray work), resolves the "auto" fields against the machine or cluster, and hands it to
every worker as a plain dict. The worker turns that dict back into a ``TrainConfig`` on its
first line and uses attributes from then on.

This module imports neither Ray nor torch, so it is cheap to test and to import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

PLACEMENT_STRATEGIES = ("PACK", "SPREAD")
DATASETS = ("synthetic", "cifar10", "mnist", "fashion-mnist", "imagefolder", "parquet")
AMP_MODES = ("off", "bf16", "fp16")
OPTIMIZERS = ("adamw", "sgd")


class ConfigError(ValueError):
    """A configuration a person must fix. Its message is one actionable line."""


@dataclass
class TrainConfig:
    """Everything one training run needs. ``None`` means "decide automatically"."""

    # --- scaling (who runs) ---
    num_workers: int | None = None
    """Ray training workers (= DDP processes). Auto: one per GPU in the cluster, else 2 CPU
    workers."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per worker (fractions allowed, e.g. to fit a Tune trial's driver
    beside its workers); the worker's torch thread count is its whole part, at least 1."""
    use_gpu: bool | None = None
    """True: one GPU per worker (NCCL); False: CPU workers (gloo); None: GPUs if any."""
    address: str | None = None
    """Ray cluster address to join (else RAY_ADDRESS, else a local Ray is started)."""
    placement_strategy: str = "PACK"
    """``PACK`` fills a node's GPUs/CPUs before the next (fast intra-node all-reduce);
    ``SPREAD`` puts workers on as many nodes as it can."""
    wait_for_resources: float = 0.0
    """Seconds to wait for nodes to join when the cluster is smaller than the request (an
    autoscaling cluster). 0: refuse at once, with what was asked and what exists."""
    max_failures: int = 0
    """After a worker or node is lost, restart all workers from the latest checkpoint, up
    to this many times (-1: without limit)."""

    # --- optimisation ---
    epochs: int = 10
    """Total epochs of the run; a resumed run continues up to this number."""
    batch_size: int = 64
    """Per-worker micro-batch size (samples per forward pass on one worker)."""
    accum_steps: int = 1
    """Micro-batches accumulated per optimizer step. Global batch =
    batch_size x num_workers x accum_steps."""
    lr: float = 3e-3
    """Peak learning rate (reached after warm-up, then cosine decay to ``min_lr_ratio``)."""
    optimizer: str = "adamw"
    """``adamw`` or ``sgd`` (with Nesterov-free momentum)."""
    momentum: float = 0.9
    """SGD momentum (ignored by AdamW)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    warmup_steps: int | None = None
    """Linear warm-up length in optimizer steps. Auto: 5% of all steps."""
    min_lr_ratio: float = 0.01
    """The cosine schedule ends at ``lr * min_lr_ratio``."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (after un-scaling under fp16); 0 turns it off."""
    amp: str = "off"
    """Mixed precision: ``off``, ``bf16`` (autocast, no scaler) or ``fp16`` (GPU only,
    autocast + GradScaler)."""
    seed: int = 0
    """One seed for initial weights (identical on every rank), data order and the built-in
    dataset."""
    max_steps: int | None = None
    """Stop after this many optimizer steps in total (smoke tests, benchmarks)."""

    # --- data ---
    dataset: str = "synthetic"
    """``synthetic`` (built in, generated from the seed), ``cifar10``, ``mnist``,
    ``fashion-mnist``, ``imagefolder`` (train/ and val/ class folders) or ``parquet``."""
    data_dir: str | None = None
    """Where the dataset lives (must be readable from every node)."""
    download: bool = False
    """Let torchvision download cifar10/mnist/fashion-mnist into ``data_dir``."""
    train_samples: int | None = None
    """Built-in dataset: samples to generate (default 12000). Others: a seeded random subset
    of this size (default: all)."""
    val_samples: int | None = None
    """Like ``train_samples`` for the validation split (built-in default 2000)."""
    image_size: int | None = None
    """Resize images to this square size. Default: native for built-in, CIFAR and MNIST
    data; 32 for ImageFolder and Parquet images."""
    label_column: str = "label"
    """Parquet: the integer class column."""
    image_column: str = "image"
    """Parquet: a column of encoded image bytes (PNG/JPEG), or a struct with a ``bytes``
    field as Hugging Face writes it."""
    feature_column: str | None = None
    """Parquet: a list<float> feature column to use instead of images (needs ``--model
    mlp``)."""
    loader_workers: int | None = None
    """DataLoader worker processes per training worker. Auto: 0 for the in-memory built-in
    dataset, else min(4, cpus_per_worker)."""
    channels_last: bool | None = None
    """Keep conv weights and image batches in NHWC (channels_last) memory, which GPU tensor
    cores want. Auto: on for convolutional models on image data on GPU workers (ResNet-50
    on an H200 with AMP: about 1.9x the samples/s); off on CPU, where 2 DDP workers of the
    small CNN measured no faster with it."""
    pin_memory: bool | None = None
    """Pin host memory for faster host-to-GPU copies. Auto: on with GPUs."""

    # --- model ---
    model: str = "small_cnn"
    """``small_cnn`` (fast on CPU), ``mlp``, or any torchvision classification model name
    (e.g. ``resnet18``), built with the dataset's class count and no pretrained weights."""

    # --- output and checkpoints ---
    storage_path: str = "runs"
    """Where runs are stored: a local path (absolute or relative) or a pyarrow URI
    (``s3://``, ``gs://``)."""
    name: str | None = None
    """Run name. Re-running an existing name resumes it from its latest checkpoint. Auto:
    ``<dataset>-<model>-<timestamp>`` (always a fresh run)."""
    allow_config_change: bool = False
    """Let a re-run of an existing ``--name`` continue it with a different training config
    (model, data, batch, optimizer, ...); refused otherwise (see ``run_record``)."""
    resume_from: str | None = None
    """Start from this checkpoint directory (weights, optimizer, schedule, progress)."""
    keep_checkpoints: int = 2
    """How many of the best checkpoints (by validation accuracy) to keep; the latest is
    always kept as well."""
    checkpoint_every: int | None = None
    """Also checkpoint every this many optimizer steps inside an epoch, with the data
    position and every rank's RNG, so a lost worker or a re-run resumes mid-epoch exactly
    where it stopped. Off by default: every epoch's end is checkpointed anyway."""
    summary_json: str | None = None
    """Write the final summary as JSON to this path."""
    progress_interval_s: float = 30.0
    """Seconds between rank 0's in-epoch progress lines (a text bar with loss, speed and
    ETA); the CLI uses 5 when attached to a terminal. 0 turns them off."""
    tensorboard: bool = True
    """Rank 0 writes TensorBoard event files (``<run>/tensorboard``) besides metrics.csv."""
    log_every_steps: int = 50
    """Log the training loss and lr to TensorBoard every this many optimizer steps."""
    log_all_ranks: bool = False
    """Every rank prints its lines (tagged ``[rank N]``), not only rank 0."""
    export: bool = True
    """At the end, export the best checkpoint to ``<run>/export`` for use without Ray: a
    plain state_dict and a torch.export program."""
    comm_stats: bool = False
    """Count gradient all-reduces with a DDP communication hook and report them per
    optimizer step (a check that accumulation really skips the all-reduce)."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Values the driver passes to the workers beyond the flags (``log_prefix``: a Tune
    trial's tag for its rank-0 lines)."""

    # ------------------------------------------------------------------ helpers
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys: {', '.join(unknown)}")
        return cls(**data)

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step across the whole run (needs a resolved num_workers)."""
        if self.num_workers is None:
            raise ValueError("num_workers is not resolved yet")
        return self.batch_size * self.num_workers * self.accum_steps


def validate(cfg: TrainConfig) -> None:
    """Refuse values that cannot work, with one line that says what to change.

    Only checks that need nothing but the config live here; the data and the machine are
    checked by the driver (``ray_ddp.trainer.preflight``).
    """

    def positive(name: str, flag: str) -> None:
        value = getattr(cfg, name)
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} must be positive, got {value}")

    positive("epochs", "--epochs")
    positive("batch_size", "--batch-size")
    positive("accum_steps", "--accum-steps")
    positive("lr", "--lr")
    positive("num_workers", "--num-workers")
    positive("cpus_per_worker", "--cpus-per-worker")
    positive("keep_checkpoints", "--keep-checkpoints")
    positive("max_steps", "--max-steps")
    positive("checkpoint_every", "--checkpoint-every")
    positive("log_every_steps", "--log-every-steps")
    positive("train_samples", "--train-samples")
    positive("val_samples", "--val-samples")
    positive("image_size", "--image-size")
    for name, flag in (
        ("weight_decay", "--weight-decay"),
        ("grad_clip", "--grad-clip"),
        ("warmup_steps", "--warmup-steps"),
        ("loader_workers", "--loader-workers"),
    ):
        value = getattr(cfg, name)
        if value is not None and value < 0:
            raise ConfigError(f"{flag} must be zero or more, got {value}")
    if cfg.wait_for_resources < 0:
        raise ConfigError(
            f"--wait-for-resources must be zero or more, got {cfg.wait_for_resources}"
        )
    if not 0 <= cfg.momentum < 1:
        raise ConfigError(f"--momentum must be in [0, 1), got {cfg.momentum}")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ConfigError(f"--min-lr-ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if cfg.dataset not in DATASETS:
        raise ConfigError(
            f"unknown --dataset {cfg.dataset!r}; choose one of: {', '.join(DATASETS)}"
        )
    if cfg.amp not in AMP_MODES:
        raise ConfigError(f"unknown --amp {cfg.amp!r}; choose one of: {', '.join(AMP_MODES)}")
    if cfg.placement_strategy not in PLACEMENT_STRATEGIES:
        raise ConfigError(
            f"unknown --placement-strategy {cfg.placement_strategy!r}; choose PACK or SPREAD"
        )
    if cfg.max_failures < -1:
        raise ConfigError(f"--max-failures must be -1 (no limit) or more, got {cfg.max_failures}")
    if cfg.optimizer not in OPTIMIZERS:
        raise ConfigError(
            f"unknown --optimizer {cfg.optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}"
        )
    if cfg.amp == "fp16" and cfg.use_gpu is False:
        raise ConfigError(
            "--amp fp16 needs GPUs (GradScaler is CUDA-only); use --amp bf16 on CPU workers"
        )
    if cfg.dataset != "synthetic" and not cfg.data_dir:
        raise ConfigError(f"--dataset {cfg.dataset} needs --data-dir DIR")
    if cfg.feature_column and cfg.dataset != "parquet":
        raise ConfigError("--feature-column only applies to --dataset parquet")
    if cfg.name is not None and (not cfg.name or "/" in cfg.name or cfg.name in (".", "..")):
        raise ConfigError(f"--name must be a plain directory name, got {cfg.name!r}")
    if not cfg.storage_path:
        raise ConfigError("--storage-path must not be empty")
