"""ray_ddp: distributed PyTorch (DDP) training orchestrated by Ray Train.

The public API (see ``task`` for the interface and the README, "Your own model")::

    from ray_ddp import Sum, Task, TrainConfig, fit, load_model

Modules, one job each (the driver's side first, then the workers', then the parts both use):
    task           the Task interface: your model, data, loss and metrics
    task_check     --task package.module:Name found, and checked before Ray starts
    image_classification  the built-in task: classifying images by --dataset, --model
    cli            the three entry points (train, tune, evaluate): argv -> exit code
    flags          command-line flags generated from the config dataclasses
    config         TrainConfig and SweepConfig: every field, its flag, help and checks
    preflight      what can be refused without Ray (config, task, data, checkpoint)
    model_probe    does a built-in classifier run on the data's images (CPU or meta device)
    cluster        connect, size the request against the cluster, shared storage
    placement      workers counted whole onto nodes (and node types): what fits where
    autoscaling    the autoscaler's node types, and asking it for the workers' nodes
    trainer        fit(): the TorchTrainer for a run, its fit and its summary
    lean_trainer   Ray Train trimmed for a local Ray (no unused helper actors)
    tune           Ray Tune sweeps; sweep_results: their table, CSV and plot
    evaluate_job   jobs/evaluate.py: a checkpoint evaluated by N workers
    rerun_guard    a re-run of a --name must be the same training
    train_worker   the per-worker loop: build, restore, wrap, train/evaluate/report
    train_epoch    one pass over a shard: accumulation with no_sync, AMP, clipping
    resume         where a worker starts from, and restoring its state
    train_report   metrics to Ray from every rank; rank 0's checkpoint of every rank's state
    worker         who this worker is (ranks, device), rank-0 logging, the rank table
    collectives    all-gather and summed reductions (single-process safe)
    train_state    TrainState, TrainProgress, EpochSums: what a step changes
    checkpoint     what a checkpoint holds, atomic save, weights_only load
    seeding        every seed a run sets, and why
    loaders        DataLoaders with resumable, seeded samplers
    bad_samples    unreadable samples skipped, named in bad_samples.csv, capped per epoch
    sharded_eval   exact distributed evaluation (every sample counted once)
    datasets       datasets by name; transforms, parquet_data and synthetic_data beside it
    models         models by name; memory_format: channels_last or not
    optim          optimizer and warm-up + cosine schedule; precision: autocast, GradScaler
    loss_guard     stop on a non-finite loss, naming step and rank
    retry_policy   which failures a restart cannot cure (run in Ray Train's controller)
    comm_stats     counting gradient all-reduces
    step_timing    steady-state step times; timeline: time stamps of a run's stages
    run_logs       metrics.csv, TensorBoard, curves.png; plots: figures as PNG
    reporting      what gets printed
    storage        local paths and URIs: atomic writes, reads, checkpoint listing
    export         the best checkpoint for inference without Ray
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Imported when first used, so that ``import ray_ddp.config.train`` (the entry points' first
# import, before bad flags are refused) does not import torch.
_PUBLIC = {
    "Task": "ray_ddp.task.interface",
    "Sum": "ray_ddp.task.interface",
    "TrainConfig": "ray_ddp.config.train",
    "ConfigError": "ray_ddp.config.train",
    "fit": "ray_ddp.driver.run",
    "load_model": "ray_ddp.checkpoint.format",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ray_ddp' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_PUBLIC[name]), name)
