"""``jobs/evaluate.py``: evaluate a checkpoint with N Ray workers.

The same exact sharded evaluation as training's validation (``sharded_eval``: each
sample on exactly one rank, sums all-reduced), plus per-class counts and, optionally,
every sample's prediction written to Parquet. The checkpoint may be a local directory or
a storage URI.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from ray_ddp.config import ConfigError, TrainConfig

SPLITS = ("val", "train")


def eval_loop_per_worker(config: dict[str, Any]) -> dict[str, Any] | None:
    import ray.train
    import ray.train.torch
    from torch.utils.data import DataLoader

    from ray_ddp.checkpoint import load_model
    from ray_ddp.datasets import build_datasets
    from ray_ddp.sharded_eval import ShardSampler, evaluate
    from ray_ddp.worker import start_worker

    cfg = TrainConfig.from_dict(config["train"])
    worker = start_worker(cfg.cpus_per_worker)
    with ray.train.Checkpoint(config["checkpoint"]).as_directory() as directory:
        model = load_model(directory).to(worker.device)
    train_ds, val_ds, info = build_datasets(dataclasses.replace(cfg, download=False), augment=False)
    dataset = val_ds if config["split"] == "val" else train_ds
    sampler = ShardSampler(len(dataset), worker.rank, worker.world_size)  # type: ignore[arg-type]
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler),
        add_dist_sampler=False,
    )
    result = evaluate(
        model,
        loader,
        worker.device,
        cfg.amp,
        num_classes=info.num_classes,
        predictions=config["predictions"],
    )
    ray.train.report({"count": result.count})
    if not worker.is_main:
        return None
    names = getattr(getattr(dataset, "dataset", dataset), "classes", None)
    return {
        "loss": result.loss,
        "accuracy": result.accuracy,
        "correct": result.correct,
        "count": result.count,
        "per_class": [
            {
                "class": c,
                "name": str(names[c]) if names is not None and c < len(names) else str(c),
                "correct": result.class_correct[c],
                "count": result.class_count[c],
            }
            for c in range(info.num_classes)
        ],
        "predictions": result.predictions,
    }


def run_evaluation(
    checkpoint: str, split: str, overrides: dict[str, Any], predictions_path: str | None
) -> dict[str, Any]:
    """Validate, connect, evaluate with N workers; write predictions; return the results."""
    import ray.train

    from ray_ddp.checkpoint import CheckpointError, load_state
    from ray_ddp.cluster import prepare_cluster_run
    from ray_ddp.trainer import build_trainer

    if split not in SPLITS:
        raise ConfigError(f"unknown --split {split!r}; choose val or train")
    try:
        with ray.train.Checkpoint(checkpoint).as_directory() as directory:
            state = load_state(directory)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from exc
    except (FileNotFoundError, OSError) as exc:
        raise ConfigError(f"cannot open checkpoint {checkpoint}: {exc}") from exc
    saved = {k: v for k, v in state["config"].items() if k in TrainConfig.__dataclass_fields__}
    cfg = dataclasses.replace(
        TrainConfig.from_dict(saved),
        resume_from=None,
        name=f"eval-{time.strftime('%Y%m%d-%H%M%S')}",
        **{k: v for k, v in overrides.items() if v is not None},
    )
    cfg, _ = prepare_cluster_run(cfg)
    if "://" not in checkpoint:
        checkpoint = os.path.abspath(checkpoint)
    trainer = build_trainer(
        cfg,
        loop=eval_loop_per_worker,
        loop_config={
            "train": cfg.to_dict(),
            "checkpoint": checkpoint,
            "split": split,
            "predictions": predictions_path is not None,
        },
    )
    results = trainer.fit().return_value
    results.update(checkpoint=checkpoint, split=split, world_size=cfg.num_workers)
    if predictions_path:
        write_predictions(results.pop("predictions"), predictions_path)
        results["predictions_path"] = predictions_path
    else:
        results.pop("predictions")
    return results


def write_predictions(rows: list[tuple[int, int, int, float]], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    index, label, predicted, confidence = zip(*rows, strict=True) if rows else ([], [], [], [])
    table = pa.table(
        {
            "index": pa.array(index, pa.int64()),
            "label": pa.array(label, pa.int64()),
            "predicted": pa.array(predicted, pa.int64()),
            "confidence": pa.array(confidence, pa.float32()),
        }
    )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(table, path)


def results_text(results: dict[str, Any]) -> str:
    lines = [
        f"checkpoint: {results['checkpoint']}",
        f"split {results['split']}: {results['count']} samples on {results['world_size']} "
        f"workers  loss {results['loss']:.4f}  accuracy {100 * results['accuracy']:.2f}% "
        f"({results['correct']}/{results['count']})",
        f"{'class':>5}  {'name':<16} {'count':>6}  {'accuracy':>8}",
    ]
    for row in results["per_class"]:
        acc = f"{100 * row['correct'] / row['count']:.2f}%" if row["count"] else "-"
        lines.append(f"{row['class']:>5}  {row['name'][:16]:<16} {row['count']:>6}  {acc:>8}")
    if "predictions_path" in results:
        lines.append(f"predictions: {results['predictions_path']}")
    return "\n".join(lines)
