"""``jobs/evaluate.py``: evaluate a checkpoint with N Ray workers.

The same exact sharded evaluation as training's validation (``ray_ddp.worker.evaluate``: each
sample on exactly one rank, sums all-reduced) with the task's ``evaluation_metrics``
(per-class accuracy for the built-in classification) and, optionally, every sample's
``predictions`` written to Parquet. The checkpoint may be a local directory or
a storage URI.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.task import Task

SPLITS = ("val", "train")


def eval_loop_per_worker(config: dict[str, Any]) -> dict[str, Any] | None:
    import ray.train

    from ray_ddp.checkpoint.format import load_model
    from ray_ddp.data.loaders import eval_loader
    from ray_ddp.data.unreadable import SkipUnreadable, SkipUnreadableCollate
    from ray_ddp.worker.evaluate import evaluate
    from ray_ddp.worker.identity import start_worker

    cfg = TrainConfig.from_dict(config["train"])
    task = config["task"]
    worker = start_worker(cfg.cpus_per_worker)
    with ray.train.Checkpoint(config["checkpoint"]).as_directory() as directory:
        model = load_model(directory, task).to(worker.device)
    train_ds, val_ds = task.datasets(dataclasses.replace(cfg, download=False), config["facts"])
    dataset = val_ds if config["split"] == "val" else train_ds
    # Unreadable samples are skipped and named, as in training (ray_ddp.data.unreadable).
    loader = eval_loader(
        SkipUnreadable(dataset), cfg.batch_size, worker.rank, worker.world_size,
        collate_fn=SkipUnreadableCollate(task.collate),
    )  # fmt: skip
    result = evaluate(
        model, loader, worker.device, task, cfg.amp, full=True, predictions=config["predictions"]
    )
    ray.train.report({"samples": result.samples})
    if not worker.is_main:
        return None
    return {
        "metrics": task.summarize(result.means),
        "sums": {name: list(pair) for name, pair in result.sums.items()},
        "samples": result.samples,
        "predictions": result.predictions,
        "columns": result.columns,
    }


def run_evaluation(
    checkpoint: str, split: str, overrides: dict[str, Any], predictions_path: str | None
) -> dict[str, Any]:
    """Validate, connect, evaluate with N workers; write predictions; return the results."""
    import ray.train

    from ray_ddp.checkpoint.format import CheckpointError, load_state, saved_config, saved_task_meta
    from ray_ddp.cluster.connect import alive_nodes
    from ray_ddp.cluster.shared_storage import shared_checkpoint
    from ray_ddp.driver.prepare import prepare_cluster_run
    from ray_ddp.driver.trainer import build_trainer

    if split not in SPLITS:
        raise ConfigError(f"unknown --split {split!r}; choose val or train")
    try:
        with ray.train.Checkpoint(checkpoint).as_directory() as directory:
            state = load_state(directory)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from exc
    except (FileNotFoundError, OSError) as exc:
        raise ConfigError(f"cannot open checkpoint {checkpoint}: {exc}") from exc
    cfg = dataclasses.replace(
        saved_config(state),
        resume_from=None,
        min_workers=None,  # an evaluation runs on a fixed number of workers
        data_engine="torch",  # its own exact loader, whichever engine trained the model
        name=f"eval-{time.strftime('%Y%m%d-%H%M%S')}",
        **{k: v for k, v in overrides.items() if v is not None},
    )
    cfg, prepared = prepare_cluster_run(cfg)
    if predictions_path and type(prepared.task).predictions is Task.predictions:
        raise ConfigError(
            f"--predictions: task {cfg.task} defines no predictions() (per-sample columns)"
        )
    if split == "train":
        cfg = dataclasses.replace(cfg, augment="none")  # evaluated as it is, not augmented
    # Read by every worker: on several nodes a local checkpoint is copied to the storage.
    run_dir = cfg.run_dir
    checkpoint = shared_checkpoint(checkpoint, run_dir, alive_nodes(), "checkpoint", "checkpoint")
    trainer = build_trainer(
        cfg,
        prepared,
        loop=eval_loop_per_worker,
        loop_config={
            "train": cfg.to_dict(),
            "task": prepared.task,
            # The checkpoint's facts, not today's data's: its model (and a task's data
            # normalisation, say) were built from them.
            "facts": saved_task_meta(state)["facts"],
            "checkpoint": checkpoint,
            "split": split,
            "predictions": predictions_path is not None,
        },
    )
    results = trainer.fit().return_value
    results.update(checkpoint=checkpoint, split=split, world_size=cfg.num_workers)
    columns = results.pop("columns")
    if predictions_path:
        write_predictions(results.pop("predictions"), columns, predictions_path)
        results["predictions_path"] = predictions_path
    else:
        results.pop("predictions")
    return results


def write_predictions(rows: list[tuple], columns: list[str], path: str) -> None:
    """One row per sample: its dataset ``index`` and the task's prediction columns, as
    Parquet at a local path or a storage URI, written completely or not at all."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ray_ddp.io.storage import write_bytes

    names = ["index", *columns]
    values = list(zip(*rows, strict=True)) if rows else [[] for _ in names]
    table = pa.table({name: pa.array(column) for name, column in zip(names, values, strict=True)})
    out = pa.BufferOutputStream()
    pq.write_table(table, out)
    write_bytes(path, out.getvalue().to_pybytes())


def results_text(results: dict[str, Any]) -> str:
    """The metrics, then any breakdown (``acc/<class>``) as a table with its sums."""
    lines = [
        f"checkpoint: {results['checkpoint']}",
        f"split {results['split']}: {results['samples']} samples on {results['world_size']} "
        "workers",
    ]
    sums = results["sums"]
    top = {k: v for k, v in results["metrics"].items() if "/" not in k}
    lines.append("  ".join(f"{k} {_shown(v)}" for k, v in top.items()))
    breakdown = [k for k in results["metrics"] if "/" in k]
    if breakdown:
        lines.append(f"{'metric':<24} {'value':>10} {'total':>10} {'count':>8}")
        for name in breakdown:
            total, count = sums.get(name, (float("nan"), 0))
            value = _shown(results["metrics"][name]) if count else "-"
            lines.append(f"{name[:24]:<24} {value:>10} {total:>10.6g} {count:>8.0f}")
    if "predictions_path" in results:
        lines.append(f"predictions: {results['predictions_path']}")
    return "\n".join(lines)


def _shown(value: float) -> str:
    return f"{value:.4f}"
