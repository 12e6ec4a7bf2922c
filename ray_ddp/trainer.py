"""The driver of a training run: the TorchTrainer, its fit, and the summary of its result.

Runs in the process that the user started (``python jobs/train.py``) or that ``ray job
submit`` started on the cluster. Everything that can be refused is refused first
(``cluster.prepare_cluster_run``), before a single worker starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from ray_ddp.cluster import prepare_cluster_run
from ray_ddp.config import TrainConfig
from ray_ddp.rerun_guard import check_rerun, write_record
from ray_ddp.retry_policy import stop_hopeless_retries
from ray_ddp.storage import write_bytes
from ray_ddp.transforms import augment_policy


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
    cfg, _ = prepare_cluster_run(cfg)
    # Record what "auto" resolved to where it decides what is trained, so a re-run that
    # asks for something else explicitly is refused (None is not compared).
    cfg = dataclasses.replace(cfg, name=cfg.name or default_name(cfg), augment=augment_policy(cfg))
    check_rerun(cfg)  # again: num_workers and the augmentation are known now
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

    from ray_ddp.train_worker import train_loop_per_worker

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
            callbacks=[stop_hopeless_retries(), *(callbacks or [])],
            failure_config=FailureConfig(max_failures=cfg.max_failures),
        ),
    )


def build_summary(cfg: TrainConfig, result, wall_s: float) -> dict[str, Any]:
    """Final and best validation figures, the best checkpoint, sizes and speed."""
    info = result.return_value or {}
    # Mid-epoch checkpoints carry no validation (val_acc -1): never the best.
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
        # The worker's own count: a --max-steps stop inside an epoch reports its figures
        # under that epoch's number without completing it.
        "epochs_completed": info.get("epochs_completed", final_metrics.get("epoch", 0)),
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
