"""The TorchTrainer of a run: its scaling, failure, checkpoint and logging settings, the
loop every worker runs, and Ray Train itself (lean or stock: ``ray_ddp.compat``). Shared
by single runs, Tune trials and the evaluation job, so all run exactly the same loop."""

from __future__ import annotations

from typing import Any

from ray_ddp.cluster.resources import worker_resources
from ray_ddp.config import TrainConfig
from ray_ddp.driver.elastic import scaling_workers
from ray_ddp.driver.preflight import PreparedTask
from ray_ddp.reliability.hangs.settings import nccl_env, process_group_timeout_s
from ray_ddp.reliability.retry_policy import stop_hopeless_retries
from ray_ddp.task.own import OwnLoop
from ray_ddp.testing.harness import NONE, Harness
from ray_ddp.tracking.params import Settings


def build_trainer(
    cfg: TrainConfig,
    prepared: PreparedTask,
    callbacks: list | None = None,
    loop: Any = None,
    loop_config: dict[str, Any] | None = None,
    harness: Harness = NONE,
    tracking: Settings | None = None,
):
    """The TorchTrainer for a resolved config (named, absolute storage, workers known)
    and its checked task. Shared by single runs and Tune trials, so both run exactly the
    same loop. ``tracking``: where rank 0 tracks the run (``--tracking``)."""
    from ray.train import (
        CheckpointConfig,
        FailureConfig,
        LoggingConfig,
        RunConfig,
        ScalingConfig,
    )
    from ray.train.torch import TorchConfig

    from ray_ddp.compat.versions import reclaim_watcher_on, torch_trainer_class
    from ray_ddp.worker.loop import loop_config as train_loop_config
    from ray_ddp.worker.loop import train_loop_per_worker

    task = prepared.task
    if loop is None and isinstance(task, OwnLoop):  # a loop of the user's own
        from ray_ddp.worker.own_loop import own_loop_per_worker as loop
    if loop_config is None:
        tracked = tracking.to_dict() if tracking else None
        loop_config = train_loop_config(
            cfg, task, prepared.facts, harness, reclaim_watcher_on(), tracked
        )
    ray_data: dict[str, Any] = {}
    if cfg.data.data_engine == "ray" and loop is None:  # built when the workers start
        from ray_ddp.cluster.resources import data_task_cpus
        from ray_ddp.data.ray_data.driver import trainer_datasets
        from ray_ddp.image_classification.transforms import has_random_transform, image_decoder

        ray_data = trainer_datasets(
            cfg.data, cfg.target, cfg.optim, cfg.scaling, cfg.checkpointing.run_dir,
            data_task_cpus(cfg.scaling), image_decoder, has_random_transform(cfg.data),
        )  # fmt: skip
    return torch_trainer_class()(
        loop or train_loop_per_worker,  # the evaluation job passes its own
        train_loop_config=loop_config,
        **ray_data,  # datasets and their split (--data-engine ray)
        # backend=None: Ray picks NCCL when the workers have GPUs, gloo otherwise.
        torch_config=TorchConfig(backend=None, timeout_s=process_group_timeout_s(cfg.reliability)),
        scaling_config=ScalingConfig(
            # (MIN, MAX) for an elastic run: Train v2's ScalingConfig; the stubs mypy reads
            # are Train v1's, which has no elastic range (nor the keywords below)
            num_workers=scaling_workers(cfg.scaling),  # type: ignore[arg-type]
            use_gpu=bool(cfg.scaling.use_gpu),  # resolved by now (driver.prepare)
            resources_per_worker=worker_resources(cfg.scaling),
            placement_strategy=cfg.scaling.placement_strategy,
            elastic_resize_monitor_interval_s=cfg.scaling.resize_check_s,  # type: ignore[call-arg]
        ),
        run_config=RunConfig(  # type: ignore[call-arg]  # Train v2's keywords (above)
            name=cfg.checkpointing.name,
            storage_path=cfg.checkpointing.storage_path,
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.checkpointing.keep_checkpoints,
                checkpoint_score_attribute=f"val_{task.best_metric}",
                checkpoint_score_order=task.best_mode,
            ),
            # Ray Train's per-report INFO lines would drown the epoch lines.
            logging_config=LoggingConfig(log_level="WARNING"),
            callbacks=[
                stop_hopeless_retries(cfg.checkpointing.run_dir),
                *(callbacks or []),
            ],
            failure_config=FailureConfig(max_failures=cfg.failures_allowed),
            worker_runtime_env=(
                {"env_vars": nccl_env(True, cfg.checkpointing.name)}
                if cfg.scaling.use_gpu
                else None
            ),
        ),
    )
