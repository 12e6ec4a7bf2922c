"""Evaluate a checkpoint with N Ray workers (``jobs/evaluate.py``).

The same exact distributed evaluation as training (each sample on exactly one rank, sums
all-reduced), plus per-class counts and, optionally, every sample's prediction written to
Parquet. The checkpoint may be a local directory or a storage URI.
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
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from ray_ddp.checkpoint import load_model
    from ray_ddp.datasets import build_datasets
    from ray_ddp.evaluation import ShardSampler
    from ray_ddp.loop import quiet_report_lines
    from ray_ddp.precision import autocast

    quiet_report_lines()
    cfg = TrainConfig.from_dict(config["train"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
    device = ray.train.torch.get_device()
    with ray.train.Checkpoint(config["checkpoint"]).as_directory() as directory:
        model = load_model(directory).to(device)
    train_ds, val_ds, info = build_datasets(dataclasses.replace(cfg, download=False), augment=False)
    dataset = val_ds if config["split"] == "val" else train_ds
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(
            dataset, batch_size=cfg.batch_size, sampler=ShardSampler(len(dataset), rank, world)
        ),  # type: ignore[arg-type]
        add_dist_sampler=False,
    )
    classes = info.num_classes
    # [loss sum, correct, count, correct per class..., count per class...], one all-reduce.
    totals = torch.zeros(3 + 2 * classes, dtype=torch.float64, device=device)
    predictions: list[tuple[int, int, int, float]] = []
    position = 0
    with torch.no_grad():
        for inputs, targets in loader:
            with autocast(cfg.amp, device):
                logits = model(inputs)
            logits = logits.float()
            predicted = logits.argmax(dim=1)
            hit = (predicted == targets).double()
            totals[0] += F.cross_entropy(logits, targets, reduction="sum").double()
            totals[1] += hit.sum()
            totals[2] += targets.numel()
            totals[3 : 3 + classes] += torch.bincount(targets, weights=hit, minlength=classes)
            totals[3 + classes :] += torch.bincount(targets, minlength=classes).double()
            if config["predictions"]:
                confidence = logits.softmax(dim=1).max(dim=1).values
                for t, p, c in zip(targets.tolist(), predicted.tolist(), confidence.tolist(),
                                   strict=True):  # fmt: skip
                    # ShardSampler order: this rank's i-th sample is index rank + i * world.
                    predictions.append((rank + position * world, t, p, c))
                    position += 1
    if world > 1:
        dist.all_reduce(totals)
        if config["predictions"]:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, predictions)
            predictions = [row for part in gathered for row in part]
    ray.train.report({"count": int(totals[2].item())})
    if rank != 0:
        return None
    values = totals.tolist()
    names = getattr(getattr(dataset, "dataset", dataset), "classes", None)
    return {
        "loss": values[0] / values[2],
        "accuracy": values[1] / values[2],
        "correct": int(values[1]),
        "count": int(values[2]),
        "per_class": [
            {
                "class": c,
                "name": str(names[c]) if names is not None and c < len(names) else str(c),
                "correct": int(values[3 + c]),
                "count": int(values[3 + classes + c]),
            }
            for c in range(classes)
        ],
        "predictions": sorted(predictions),
    }


def run_evaluation(
    checkpoint: str, split: str, overrides: dict[str, Any], predictions_path: str | None
) -> dict[str, Any]:
    """Validate, connect, evaluate with N workers; write predictions; return the results."""
    import ray.train

    from ray_ddp.checkpoint import CheckpointError, load_state
    from ray_ddp.storage import storage_location
    from ray_ddp.trainer import build_trainer, connect, preflight, resolve_scaling

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
    preflight(cfg)
    connect(cfg.address)
    cfg = resolve_scaling(cfg)
    cfg = dataclasses.replace(cfg, storage_path=storage_location(cfg.storage_path))
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
