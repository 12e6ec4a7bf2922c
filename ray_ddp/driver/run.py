"""The driver of a training run: the TorchTrainer, its fit, and the summary of its result.

Runs in the process that the user started (``python jobs/train.py``) or that ``ray job
submit`` started on the cluster. Everything that can be refused is refused first
(``driver.prepare``), before a single worker starts.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ray_ddp.cluster.connect import alive_nodes
from ray_ddp.cluster.shared_storage import shared_checkpoint
from ray_ddp.config import BUILTIN_TASK, ConfigError, TrainConfig
from ray_ddp.config.sections import Checkpointing
from ray_ddp.driver.elastic import keep_global_batch, quick_elastic_restarts
from ray_ddp.driver.prepare import prepare_cluster_run
from ray_ddp.driver.rerun_guard import check_rerun, recorded_config, write_record
from ray_ddp.driver.summary import build_summary
from ray_ddp.driver.tracking import (
    finish_tracking,
    open_tracking,
    profile_lines,
    settings_for,
)
from ray_ddp.driver.trainer import build_trainer
from ray_ddp.image_classification.transforms import augment_policy
from ray_ddp.io.storage import join
from ray_ddp.io.timeline import mark
from ray_ddp.reliability.hangs.report import latest_hang
from ray_ddp.task import Task
from ray_ddp.testing.harness import Harness, from_env


class Interrupted(Exception):
    """The user stopped the run (Ctrl-C); its checkpoints are intact."""

    def __init__(self, cfg: TrainConfig):
        run_dir = cfg.checkpointing.run_dir
        super().__init__(
            f"interrupted: the workers were stopped; checkpoints in {run_dir} are intact. "
            f"Resume with the same flags and --name {cfg.checkpointing.name}"
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
    from ray_ddp.task.loading import as_task, spec_of

    cfg = (config or TrainConfig()).replace(**fields)
    if isinstance(task, str):
        return run_training(cfg.replace(task=task), harness=harness)
    task = as_task(task, f"fit({type(task).__name__})")
    return run_training(cfg.replace(task=spec_of(task)), task, harness)


def run_training(
    cfg: TrainConfig, task: Task | None = None, harness: Harness | None = None
) -> dict[str, Any]:
    """Validate, connect, fit ``task`` (default: the one ``cfg.target.task`` names). Returns the
    summary. Raises ConfigError on bad input and ray.train.TrainingFailedError when
    training fails. ``harness``: a test's (default: ``RAY_DDP_HARNESS``'s, usually none)."""
    harness = harness if harness is not None else from_env()
    if harness.sample_ledger and cfg.data.data_engine == "ray":
        raise ConfigError(
            "the sample ledger needs sample indices, which --data-engine ray does not have"
        )
    cfg, prepared = prepare_cluster_run(cfg, task=task)
    # Record what "auto" resolved to where it decides what is trained, so a re-run that
    # asks for something else explicitly is refused (None is not compared).
    cfg = cfg.replace(name=cfg.checkpointing.name or default_name(cfg, prepared.task))
    if cfg.target.task == BUILTIN_TASK:
        cfg = cfg.replace(augment=augment_policy(cfg.data))
    # A re-run on another number of workers keeps the run's global batch.
    recorded = recorded_config(cfg.checkpointing)
    if recorded is not None:
        what = f"run {cfg.checkpointing.name}"
        cfg = cfg.replace(optim=keep_global_batch(cfg.scaling, cfg.optim, recorded, what))
    elif prepared.resume_config is not None:
        what = f"--resume-from {cfg.checkpointing.resume_from}"
        saved = prepared.resume_config
        cfg = cfg.replace(optim=keep_global_batch(cfg.scaling, cfg.optim, saved, what))
    check_rerun(cfg)  # again: num_workers and the augmentation are known now
    write_record(cfg)

    run_dir = cfg.checkpointing.run_dir
    print(f"run {cfg.checkpointing.name} -> {run_dir}", flush=True)
    shared = shared_resume_from(cfg.checkpointing, run_dir, alive_nodes())
    cfg = cfg.replace(checkpointing=shared)
    if cfg.scaling.elastic:
        quick_elastic_restarts()
    tracking = settings_for(cfg.logging, cfg.checkpointing)
    open_tracking(tracking)
    trainer = build_trainer(cfg, prepared, harness=harness, tracking=tracking)
    from ray.train import TrainingFailedError

    mark("trainer built")
    started = time.perf_counter()
    try:
        result = trainer.fit()
    except (KeyboardInterrupt, SystemExit) as exc:
        # Ray's own SIGINT handler has aborted the controller, which stops the workers,
        # then exits 0 as if all went well; say what happened instead.
        finish_tracking(tracking, None, "KILLED")
        raise Interrupted(cfg) from exc
    except TrainingFailedError as exc:
        finish_tracking(tracking, None, "FAILED")
        hang = latest_hang(run_dir)
        if hang is not None:  # the last attempt hung: say where, not Ray's tracebacks
            raise TrainingHung(hang[0]) from exc
        raise
    wall_s = time.perf_counter() - started
    mark("fit returned")
    summary = build_summary(
        cfg.scaling, cfg.optim, cfg.checkpointing, prepared.task, result, wall_s
    )
    if summary["best"]:
        best = summary["best"]["checkpoint"]
        summary["report"] = _final_report(prepared.task, cfg, best)
        if cfg.checkpointing.export:
            summary["export"] = _export(prepared.task, best, summary["run_dir"])
    for line in profile_lines(summary):
        print(line, flush=True)
    finish_tracking(tracking, summary)
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


def shared_resume_from(checkpointing: Checkpointing, run_dir: str, nodes: int) -> Checkpointing:
    """``checkpointing`` with ``--resume-from`` as every worker can read it
    (:func:`shared_checkpoint`)."""
    if not checkpointing.resume_from:
        return checkpointing
    shared = shared_checkpoint(
        checkpointing.resume_from, run_dir, nodes, "resume_from", "--resume-from"
    )
    return dataclasses.replace(checkpointing, resume_from=shared)
