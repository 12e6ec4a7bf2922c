"""What a finished run reports: its final and best validation figures, the best
checkpoint, sizes and speed (the summary ``jobs/train.py`` prints and ``--summary-json``
writes)."""

from __future__ import annotations

import json
from typing import Any

from ray_ddp.config.batch import global_batch
from ray_ddp.config.sections import Checkpointing, Optimisation, Scaling
from ray_ddp.io.storage import uri_of, write_bytes
from ray_ddp.task import Task


def build_summary(
    scaling: Scaling, optim: Optimisation, checkpointing: Checkpointing, task: Task, result,
    wall_s: float,
) -> dict[str, Any]:  # fmt: skip
    """Final and best validation figures, the best checkpoint, sizes and speed, of a run
    on the (resolved) workers of ``scaling``."""
    low, high = scaling.worker_range
    info = result.return_value or {}
    score = f"val_{task.best_metric}"
    # Mid-epoch checkpoints carry no validation: never the best.
    scored = [
        (c, m) for c, m in (result.best_checkpoints or []) if score in m and not m.get("mid_epoch")
    ]
    pick_best = max if task.best_mode == "max" else min
    best_ckpt, best_metrics = (
        pick_best(scored, key=lambda cm: cm[1][score]) if scored else (None, {})
    )
    final_metrics = result.metrics or {}

    def full(path: str) -> str:
        # Ray's paths drop the scheme and options of a URI storage (s3://...): put them back.
        return uri_of(checkpointing.storage_path, path)

    def pick(metrics: dict[str, Any]) -> dict[str, Any]:
        kept = ("epoch", "evaluated_samples")
        return {k: v for k, v in metrics.items() if k in kept or k.startswith("val_")}

    train_seconds = info.get("train_seconds", 0.0)
    return {
        "name": checkpointing.name,
        "run_dir": full(result.path),
        # The workers of the attempt that finished (an elastic run may end on fewer).
        "world_size": info.get("world_size", scaling.num_workers),
        "worker_range": [low, high],
        "device": "gpu" if scaling.use_gpu else "cpu",
        "per_worker_batch_size": optim.batch_size,
        "accum_steps": final_metrics.get("accum_steps", optim.accum_steps),
        "global_batch_size": global_batch(optim.batch_size, high, optim.accum_steps),
        "epochs": optim.epochs,
        # The worker's own count: a --max-steps stop inside an epoch reports its figures
        # under that epoch's number without completing it.
        "epochs_completed": info.get("epochs_completed", final_metrics.get("epoch", 0)),
        "steps": final_metrics.get("step", 0),
        "score": score,
        "score_mode": task.best_mode,
        "final": pick(final_metrics),
        "best": {**pick(best_metrics), "checkpoint": full(best_ckpt.path)} if best_ckpt else {},
        "latest_checkpoint": full(result.checkpoint.path) if result.checkpoint else None,
        "history": info.get("history", []),
        "ranks": info.get("ranks", []),
        "per_rank": info.get("per_rank", []),
        "wall_s": wall_s,
        "samples_per_s": info.get("samples_seen", 0) / train_seconds if train_seconds else 0.0,
        "timing": info.get("timing", {}),
        "flops_per_sample": info.get("flops_per_sample"),
        # TFLOP/s (and MFU on GPUs of a known peak) over the run's training time.
        "utilisation": info.get("utilisation", {}),
        # Rank 0's checkpoints (mode, seconds each blocked training, snapshot bytes) and
        # the reclaim notices asked for (calls, seconds), of the attempt that finished.
        "checkpoints": info.get("checkpoints", {}),
        "preemption_checks": info.get("preemption_checks", {}),
        # --profile-steps: where the traces are, rank 0's top operators (the attempt that
        # recorded them); --tracking: the tracker run, what was sent and dropped.
        **{key: info[key] for key in ("profile", "tracking") if info.get(key)},
    }


def write_summary(summary: dict[str, Any], path: str) -> None:
    """Write JSON completely or not at all (a local path or a storage URI)."""
    write_bytes(path, json.dumps(summary, indent=2).encode())
