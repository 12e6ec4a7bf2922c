"""``jobs/evaluate.py``: evaluate a checkpoint with N Ray workers.

The same exact sharded evaluation as training's validation (``ray_ddp.worker.evaluate``: each
sample on exactly one rank, sums all-reduced) with the task's ``evaluation_metrics``
(per-class accuracy for the built-in classification) and, optionally, every sample's
``predictions`` written to Parquet. The checkpoint may be a local directory or
a storage URI: every worker reads it itself, a remote one from a download of its own
(``worker.resume.open_checkpoint``). A sharded checkpoint (``--strategy fsdp2``) is
evaluated sharded, each worker holding its part of the model (:func:`_checkpoint_model`);
the results say what each held (``held_bytes``, ``model_bytes``).

Unreadable samples (``ray_ddp.data.unreadable``) are skipped as in training, gathered from
every rank and named: in the printed summary, in ``--summary-json`` (``unreadable``,
``split_samples``, ``unreadable_samples``) and in ``--predictions`` (a row per sample of
the split, ``unreadable`` true for them). More than ``--max-bad-samples`` of them stop the
evaluation (:func:`check_unreadable`): no figures, one line naming them, exit 1.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.task import Task

if TYPE_CHECKING:
    from torch import nn

    from ray_ddp.worker.identity import Worker
    from ray_ddp.worker.resume import Restored

SPLITS = ("val", "train")
NAMED = 5
"""Unreadable samples the printed summary names (``--summary-json`` lists them all)."""


def eval_loop_per_worker(config: dict[str, Any]) -> dict[str, Any] | None:
    import ray.train

    from ray_ddp.data.loaders import eval_loader
    from ray_ddp.data.unreadable import SkipUnreadable, SkipUnreadableCollate
    from ray_ddp.worker.collectives import all_gather
    from ray_ddp.worker.evaluate import evaluate
    from ray_ddp.worker.identity import start_worker
    from ray_ddp.worker.resume import open_checkpoint
    from ray_ddp.worker.sharding import held_bytes

    cfg = TrainConfig.from_dict(config["train"])
    task = config["task"]
    worker = start_worker(cfg.scaling.cpus_per_worker)
    # A remote checkpoint: this rank's own download (worker.resume), as a resume reads it.
    restored = open_checkpoint(config["checkpoint"])
    model, amp, whole = _checkpoint_model(restored, task, cfg.optim.amp, worker)
    held = all_gather(held_bytes(model))
    train_ds, val_ds = task.datasets(cfg.replace(download=False), config["facts"])
    dataset = val_ds if config["split"] == "val" else train_ds
    # Unreadable samples are skipped and named, as in training (ray_ddp.data.unreadable).
    loader = eval_loader(
        SkipUnreadable(dataset), cfg.optim.batch_size, worker.rank, worker.world_size,
        collate_fn=SkipUnreadableCollate(task.collate),
    )  # fmt: skip
    result = evaluate(
        model, loader, worker.device, task, amp, full=True, predictions=config["predictions"]
    )
    ray.train.report({"samples": result.samples})
    if not worker.is_main:
        return None
    unreadable = sorted(result.skipped, key=lambda pair: pair[1].index)  # every rank's
    return {
        "metrics": task.summarize(result.means),
        "sums": {name: list(pair) for name, pair in result.sums.items()},
        "samples": result.samples,
        "split_samples": len(dataset),
        "model_bytes": whole,  # the whole model's parameters and buffers
        "held_bytes": held,  # what each rank held of them, in rank order
        "unreadable": len(unreadable),
        "unreadable_samples": [
            {"index": b.index, "sample": b.name, "error": b.error, "rank": rank}
            for rank, b in unreadable
        ],
        "predictions": result.predictions,
        "columns": result.columns,
    }


def _checkpoint_model(
    restored: Restored, task: Task, amp: str, worker: Worker
) -> tuple[nn.Module, str, int]:
    """The checkpoint's model on this worker, the autocast it is evaluated under (of
    ``amp``, the run's ``--amp``), and the whole model's bytes (parameters and buffers). A
    whole checkpoint's: the whole model on every worker. A sharded one's (``--strategy
    fsdp2``) is read as a resume reads it: each rank its slices, into the model sharded
    over the workers as in training (each holding 1/N of every parameter, a block gathered
    only for its forward), never gathered whole. (Each worker builds it whole first, as
    training does; and ``shard_model`` moves it to the device before sharding it.)"""
    from ray_ddp.checkpoint.format import is_sharded, saved_config, saved_task_meta
    from ray_ddp.worker.sharding import (
        bf16_policy,
        held_bytes,
        load_model_shards,
        shard_model,
        task_blocks,
    )

    state = restored.state
    model = task.model(saved_config(state), saved_task_meta(state)["facts"])
    whole = held_bytes(model)
    if not is_sharded(state):
        model.load_state_dict(state["model"])
        return model.to(worker.device), amp, whole
    # --amp bf16 is then mostly FSDP2's MixedPrecisionPolicy, without autocast (as training).
    autocast = "off" if bf16_policy(model, amp) else amp
    model = shard_model(model, task_blocks(task, model), amp, worker.device, worker.world_size)
    assert restored.directory is not None  # a sharded checkpoint's files
    try:
        load_model_shards(restored.directory, model)
    finally:
        restored.release()
    return model, autocast, whole


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
    cfg = saved_config(state).replace(
        resume_from=None,
        min_workers=None,  # an evaluation runs on a fixed number of workers
        data_engine="torch",  # its own exact loader, whichever engine trained the model
        # The training's tracker and profile are not the evaluation's.
        tracking="none",
        tracking_uri=None,
        experiment=None,
        profile_steps=None,
        name=f"eval-{time.strftime('%Y%m%d-%H%M%S')}",
        **{k: v for k, v in overrides.items() if v is not None},
    )
    cfg, prepared = prepare_cluster_run(cfg)
    if predictions_path and type(prepared.task).predictions is Task.predictions:
        raise ConfigError(
            f"--predictions: task {cfg.target.task} defines no predictions() (per-sample columns)"
        )
    if split == "train":
        cfg = cfg.replace(augment="none")  # evaluated as it is, not augmented
    # Read by every worker: on several nodes a local checkpoint is copied to the storage.
    run_dir = cfg.checkpointing.run_dir
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
    results.update(checkpoint=checkpoint, split=split, world_size=cfg.scaling.num_workers)
    check_unreadable(results, cfg.data.max_bad_samples)  # before anything is written
    columns = results.pop("columns")
    if predictions_path:
        rows = results.pop("predictions")
        write_predictions(rows, columns, predictions_path, results["unreadable_samples"])
        results["predictions_path"] = predictions_path
    else:
        results.pop("predictions")
    return results


def check_unreadable(results: dict[str, Any], cap: int) -> None:
    """Raise BadSamplesError (one line: how many, the first by name, what to do) when the
    evaluation skipped more than ``cap`` (``--max-bad-samples``) unreadable samples."""
    from ray_ddp.data.unreadable import BadSample, BadSamplesError, count_text, stop_line

    count = results["unreadable"]
    if count <= cap:
        return
    named = [
        (s["rank"], BadSample(s["index"], s["sample"], s["error"]))
        for s in results["unreadable_samples"]
    ]
    head = f"{count_text(count)} in the {results['split']} split"
    raise BadSamplesError(stop_line(head, cap, named, count))


def write_predictions(
    rows: list[tuple], columns: list[str], path: str, unreadable: Sequence[dict[str, Any]] = ()
) -> None:
    """One row per sample of the split, by dataset ``index``: the task's prediction
    columns, ``unreadable`` (false), ``unreadable_error`` (null); for a sample that could not
    be read (``unreadable``: the results' records) the columns are null, ``unreadable`` true
    and ``unreadable_error`` says why. Parquet at a local path or a storage URI, written
    completely or not at all."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ray_ddp.io.storage import write_bytes

    blank = (None,) * len(columns)
    marked = [(*row, False, None) for row in rows]
    marked += [(s["index"], *blank, True, s["error"]) for s in unreadable]
    marked.sort(key=lambda row: row[0])
    names = ["index", *columns, "unreadable", "unreadable_error"]
    values: list[Sequence[Any]] = list(zip(*marked, strict=True)) if marked else [[] for _ in names]
    types = [None] * (len(names) - 2) + [pa.bool_(), pa.string()]
    table = pa.table(
        {
            name: pa.array(column, type=kind)
            for name, column, kind in zip(names, values, types, strict=True)
        }
    )
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
    lines += held_lines(results)
    lines += unreadable_lines(results)
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


def held_lines(results: dict[str, Any]) -> list[str]:
    """What each worker held of the model: all of it, or (a sharded checkpoint) its shard."""
    whole, held = results.get("model_bytes"), results.get("held_bytes")
    if not whole or not held:
        return []
    if all(part == whole for part in held):
        return [f"model: {_mb(whole)} MB, whole on every worker"]
    return [
        f"model: {_mb(whole)} MB, sharded (FSDP2): the workers held "
        f"{', '.join(_mb(part) for part in held)} MB, a block gathered whole only for its "
        "forward"
    ]


def _mb(size: int) -> str:
    return f"{size / 1e6:.3g}"


def unreadable_lines(results: dict[str, Any]) -> list[str]:
    """How many samples were skipped, what the figures then cover, the first by name."""
    from ray_ddp.data.unreadable import count_text

    count = results.get("unreadable", 0)
    if not count:
        return []
    lines = [
        f"{count_text(count)} skipped (metrics over {results['samples']} of "
        f"{results['split_samples']} samples)"
    ]
    for s in results["unreadable_samples"][:NAMED]:
        lines.append(f"  index {s['index']}: {s['sample']} ({s['error']}; rank {s['rank']})")
    if count > NAMED:
        lines.append(
            f"  ... and {count - NAMED} more; --summary-json and --predictions list them all"
        )
    return lines


def _shown(value: float) -> str:
    return f"{value:.4f}"
