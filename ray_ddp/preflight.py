"""Everything about a request that can be refused without Ray: the config, the model name,
the data, the checkpoint to resume from, the batch against the data. Each refusal is a
ConfigError with one line saying what to change, raised before any cluster work."""

from __future__ import annotations

from collections.abc import Sequence

from ray_ddp.checkpoint import CheckpointError, check_compatible, load_state, model_meta
from ray_ddp.config import ConfigError, TrainConfig, validate
from ray_ddp.datasets import DatasetInfo, describe_dataset
from ray_ddp.models import check_model_name
from ray_ddp.rerun_guard import check_rerun


def preflight(cfg: TrainConfig, batch_sizes: Sequence[int] = ()) -> DatasetInfo:
    """Check ``cfg`` (and the per-worker ``batch_sizes`` a sweep will try; default: the
    config's own) against the data. Returns what the data looks like."""
    validate(cfg)
    check_model_name(cfg.model)
    if cfg.amp == "fp16" and cfg.use_gpu is None and not cfg.address and not _local_gpus():
        raise ConfigError(
            "--amp fp16 needs GPUs and this machine has none; use --amp bf16 or --amp off"
        )
    info = describe_dataset(cfg)
    check_rerun(cfg)
    if cfg.resume_from:
        try:
            state = load_state(cfg.resume_from)
            check_compatible(
                state,
                model_meta(cfg.model, info.num_classes, info.input_shape),
                f"--resume-from {cfg.resume_from}",
            )
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from exc
    for batch_size in batch_sizes or [cfg.batch_size]:
        check_batch_fits(cfg, info, batch_size)
    return info


def check_batch_fits(cfg: TrainConfig, info: DatasetInfo, batch_size: int) -> None:
    """A per-worker batch larger than a worker's shard would train on nothing (the loader
    drops the incomplete last batch). Needs num_workers; a no-op while it is "auto"."""
    if info.train_size is None or not cfg.num_workers:
        return
    shard = -(-info.train_size // cfg.num_workers)
    if batch_size > shard:
        raise ConfigError(
            f"--batch-size {batch_size} (per worker) is larger than a worker's "
            f"share of the {info.train_size} training samples ({shard}); lower it"
        )
    batches = shard // batch_size
    if cfg.accum_steps > batches:
        raise ConfigError(
            f"--accum-steps {cfg.accum_steps} is more than the {batches} micro-batches of "
            f"{batch_size} a worker gets per epoch, so no step would accumulate that many; "
            "lower --accum-steps or --batch-size"
        )


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
