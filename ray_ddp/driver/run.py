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

from ray_ddp.cluster.resources import prepare_cluster_run, worker_resources
from ray_ddp.config import BUILTIN_TASK, ConfigError, TrainConfig
from ray_ddp.driver.elastic import keep_global_batch, scaling_workers
from ray_ddp.driver.preflight import PreparedTask
from ray_ddp.driver.rerun_guard import check_rerun, recorded_config, write_record
from ray_ddp.image_classification.transforms import augment_policy
from ray_ddp.io.storage import is_uri, join, upload_dir, uri_of, write_bytes
from ray_ddp.io.timeline import mark
from ray_ddp.reliability.hangs.report import latest_hang
from ray_ddp.reliability.hangs.settings import nccl_env, process_group_timeout_s
from ray_ddp.reliability.retry_policy import stop_hopeless_retries
from ray_ddp.task import Task
from ray_ddp.testing.harness import NONE, Harness, from_env


class Interrupted(Exception):
    """The user stopped the run (Ctrl-C); its checkpoints are intact."""

    def __init__(self, cfg: TrainConfig):
        run_dir = cfg.run_dir
        super().__init__(
            f"interrupted: the workers were stopped; checkpoints in {run_dir} are intact. "
            f"Resume with the same flags and --name {cfg.name}"
        )


class TrainingHung(Exception):
    """The run's last attempt hung (the watchdog's line: stuck ranks, where, the stacks)."""


def default_name(cfg: TrainConfig, task: Task) -> str:
    return f"{task.name(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}"


def fit(
    task: Task | str,
    config: TrainConfig | None = None,
    *,
    harness: Harness | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """Train ``task`` (a Task object, or ``package.module:Name``) with ``config`` (default:
    ``TrainConfig()``) and any of its fields given as keywords; returns the summary that
    ``jobs/train.py`` prints. The same checks, training and checkpoints as the command
    line; raises ConfigError on bad input and ray.train.TrainingFailedError when training
    fails. For your own driver script::

        import ray_ddp
        summary = ray_ddp.fit(MyTask(), num_workers=4, epochs=10, name="my-run")
        model = ray_ddp.load_model(summary["best"]["checkpoint"])

    ``harness`` is for ray_ddp's own tests (``ray_ddp.testing``): faults to inject."""
    from ray_ddp.task.checks import as_task, spec_of

    cfg = dataclasses.replace(config or TrainConfig(), **fields)
    if isinstance(task, str):
        return run_training(dataclasses.replace(cfg, task=task), harness=harness)
    task = as_task(task, f"fit({type(task).__name__})")
    return run_training(dataclasses.replace(cfg, task=spec_of(task)), task, harness)


def run_training(
    cfg: TrainConfig, task: Task | None = None, harness: Harness | None = None
) -> dict[str, Any]:
    """Validate, connect, fit ``task`` (default: the one ``cfg.task`` names). Returns the
    summary. Raises ConfigError on bad input and ray.train.TrainingFailedError when
    training fails. ``harness``: a test's (default: ``RAY_DDP_HARNESS``'s, usually none)."""
    harness = harness if harness is not None else from_env()
    if harness.sample_ledger and cfg.data_engine == "ray":
        raise ConfigError(
            "the sample ledger needs sample indices, which --data-engine ray does not have"
        )
    cfg, prepared = prepare_cluster_run(cfg, task=task)
    # Record what "auto" resolved to where it decides what is trained, so a re-run that
    # asks for something else explicitly is refused (None is not compared).
    cfg = dataclasses.replace(cfg, name=cfg.name or default_name(cfg, prepared.task))
    if cfg.task == BUILTIN_TASK:
        cfg = dataclasses.replace(cfg, augment=augment_policy(cfg))
    # A re-run on another number of workers keeps the run's global batch.
    recorded = recorded_config(cfg)
    if recorded is not None:
        cfg = keep_global_batch(cfg, recorded, f"run {cfg.name}")
    elif prepared.resume_config is not None:
        cfg = keep_global_batch(cfg, prepared.resume_config, f"--resume-from {cfg.resume_from}")
    check_rerun(cfg)  # again: num_workers and the augmentation are known now
    write_record(cfg)

    run_dir = cfg.run_dir
    print(f"run {cfg.name} -> {run_dir}", flush=True)
    cfg = shared_resume_from(cfg, run_dir, alive_nodes())
    if cfg.elastic:
        quick_elastic_restarts()
    trainer = build_trainer(cfg, prepared, harness=harness)
    from ray.train import TrainingFailedError

    mark("trainer built")
    started = time.perf_counter()
    try:
        result = trainer.fit()
    except (KeyboardInterrupt, SystemExit) as exc:
        # Ray's own SIGINT handler has aborted the controller, which stops the workers,
        # then exits 0 as if all went well; say what happened instead.
        raise Interrupted(cfg) from exc
    except TrainingFailedError as exc:
        hang = latest_hang(run_dir)
        if hang is not None:  # the last attempt hung: say where, not Ray's tracebacks
            raise TrainingHung(hang[0]) from exc
        raise
    wall_s = time.perf_counter() - started
    mark("fit returned")
    summary = build_summary(cfg, prepared.task, result, wall_s)
    if summary["best"]:
        best = summary["best"]["checkpoint"]
        summary["report"] = _final_report(prepared.task, cfg, best)
        if cfg.export:
            summary["export"] = _export(prepared.task, best, summary["run_dir"])
    return summary


def _final_report(task: Task, cfg: TrainConfig, checkpoint: str) -> str | None:
    """The task's words on its best model (samples of a language model, say), printed. A
    report that fails does not fail the finished run: it is said."""
    if type(task).final_report is Task.final_report:
        return None  # the task has none: the checkpoint is not even loaded
    import ray.train

    from ray_ddp.checkpoint.format import load_model

    try:
        with ray.train.Checkpoint(checkpoint).as_directory() as directory:
            report = task.final_report(load_model(directory, task), cfg)
    except Exception as exc:  # noqa: BLE001 - reported, training already succeeded
        print(f"final report skipped: {type(exc).__name__}: {exc}", flush=True)
        return None
    if report:
        print(report, flush=True)
    return report


def _export(task: Task, checkpoint: str, run_dir: str) -> dict[str, str]:
    """The best checkpoint for inference without Ray. A model torch.export cannot trace
    does not fail the finished run: it is said, and the checkpoint is still there."""
    from ray_ddp.driver.export import export_best

    try:
        paths = export_best(task, checkpoint, run_dir)
    except Exception as exc:  # noqa: BLE001 - reported, training already succeeded
        print(f"export skipped: {type(exc).__name__}: {exc}", flush=True)
        return {}
    print(f"exported the best checkpoint -> {join(run_dir, 'export')}", flush=True)
    return paths


ELASTIC_START_TIMEOUT_S = 30
"""How long Ray Train waits for a worker group to start, in elastic runs (its default is
60 s). After a lost node Ray's elastic policy first restarts at the old size, counted from
a view of the nodes its AutoscalingCoordinator refreshes every 20 s; that start cannot be
placed and only its timeout lets the policy retry at the size that fits. Measured on a
simulated cluster: 64 s from a lost node to training again with 60 s, 23 s with 10 s."""


def quick_elastic_restarts() -> None:
    """Shorten Ray Train's worker-group start timeout for an elastic run (a value the user
    set wins). Ray Train hands RAY_TRAIN_* variables of the driver to its controller."""
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", str(ELASTIC_START_TIMEOUT_S))


def alive_nodes() -> int:
    import ray

    return sum(1 for node in ray.nodes() if node["Alive"])


def shared_resume_from(cfg: TrainConfig, run_dir: str, nodes: int) -> TrainConfig:
    """``--resume-from`` as every worker can read it (:func:`shared_checkpoint`)."""
    if not cfg.resume_from:
        return cfg
    shared = shared_checkpoint(cfg.resume_from, run_dir, nodes, "resume_from", "--resume-from")
    return dataclasses.replace(cfg, resume_from=shared)


def shared_checkpoint(path: str, run_dir: str, nodes: int, folder: str, flag: str) -> str:
    """A checkpoint at ``path`` as every worker can read it. A URI already is. A local path
    is made absolute (workers run in directories of their own), and on a cluster of more
    than one node it is copied into ``<run_dir>/<folder>/<checkpoint>``: a worker on
    another node than the driver's may not have the path, while every node sees the run's
    storage (``cluster.check_shared_storage``). Each file of the copy is written whole."""
    if is_uri(path):
        return path
    source = os.path.abspath(os.path.expanduser(path))
    if nodes <= 1:
        return source
    target = join(run_dir, folder, os.path.basename(source.rstrip(os.sep)))
    upload_dir(source, target)
    print(f"{flag} {source} copied to {target}, where every node sees it", flush=True)
    return target


def build_trainer(
    cfg: TrainConfig,
    prepared: PreparedTask,
    callbacks: list | None = None,
    loop: Any = None,
    loop_config: dict[str, Any] | None = None,
    harness: Harness = NONE,
):
    """The TorchTrainer for a resolved config (named, absolute storage, workers known)
    and its checked task. Shared by single runs and Tune trials, so both run exactly the
    same loop."""
    from ray.train import (
        CheckpointConfig,
        FailureConfig,
        LoggingConfig,
        RunConfig,
        ScalingConfig,
    )
    from ray.train.torch import TorchConfig

    from ray_ddp.compat.lean_trainer import LeanTorchTrainer
    from ray_ddp.worker.loop import loop_config as train_loop_config
    from ray_ddp.worker.loop import train_loop_per_worker

    task = prepared.task
    if loop_config is None:
        loop_config = train_loop_config(cfg, task, prepared.facts, harness)
    ray_data: dict[str, Any] = {}
    if cfg.data_engine == "ray" and loop is None:  # built when the workers start
        from ray_ddp.data.ray_data.engine import trainer_datasets

        ray_data = trainer_datasets(cfg)
    return LeanTorchTrainer(
        loop or train_loop_per_worker,  # the evaluation job passes its own
        train_loop_config=loop_config,
        **ray_data,  # datasets and their split (--data-engine ray)
        # backend=None: Ray picks NCCL when the workers have GPUs, gloo otherwise.
        torch_config=TorchConfig(backend=None, timeout_s=process_group_timeout_s(cfg)),
        scaling_config=ScalingConfig(
            num_workers=scaling_workers(cfg),
            use_gpu=cfg.use_gpu,
            resources_per_worker=worker_resources(cfg),
            placement_strategy=cfg.placement_strategy,
            elastic_resize_monitor_interval_s=cfg.resize_check_s,  # elastic runs only
        ),
        run_config=RunConfig(
            name=cfg.name,
            storage_path=cfg.storage_path,
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.keep_checkpoints,
                checkpoint_score_attribute=f"val_{task.best_metric}",
                checkpoint_score_order=task.best_mode,
            ),
            # Ray Train's per-report INFO lines would drown the epoch lines.
            logging_config=LoggingConfig(log_level="WARNING"),
            callbacks=[
                stop_hopeless_retries(cfg.run_dir),
                *(callbacks or []),
            ],
            failure_config=FailureConfig(max_failures=cfg.failures_allowed),
            worker_runtime_env={"env_vars": nccl_env(cfg)} if cfg.use_gpu else None,
        ),
    )


def build_summary(cfg: TrainConfig, task: Task, result, wall_s: float) -> dict[str, Any]:
    """Final and best validation figures, the best checkpoint, sizes and speed."""
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
        return uri_of(cfg.storage_path, path)

    def pick(metrics: dict[str, Any]) -> dict[str, Any]:
        kept = ("epoch", "evaluated_samples")
        return {k: v for k, v in metrics.items() if k in kept or k.startswith("val_")}

    train_seconds = info.get("train_seconds", 0.0)
    return {
        "name": cfg.name,
        "run_dir": full(result.path),
        # The workers of the attempt that finished (an elastic run may end on fewer).
        "world_size": info.get("world_size", cfg.num_workers),
        "worker_range": list(cfg.worker_range),
        "device": "gpu" if cfg.use_gpu else "cpu",
        "per_worker_batch_size": cfg.batch_size,
        "accum_steps": final_metrics.get("accum_steps", cfg.accum_steps),
        "global_batch_size": cfg.global_batch_size,
        "epochs": cfg.epochs,
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
    }


def write_summary(summary: dict[str, Any], path: str) -> None:
    """Write JSON completely or not at all (a local path or a storage URI)."""
    write_bytes(path, json.dumps(summary, indent=2).encode())
