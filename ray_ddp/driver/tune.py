"""Ray Tune sweeps over learning rate and per-worker batch size.

Every trial is a full distributed TorchTrainer run of the same loop as ``jobs/train.py``
(``trainer.build_trainer``), launched from a Tune function trainable; rank 0's metrics
reach Tune through Ray's Train-to-Tune callback, and ASHA stops weak trials at its rungs.
Concurrency is derived from what the cluster has and what one trial needs, so trials
never wait on each other for resources; a trial that cannot fit at all is refused at once.
A sweep of a task given as an object (an own loop, ``ray_ddp.sweep``) hands that object
to every trial; a task named by ``--task`` is loaded by its name in each trial.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from ray_ddp.config import ConfigError, SweepConfig, TrainConfig, validate_sweep
from ray_ddp.config.sections import Optimisation, Scaling
from ray_ddp.driver.prepare import prepare_cluster_run
from ray_ddp.driver.sweep_results import trial_lr, trial_row, write_outputs
from ray_ddp.driver.tracking import finish_sweep, open_sweep
from ray_ddp.io.storage import exists, join, storage_location, uri_of
from ray_ddp.task import Task


def plan_concurrency(scaling: Scaling, sweep: SweepConfig, resources: dict[str, float]) -> int:
    """How many trials, each on the (resolved) workers of ``scaling``, can run at once
    without any of them waiting for resources."""
    assert scaling.num_workers is not None
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    trial_cpus = sweep.trial_cpus + scaling.num_workers * scaling.cpus_per_worker
    trial_gpus = scaling.num_workers if scaling.use_gpu else 0
    if trial_cpus > cpus + 1e-9 or trial_gpus > gpus:
        raise ConfigError(
            f"one trial needs {trial_cpus:g} CPUs ({sweep.trial_cpus:g} for its driver + "
            f"{scaling.num_workers} workers x {scaling.cpus_per_worker:g}) and "
            f"{trial_gpus} GPUs; the "
            f"cluster has {cpus:g} CPUs and {gpus:g} GPUs: lower --num-workers or "
            "--cpus-per-worker"
        )
    fit = math.floor((cpus + 1e-9) / trial_cpus)
    if trial_gpus:
        fit = min(fit, math.floor(gpus / trial_gpus))
    # A custom resource the workers ask for (--resources-per-worker) bounds it the same way.
    for name, amount in (scaling.resources_per_worker or {}).items():
        have, need = resources.get(name, 0.0), scaling.num_workers * amount
        if need > have + 1e-9:
            raise ConfigError(
                f"one trial needs {need:g} {name} ({scaling.num_workers} workers x "
                f"{amount:g}); "
                f"the cluster has {have:g}: lower --num-workers"
            )
        fit = min(fit, math.floor((have + 1e-9) / need))
    return max(1, min(fit, sweep.max_concurrent_trials or fit, sweep.num_samples))


def _run_trial(config: dict[str, Any], task: Task | None = None) -> None:
    """One Tune trial: a complete TorchTrainer run with this trial's lr and batch size, of
    ``task`` (the sweep's object: an own loop, whose function no name can load), else of
    the task ``--task`` names."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from ray_ddp.driver.preflight import PreparedTask
    from ray_ddp.driver.tracking import open_tracking, settings_for
    from ray_ddp.driver.trainer import build_trainer
    from ray_ddp.task.loading import load_task

    base = TrainConfig.from_dict(config["train"])
    task = task if task is not None else load_task(base.target.task)
    prepared = PreparedTask(task, config["facts"], None, None)
    trial_id = ray.tune.get_context().get_trial_id()
    cfg = base.replace(
        lr=trial_lr(config),
        batch_size=config["batch_size"],
        # Named by trial id: a resumed sweep re-runs an unfinished trial under the same
        # name, and Train picks up that run's latest checkpoint instead of starting over.
        name=trial_id,
        storage_path=config["train_storage"],
        log_prefix=f"[{trial_id}] ",
    )
    # --tracking: the trial's own run, a child of the sweep's (its lr and batch as params).
    tracking = settings_for(
        cfg.logging, cfg.checkpointing, parent_run_id=config.get("tracking_parent")
    )
    open_tracking(tracking)
    # Its artifacts and status come from the sweep's driver (finish_sweep): Tune stops a
    # trial at its last report, before its fit returns here.
    build_trainer(cfg, prepared, callbacks=[TuneReportCallback()], tracking=tracking).fit()


def refuse_existing(sweep_dir: str) -> None:
    """A new sweep never writes into an existing one's directory (its Tune state, results
    and trials would be overwritten). It exists when anything is there: on an object store
    (s3://...), any object under its prefix."""
    if exists(sweep_dir):
        raise ConfigError(
            f"{sweep_dir} already exists: pass --resume to continue it, or a new --name"
        )


def run_sweep(cfg: TrainConfig, sweep: SweepConfig, task: Task | None = None) -> dict[str, Any]:
    """Validate, connect, plan, sweep ``task`` (an object every trial gets: an own loop),
    else the task ``cfg.target.task`` names. Returns the summary (best trial and all
    trials)."""
    validate_sweep(sweep, cfg)
    if cfg.checkpointing.name and not sweep.resume:
        refuse_existing(
            join(storage_location(cfg.checkpointing.storage_path), cfg.checkpointing.name)
        )
    cfg, prepared = prepare_cluster_run(cfg, sweep.batch_sizes, task, dashboard=True)
    metric, mode = f"val_{prepared.task.best_metric}", prepared.task.best_mode
    import ray

    concurrency = plan_concurrency(cfg.scaling, sweep, ray.cluster_resources())
    label = prepared.task.name(cfg)
    name = cfg.checkpointing.name or f"sweep-{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    sweep_dir = join(cfg.checkpointing.storage_path, name)
    cfg = cfg.replace(name=None, summary_json=None)
    _announce(cfg.scaling, cfg.optim, sweep, name, sweep_dir, concurrency)
    if not sweep.resume:
        refuse_existing(sweep_dir)  # a generated name too (before the tracker writes there)
    searched = {**dataclasses.asdict(sweep), "concurrency": concurrency, **cfg.to_dict()}
    tracking, parent = open_sweep(cfg.logging, cfg.checkpointing, name, sweep_dir, searched)
    started = time.perf_counter()
    tuner = _tuner(cfg, sweep, name, sweep_dir, concurrency, prepared.facts, metric, mode,
                   parent, task)  # fmt: skip
    grid = tuner.fit()
    wall_s = time.perf_counter() - started
    trials = [trial_row(result, cfg.optim.epochs, metric, mode) for result in grid]
    for t in trials:  # Tune's paths drop the scheme and options of a URI storage
        if t["best_checkpoint"]:
            t["best_checkpoint"] = uri_of(cfg.checkpointing.storage_path, t["best_checkpoint"])
    trials.sort(key=lambda t: t["trial"])
    finished = [t for t in trials if t["best_value"] is not None]
    if not finished:
        raise RuntimeError(f"no trial reported a result; see the trial errors under {sweep_dir}")
    best = (max if mode == "max" else min)(finished, key=lambda t: t["best_value"])
    write_outputs(sweep_dir, trials)
    summary = {
        "sweep_dir": sweep_dir,
        "wall_s": wall_s,
        "concurrency": concurrency,
        "metric": metric,
        "mode": mode,
        "best": best,
        "trials": trials,
    }
    finish_sweep(tracking, parent, summary, join(sweep_dir, "train"))
    return summary


def _announce(
    scaling: Scaling, optim: Optimisation, sweep: SweepConfig, name: str, sweep_dir: str,
    concurrency: int,
) -> None:  # fmt: skip
    print(
        f"sweep {name} -> {sweep_dir}: {sweep.num_samples} trials, up to {concurrency} at "
        f"once, lr log-uniform [{sweep.lr_min:g}, {sweep.lr_max:g}], per-worker batch in "
        f"{sweep.batch_sizes}, {scaling.num_workers} workers per trial, "
        + (
            f"ASHA (grace {sweep.grace_period}, reduction {sweep.reduction_factor:g})"
            if sweep.early_stop
            else "no early stopping"
        ),
        flush=True,
    )
    if sweep.scale_lr:
        print(
            f"lr scaling on: each trial's lr x (its batch / {optim.batch_size}), the global "
            "batch ratio (workers and accumulation are the same for every trial)",
            flush=True,
        )


def _tuner(
    cfg: TrainConfig,
    sweep: SweepConfig,
    name: str,
    sweep_dir: str,
    concurrency: int,
    facts: dict[str, Any],
    metric: str,
    mode: str,
    parent: str | None = None,
    task: Task | None = None,
):
    """The sweep's Tuner: the one at ``sweep_dir`` continued (``--resume``), or a new one.
    ``task``: the object every trial runs, through Ray's object store
    (``tune.with_parameters``: pickled once, not in every trial's config and results)."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search import BasicVariantGenerator

    from ray_ddp.cluster.connect import alive_nodes
    from ray_ddp.driver.run import shared_resume_from

    trial = _run_trial if task is None else tune.with_parameters(_run_trial, task=task)
    trainable = tune.with_resources(trial, {"CPU": sweep.trial_cpus})
    if sweep.resume:
        if not tune.Tuner.can_restore(sweep_dir):
            raise ConfigError(f"--resume: no sweep to continue at {sweep_dir}")
        return tune.Tuner.restore(sweep_dir, trainable, resume_unfinished=True, resume_errored=True)
    cfg = cfg.replace(checkpointing=shared_resume_from(cfg.checkpointing, sweep_dir, alive_nodes()))
    scheduler = (
        ASHAScheduler(
            time_attr="epoch",
            max_t=cfg.optim.epochs,
            grace_period=sweep.grace_period,
            reduction_factor=sweep.reduction_factor,
        )
        if sweep.early_stop
        else FIFOScheduler()
    )
    return tune.Tuner(
        trainable,
        param_space={
            "train": cfg.to_dict(),
            "train_storage": join(sweep_dir, "train"),
            "facts": facts,
            "scale_lr": sweep.scale_lr,
            "lr": tune.loguniform(sweep.lr_min, sweep.lr_max),
            "batch_size": tune.choice(sweep.batch_sizes),
            "tracking_parent": parent,  # the sweep's tracker run (--tracking)
        },
        tune_config=tune.TuneConfig(
            metric=metric,
            mode=mode,
            num_samples=sweep.num_samples,
            scheduler=scheduler,
            # Seeded: the same --seed samples the same learning rates and batch sizes.
            # The concurrency limit goes here: Tune ignores TuneConfig's
            # max_concurrent_trials when given a search algorithm instance.
            search_alg=BasicVariantGenerator(
                random_state=cfg.optim.seed, max_concurrent=concurrency
            ),
        ),
        run_config=tune.RunConfig(
            name=name, storage_path=cfg.checkpointing.storage_path, verbose=0
        ),
    )
