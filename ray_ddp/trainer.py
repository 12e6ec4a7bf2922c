"""The driver: checks the request, connects to Ray, builds the TorchTrainer and fits it.

Runs in the process that the user started (``python jobs/train.py``) or that ``ray job
submit`` started on the cluster. Everything that can be refused is refused here, before a
single worker starts: the config, the data, the model name, the checkpoint to resume from,
and whether the cluster has the CPUs/GPUs asked for.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from ray_ddp.checkpoint import CheckpointError, check_compatible, load_state, model_meta
from ray_ddp.config import ConfigError, TrainConfig, validate
from ray_ddp.datasets import DatasetInfo, describe_dataset
from ray_ddp.models import check_model_name
from ray_ddp.numerics import stop_on_nonfinite_callback
from ray_ddp.run_record import check_rerun, write_record
from ray_ddp.storage import check_shared_storage, storage_location, write_bytes

DEFAULT_CPU_WORKERS = 2


def preflight(cfg: TrainConfig) -> DatasetInfo:
    """Everything that can be checked without Ray. Raises ConfigError with one line."""
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
    check_batch_fits(cfg, info, cfg.batch_size)
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


def connect(address: str | None) -> None:
    """Join the cluster at ``address`` (or RAY_ADDRESS), else start a local Ray."""
    import ray

    if ray.is_initialized():
        return
    if not address and not os.environ.get("RAY_ADDRESS"):
        for key, value in QUIET_LOCAL_RAY.items():
            os.environ.setdefault(key, value)  # the user's own setting wins
    ray.init(address=address, logging_level="WARNING", log_to_driver=True)


# A Ray started by this process for itself (not a cluster it joins) runs beside the
# workers on the same cores: the background work that only clusters need is switched off.
# Measured with benchmarks/run.py (2 cores, 2 workers, batch 256): 4751 vs 4506 samples/s
# and the first step 2 s sooner (2 runs each). The dashboard stays: Tune's clean-up of
# placement groups uses its State API.
QUIET_LOCAL_RAY = {
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",  # no spot preemption on one machine
    "RAY_TRAIN_METRICS_ENABLED": "0",  # Train's Prometheus metrics export
    "RAY_USAGE_STATS_ENABLED": "0",  # usage telemetry at start-up
}


def resolve_scaling(cfg: TrainConfig) -> TrainConfig:
    """Fill in num_workers and use_gpu from the cluster, and refuse what cannot fit.

    Ray itself would leave an unplaceable request pending forever. Here a request larger
    than the whole cluster fails at once, unless ``--wait-for-resources`` allows time for
    nodes to join (an autoscaling cluster); one that fits the cluster but not what is free
    now (another job holds it) waits up to ``max(30 s, --wait-for-resources)``."""
    import ray

    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    use_gpu = cfg.use_gpu if cfg.use_gpu is not None else gpus > 0
    if cfg.amp == "fp16" and not use_gpu:
        raise ConfigError("--amp fp16 needs GPU workers; use --amp bf16 or --amp off on CPU")
    num_workers = cfg.num_workers or (gpus if use_gpu else DEFAULT_CPU_WORKERS)
    cfg = dataclasses.replace(cfg, num_workers=num_workers, use_gpu=use_gpu)

    deadline = time.monotonic() + cfg.wait_for_resources
    said = False
    while missing := _shortage(cfg, ray.cluster_resources(), "the Ray cluster has"):
        if time.monotonic() >= deadline:
            raise ConfigError(missing)
        if not said:
            print(f"{missing}; waiting up to {cfg.wait_for_resources:g} s for nodes", flush=True)
            said = True
        time.sleep(RESOURCE_POLL_S)

    deadline = time.monotonic() + max(30.0, cfg.wait_for_resources)
    while missing := _shortage(cfg, ray.available_resources(), "free now:"):
        if time.monotonic() >= deadline:
            raise ConfigError(f"{missing} (other jobs hold the rest); try again later")
        time.sleep(RESOURCE_POLL_S)
    return cfg


RESOURCE_POLL_S = 2.0


def _shortage(cfg: TrainConfig, resources: dict[str, float], have: str) -> str | None:
    """What the request lacks in ``resources``, as a message; None if it fits."""
    assert cfg.num_workers is not None
    gpus = int(resources.get("GPU", 0))
    cpus = resources.get("CPU", 0)
    if cfg.use_gpu and gpus == 0:
        return "--use-gpu was given but the Ray cluster has no GPUs; drop it or use --no-gpu"
    need_cpus = cfg.num_workers * cfg.cpus_per_worker
    if need_cpus > cpus + 1e-9:
        return (
            f"{cfg.num_workers} workers x {cfg.cpus_per_worker:g} CPUs = {need_cpus:g} CPUs "
            f"asked, {have} {cpus:g}; lower --num-workers or --cpus-per-worker"
        )
    if cfg.use_gpu and cfg.num_workers > gpus:
        return f"{cfg.num_workers} GPU workers asked, {have} {gpus} GPUs; lower --num-workers"
    return None


class Interrupted(Exception):
    """The user stopped the run (Ctrl-C); its checkpoints are intact."""

    def __init__(self, cfg: TrainConfig):
        run_dir = os.path.join(cfg.storage_path, cfg.name or "")
        super().__init__(
            f"interrupted: the workers were stopped; checkpoints in {run_dir} are intact. "
            f"Resume with the same flags and --name {cfg.name}"
        )


def default_name(cfg: TrainConfig) -> str:
    return f"{cfg.dataset}-{cfg.model}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_training(cfg: TrainConfig) -> dict[str, Any]:
    """Validate, connect, fit. Returns the summary. Raises ConfigError on bad input and
    ray.train.TrainingFailedError when training fails."""
    info = preflight(cfg)
    connect(cfg.address)
    cfg = resolve_scaling(cfg)
    check_batch_fits(cfg, info, cfg.batch_size)  # again, now that num_workers is known
    cfg = dataclasses.replace(
        cfg, name=cfg.name or default_name(cfg), storage_path=storage_location(cfg.storage_path)
    )
    check_shared_storage(cfg.storage_path)
    check_rerun(cfg)  # again: num_workers is known now
    write_record(cfg)

    print(f"run {cfg.name} -> {os.path.join(cfg.storage_path, cfg.name)}", flush=True)
    trainer = build_trainer(cfg)
    started = time.perf_counter()
    try:
        result = trainer.fit()
    except (KeyboardInterrupt, SystemExit) as exc:
        # Ray's own SIGINT handler has aborted the controller, which stops the workers,
        # then exits 0 as if all went well; say what happened instead.
        raise Interrupted(cfg) from exc
    wall_s = time.perf_counter() - started
    summary = build_summary(cfg, result, wall_s)
    if cfg.export and summary["best"]:
        summary["export"] = _export(summary["best"]["checkpoint"], summary["run_dir"])
    return summary


def _export(checkpoint: str, run_dir: str) -> dict[str, str]:
    """The best checkpoint for inference without Ray. A model torch.export cannot trace
    does not fail the finished run: it is said, and the checkpoint is still there."""
    from ray_ddp.export import export_best

    try:
        paths = export_best(checkpoint, run_dir)
    except Exception as exc:  # noqa: BLE001 - reported, training already succeeded
        print(f"export skipped: {type(exc).__name__}: {exc}", flush=True)
        return {}
    print(f"exported the best checkpoint -> {os.path.dirname(paths['program'])}", flush=True)
    return paths


def build_trainer(
    cfg: TrainConfig,
    callbacks: list | None = None,
    loop: Any = None,
    loop_config: dict[str, Any] | None = None,
):
    """The TorchTrainer for a resolved config (named, absolute storage, workers known).
    Shared by single runs and Tune trials, so both run exactly the same loop."""
    from ray.train import (
        CheckpointConfig,
        FailureConfig,
        LoggingConfig,
        RunConfig,
        ScalingConfig,
    )
    from ray.train.torch import TorchConfig, TorchTrainer

    from ray_ddp.loop import train_loop_per_worker

    return TorchTrainer(
        loop or train_loop_per_worker,  # the evaluation job passes its own
        train_loop_config=loop_config if loop_config is not None else cfg.to_dict(),
        # backend=None: Ray picks NCCL when the workers have GPUs, gloo otherwise.
        torch_config=TorchConfig(backend=None),
        scaling_config=ScalingConfig(
            num_workers=cfg.num_workers,
            use_gpu=cfg.use_gpu,
            resources_per_worker={"CPU": cfg.cpus_per_worker},
            placement_strategy=cfg.placement_strategy,
        ),
        run_config=RunConfig(
            name=cfg.name,
            storage_path=cfg.storage_path,
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.keep_checkpoints,
                checkpoint_score_attribute="val_acc",
                checkpoint_score_order="max",
            ),
            # Ray Train's per-report INFO lines would drown the epoch lines.
            logging_config=LoggingConfig(log_level="WARNING"),
            callbacks=[stop_on_nonfinite_callback(), *(callbacks or [])],
            failure_config=FailureConfig(max_failures=cfg.max_failures),
        ),
    )


def build_summary(cfg: TrainConfig, result, wall_s: float) -> dict[str, Any]:
    """Final and best validation figures, the best checkpoint, sizes and speed."""
    info = result.return_value or {}
    # Mid-epoch checkpoints carry no validation (val_acc NaN): never the best.
    scored = [
        (c, m)
        for c, m in (result.best_checkpoints or [])
        if "val_acc" in m and not m.get("mid_epoch")
    ]
    best_ckpt, best_metrics = max(scored, key=lambda cm: cm[1]["val_acc"]) if scored else (None, {})
    final_metrics = result.metrics or {}
    pick = ("epoch", "val_loss", "val_acc", "val_correct", "val_count")
    train_seconds = info.get("train_seconds", 0.0)
    return {
        "name": cfg.name,
        "run_dir": result.path,
        "world_size": cfg.num_workers,
        "device": "gpu" if cfg.use_gpu else "cpu",
        "per_worker_batch_size": cfg.batch_size,
        "accum_steps": cfg.accum_steps,
        "global_batch_size": cfg.global_batch_size,
        "epochs": cfg.epochs,
        "epochs_completed": final_metrics.get("epoch", 0),
        "steps": final_metrics.get("step", 0),
        "final": {k: final_metrics[k] for k in pick if k in final_metrics},
        "best": (
            {
                **{k: best_metrics[k] for k in pick if k in best_metrics},
                "checkpoint": best_ckpt.path,
            }
            if best_ckpt is not None
            else {}
        ),
        "latest_checkpoint": result.checkpoint.path if result.checkpoint else None,
        "history": info.get("history", []),
        "ranks": info.get("ranks", []),
        "per_rank": info.get("per_rank", []),
        "wall_s": wall_s,
        "samples_per_s": info.get("samples_seen", 0) / train_seconds if train_seconds else 0.0,
        "timing": info.get("timing", {}),
    }


def write_summary(summary: dict[str, Any], path: str) -> None:
    """Write JSON completely or not at all (a local path or a storage URI)."""
    write_bytes(path, json.dumps(summary, indent=2).encode())
