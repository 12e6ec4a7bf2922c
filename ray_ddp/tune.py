"""Ray Tune sweeps over learning rate and per-worker batch size.

Every trial is a full distributed TorchTrainer run of the same loop as ``jobs/train.py``
(``trainer.build_trainer``), launched from a Tune function trainable; rank 0's metrics
reach Tune through Ray's Train-to-Tune callback, and ASHA stops weak trials at its rungs.
Concurrency is derived from what the cluster has and what one trial needs, so trials
never wait on each other for resources; a trial that cannot fit at all is refused at once.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.storage import check_shared_storage, storage_location, write_bytes
from ray_ddp.trainer import check_batch_fits, connect, preflight, resolve_scaling

METRIC, MODE = "val_acc", "max"


@dataclass
class SweepConfig:
    """The search space and the scheduler; everything else comes from TrainConfig."""

    lr_min: float = 1e-4
    """Lower end of the log-uniform learning-rate range."""
    lr_max: float = 1e-2
    """Upper end of the log-uniform learning-rate range."""
    batch_sizes: list[int] = field(default_factory=lambda: [32, 64, 128])
    """Per-worker batch sizes to choose from."""
    num_samples: int = 8
    """Trials to run."""
    max_concurrent_trials: int | None = None
    """Upper bound on trials at once; the cluster's capacity bounds it anyway."""
    grace_period: int = 1
    """ASHA: epochs every trial runs before it can be stopped."""
    reduction_factor: float = 2.0
    """ASHA: keep the top 1/reduction_factor of trials at each rung."""
    early_stop: bool = True
    """Use ASHA; False runs every trial to the last epoch."""
    scale_lr: bool = False
    """Scale each trial's lr by its global batch / the global batch of --batch-size."""
    resume: bool = False
    """Continue the sweep named --name from its storage path."""
    trial_cpus: float = 0.1
    """CPU share reserved for each trial's driver (Tune rejects 0; Train's controller
    takes none)."""


def validate_sweep(sweep: SweepConfig, cfg: TrainConfig) -> None:
    if not 0 < sweep.lr_min <= sweep.lr_max:
        raise ConfigError(
            f"need 0 < --lr-min <= --lr-max, got {sweep.lr_min:g} and {sweep.lr_max:g}"
        )
    if not sweep.batch_sizes or min(sweep.batch_sizes) <= 0:
        raise ConfigError("--batch-sizes must be a list of positive integers, e.g. 32,64,128")
    if sweep.num_samples <= 0:
        raise ConfigError(f"--num-samples must be positive, got {sweep.num_samples}")
    if sweep.max_concurrent_trials is not None and sweep.max_concurrent_trials <= 0:
        raise ConfigError("--max-concurrent-trials must be positive")
    if not 1 <= sweep.grace_period <= cfg.epochs:
        raise ConfigError(f"--grace-period must be in 1..--epochs ({cfg.epochs})")
    if sweep.reduction_factor <= 1:
        raise ConfigError("--reduction-factor must be greater than 1")
    if sweep.resume and not cfg.name:
        raise ConfigError("--resume needs the --name of the sweep to continue")


def plan_concurrency(cfg: TrainConfig, sweep: SweepConfig, resources: dict[str, float]) -> int:
    """How many trials can run at once without any of them waiting for resources."""
    assert cfg.num_workers is not None
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    trial_cpus = sweep.trial_cpus + cfg.num_workers * cfg.cpus_per_worker
    trial_gpus = cfg.num_workers if cfg.use_gpu else 0
    if trial_cpus > cpus + 1e-9 or trial_gpus > gpus:
        raise ConfigError(
            f"one trial needs {trial_cpus:g} CPUs ({sweep.trial_cpus:g} for its driver + "
            f"{cfg.num_workers} workers x {cfg.cpus_per_worker:g}) and {trial_gpus} GPUs; the "
            f"cluster has {cpus:g} CPUs and {gpus:g} GPUs: lower --num-workers or "
            "--cpus-per-worker"
        )
    fit = math.floor((cpus + 1e-9) / trial_cpus)
    if trial_gpus:
        fit = min(fit, math.floor(gpus / trial_gpus))
    return max(1, min(fit, sweep.max_concurrent_trials or fit, sweep.num_samples))


def trial_lr(config: dict[str, Any]) -> float:
    """A trial's peak lr: the sampled one, times its batch / --batch-size with --scale-lr
    (workers and accumulation are the same in every trial, so that is the global ratio)."""
    scale = config["batch_size"] / config["train"]["batch_size"] if config["scale_lr"] else 1.0
    return config["lr"] * scale


def _run_trial(config: dict[str, Any]) -> None:
    """One Tune trial: a complete TorchTrainer run with this trial's lr and batch size."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from ray_ddp.trainer import build_trainer

    base = TrainConfig.from_dict(config["train"])
    trial_id = ray.tune.get_context().get_trial_id()
    cfg = dataclasses.replace(
        base,
        lr=trial_lr(config),
        batch_size=config["batch_size"],
        # Named by trial id: a resumed sweep re-runs an unfinished trial under the same
        # name, and Train picks up that run's latest checkpoint instead of starting over.
        name=trial_id,
        storage_path=config["train_storage"],
        extra={**base.extra, "log_prefix": f"[{trial_id}] "},
    )
    build_trainer(cfg, callbacks=[TuneReportCallback()]).fit()


def run_sweep(cfg: TrainConfig, sweep: SweepConfig) -> dict[str, Any]:
    """Validate, connect, plan, sweep. Returns the summary (best trial and all trials)."""
    validate_sweep(sweep, cfg)
    info = preflight(cfg)
    for batch_size in sweep.batch_sizes:
        check_batch_fits(cfg, info, batch_size)
    connect(cfg.address)
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search import BasicVariantGenerator

    cfg = resolve_scaling(cfg)
    for batch_size in sweep.batch_sizes:  # again, now that num_workers is known
        check_batch_fits(cfg, info, batch_size)
    concurrency = plan_concurrency(cfg, sweep, ray.cluster_resources())
    name = cfg.name or f"sweep-{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    storage = storage_location(cfg.storage_path)
    check_shared_storage(storage)
    sweep_dir = os.path.join(storage, name)
    cfg = dataclasses.replace(cfg, name=None, storage_path=storage, summary_json=None)

    trainable = tune.with_resources(_run_trial, {"CPU": sweep.trial_cpus})
    print(
        f"sweep {name} -> {sweep_dir}: {sweep.num_samples} trials, up to {concurrency} at "
        f"once, lr log-uniform [{sweep.lr_min:g}, {sweep.lr_max:g}], per-worker batch in "
        f"{sweep.batch_sizes}, {cfg.num_workers} workers per trial, "
        + (
            f"ASHA (grace {sweep.grace_period}, reduction {sweep.reduction_factor:g})"
            if sweep.early_stop
            else "no early stopping"
        ),
        flush=True,
    )
    if sweep.scale_lr:
        print(
            f"lr scaling on: each trial's lr x (its batch / {cfg.batch_size}), the global "
            "batch ratio (workers and accumulation are the same for every trial)",
            flush=True,
        )
    started = time.perf_counter()
    if sweep.resume:
        if not tune.Tuner.can_restore(sweep_dir):
            raise ConfigError(f"--resume: no sweep to continue at {sweep_dir}")
        tuner = tune.Tuner.restore(
            sweep_dir, trainable, resume_unfinished=True, resume_errored=True
        )
    else:
        if os.path.exists(sweep_dir):
            raise ConfigError(
                f"{sweep_dir} already exists: pass --resume to continue it, or a new --name"
            )
        scheduler = (
            ASHAScheduler(
                time_attr="epoch",
                max_t=cfg.epochs,
                grace_period=sweep.grace_period,
                reduction_factor=sweep.reduction_factor,
            )
            if sweep.early_stop
            else FIFOScheduler()
        )
        tuner = tune.Tuner(
            trainable,
            param_space={
                "train": cfg.to_dict(),
                "train_storage": os.path.join(sweep_dir, "train"),
                "scale_lr": sweep.scale_lr,
                "lr": tune.loguniform(sweep.lr_min, sweep.lr_max),
                "batch_size": tune.choice(sweep.batch_sizes),
            },
            tune_config=tune.TuneConfig(
                metric=METRIC,
                mode=MODE,
                num_samples=sweep.num_samples,
                scheduler=scheduler,
                # Seeded: the same --seed samples the same learning rates and batch sizes.
                # The concurrency limit goes here: Tune ignores TuneConfig's
                # max_concurrent_trials when given a search algorithm instance.
                search_alg=BasicVariantGenerator(random_state=cfg.seed, max_concurrent=concurrency),
            ),
            run_config=tune.RunConfig(name=name, storage_path=storage, verbose=0),
        )
    grid = tuner.fit()
    wall_s = time.perf_counter() - started
    trials = [_trial_row(result, cfg.epochs) for result in grid]
    trials.sort(key=lambda t: t["trial"])
    finished = [t for t in trials if t["best_val_acc"] is not None]
    if not finished:
        raise RuntimeError(f"no trial reported a result; see the trial errors under {sweep_dir}")
    best = max(finished, key=lambda t: t["best_val_acc"])
    write_outputs(sweep_dir, trials)
    return {
        "sweep_dir": sweep_dir,
        "wall_s": wall_s,
        "concurrency": concurrency,
        "best": best,
        "trials": trials,
    }


def _trial_row(result, epochs: int) -> dict[str, Any]:
    frame = result.metrics_dataframe
    config = result.config
    base = config["train"]
    row: dict[str, Any] = {
        "trial": (result.metrics or {}).get("trial_id") or os.path.basename(str(result.path)),
        "lr": trial_lr(config),
        "batch_size": config["batch_size"],
        "global_batch_size": config["batch_size"] * base["num_workers"] * base["accum_steps"],
        "epochs_run": 0,
        "best_val_acc": None,
        "best_val_loss": None,
        "final_val_acc": None,
        "status": "error" if result.error else "finished",
        "best_checkpoint": None,
        "curve": [],
    }
    if frame is None or frame.empty or METRIC not in frame:
        return row
    frame = frame.dropna(subset=[METRIC])
    best_index = frame[METRIC].idxmax()
    row.update(
        epochs_run=int(frame["epoch"].max()),
        best_val_acc=float(frame.loc[best_index, METRIC]),
        best_val_loss=float(frame.loc[best_index, "val_loss"]),
        final_val_acc=float(frame[METRIC].iloc[-1]),
        best_checkpoint=frame.loc[best_index].get("checkpoint_path"),
        curve=[(int(e), float(a)) for e, a in zip(frame["epoch"], frame[METRIC], strict=True)],
    )
    if not result.error and row["epochs_run"] < epochs:
        row["status"] = "stopped early"
    return row


CSV_FIELDS = (
    "trial", "lr", "batch_size", "global_batch_size", "epochs_run", "best_val_acc",
    "best_val_loss", "final_val_acc", "status", "best_checkpoint",
)  # fmt: skip


def write_outputs(sweep_dir: str, trials: list[dict[str, Any]]) -> None:
    """results.csv and sweep.png in the sweep directory (local path or URI)."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(trials)
    write_bytes(os.path.join(sweep_dir, "results.csv"), text.getvalue().encode())
    write_bytes(os.path.join(sweep_dir, "sweep.png"), _plot(trials))


def _plot(trials: list[dict[str, Any]]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    markers = "osD^v<>ph*"
    for i, batch in enumerate(sorted({t["batch_size"] for t in trials})):
        group = [t for t in trials if t["batch_size"] == batch and t["best_val_acc"] is not None]
        left.scatter(
            [t["lr"] for t in group],
            [t["best_val_acc"] for t in group],
            marker=markers[i % len(markers)],
            s=60,
            label=f"batch {batch}/worker",
        )
    left.set_xscale("log")
    left.set_xlabel("learning rate (log)")
    left.set_ylabel(f"best {METRIC}")
    left.set_title("best validation accuracy by learning rate")
    left.legend()
    left.grid(alpha=0.3)
    for t in trials:
        if t["curve"]:
            epochs, accs = zip(*t["curve"], strict=True)
            style = "--" if t["status"] == "stopped early" else "-"
            right.plot(epochs, accs, style, marker=".", label=f"{t['trial']} lr={t['lr']:.1e}")
    from matplotlib.ticker import MaxNLocator

    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_xlabel("epoch")
    right.set_ylabel(METRIC)
    right.set_title("learning curves (dashed: stopped early)")
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def results_table(summary: dict[str, Any]) -> str:
    lines = [
        f"{'trial':<8} {'lr':>9} {'batch':>5} {'epochs':>6} {'best val_acc':>12}  status",
    ]
    for t in summary["trials"]:
        acc = f"{100 * t['best_val_acc']:.2f}%" if t["best_val_acc"] is not None else "-"
        lines.append(
            f"{t['trial']:<8} {t['lr']:>9.2e} {t['batch_size']:>5} {t['epochs_run']:>6} "
            f"{acc:>12}  {t['status']}"
        )
    best = summary["best"]
    lines += [
        f"best: trial {best['trial']}  lr {best['lr']:.3e}  batch {best['batch_size']}/worker "
        f"(global {best['global_batch_size']})  val_acc {100 * best['best_val_acc']:.2f}%",
        f"best checkpoint: {best['best_checkpoint']}",
        f"results: {os.path.join(summary['sweep_dir'], 'results.csv')} and sweep.png; "
        f"{summary['wall_s']:.0f} s wall",
    ]
    return "\n".join(lines)
