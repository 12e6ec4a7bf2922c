"""A finished sweep's results: one row per trial, ``results.csv``, ``sweep.png`` and the
table the driver prints. No Ray: rows are made from Tune's results by ``tune``."""

from __future__ import annotations

import csv
import io
import os
from typing import Any

from ray_ddp.config.batch import global_batch
from ray_ddp.io.plots import figure, integer_ticks, png_bytes
from ray_ddp.io.storage import join, write_bytes

CSV_FIELDS = (
    "trial", "lr", "batch_size", "global_batch_size", "epochs_run", "metric", "best_value",
    "best_val_loss", "final_value", "status", "best_checkpoint",
)  # fmt: skip


def trial_lr(config: dict[str, Any]) -> float:
    """A trial's peak lr: the sampled one, times its batch / --batch-size with --scale-lr
    (workers and accumulation are the same in every trial, so that is the global ratio)."""
    scale = config["batch_size"] / config["train"]["batch_size"] if config["scale_lr"] else 1.0
    return config["lr"] * scale


def trial_row(result, epochs: int, metric: str = "val_acc", mode: str = "max") -> dict[str, Any]:
    """One trial of a ``ResultGrid``: its hyperparameters, its best (by ``metric``, higher
    or lower is better as ``mode`` says) and final figures, its curve."""
    frame = result.metrics_dataframe
    # A trial that failed before it reported anything may come back without its config.
    config = result.config or {}
    base = config.get("train")
    row: dict[str, Any] = {
        "trial": (result.metrics or {}).get("trial_id") or os.path.basename(str(result.path)),
        "lr": trial_lr(config) if base else None,
        "batch_size": config.get("batch_size"),
        "global_batch_size": (
            global_batch(config["batch_size"], base["num_workers"], base["accum_steps"])
            if base
            else None
        ),
        "epochs_run": 0,
        "metric": metric,
        "best_value": None,
        "best_val_loss": None,
        "final_value": None,
        "status": "error" if result.error else "no result",
        "best_checkpoint": None,
        "curve": [],
    }
    if frame is None or frame.empty or metric not in frame:
        return row
    # Epoch reports only: a mid-epoch checkpoint's report carries no validation.
    frame = frame.dropna(subset=[metric])
    if "mid_epoch" in frame:
        frame = frame[frame["mid_epoch"] != True]  # noqa: E712 - NaN where absent
    if frame.empty:
        return row
    best_index = frame[metric].idxmax() if mode == "max" else frame[metric].idxmin()
    row.update(
        epochs_run=int(frame["epoch"].max()),
        best_value=float(frame.loc[best_index, metric]),
        best_val_loss=float(frame.loc[best_index, "val_loss"]) if "val_loss" in frame else None,
        final_value=float(frame[metric].iloc[-1]),
        best_checkpoint=frame.loc[best_index].get("checkpoint_path"),
        curve=[(int(e), float(a)) for e, a in zip(frame["epoch"], frame[metric], strict=True)],
    )
    if not result.error:
        row["status"] = "stopped early" if row["epochs_run"] < epochs else "finished"
    return row


def write_outputs(sweep_dir: str, trials: list[dict[str, Any]]) -> None:
    """results.csv and sweep.png in the sweep directory (local path or URI)."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(trials)
    write_bytes(join(sweep_dir, "results.csv"), text.getvalue().encode())
    write_bytes(join(sweep_dir, "sweep.png"), _plot(trials))


def _plot(trials: list[dict[str, Any]]) -> bytes:
    fig, (left, right) = figure(2, (11, 4.2))
    markers = "osD^v<>ph*"
    for i, batch in enumerate(sorted({t["batch_size"] for t in trials} - {None})):
        group = [t for t in trials if t["batch_size"] == batch and t["best_value"] is not None]
        left.scatter(
            [t["lr"] for t in group],
            [t["best_value"] for t in group],
            marker=markers[i % len(markers)],
            s=60,
            label=f"batch {batch}/worker",
        )
    left.set_xscale("log")
    left.set_xlabel("learning rate (log)")
    metric = next((t["metric"] for t in trials), "")
    left.set_ylabel(f"best {metric}")
    left.set_title(f"best {metric} by learning rate")
    left.legend()
    left.grid(alpha=0.3)
    for t in trials:
        if t["curve"]:
            epochs, accs = zip(*t["curve"], strict=True)
            style = "--" if t["status"] == "stopped early" else "-"
            right.plot(epochs, accs, style, marker=".", label=f"{t['trial']} lr={t['lr']:.1e}")
    integer_ticks(right)
    right.set_xlabel("epoch")
    right.set_ylabel(metric)
    right.set_title("learning curves (dashed: stopped early)")
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    return png_bytes(fig)


def results_table(summary: dict[str, Any]) -> str:
    best = summary["best"]
    metric = best["metric"]
    lines = [
        f"{'trial':<8} {'lr':>9} {'batch':>5} {'epochs':>6} {'best ' + metric:>14}  status",
    ]
    for t in summary["trials"]:
        acc = f"{t['best_value']:.4f}" if t["best_value"] is not None else "-"
        lr = f"{t['lr']:.2e}" if t["lr"] is not None else "-"
        lines.append(
            f"{t['trial']:<8} {lr:>9} {t['batch_size'] or '-':>5} {t['epochs_run']:>6} "
            f"{acc:>14}  {t['status']}"
        )
    lines += [
        f"best: trial {best['trial']}  lr {best['lr']:.3e}  batch {best['batch_size']}/worker "
        f"(global {best['global_batch_size']})  {metric} {best['best_value']:.4f}",
        f"best checkpoint: {best['best_checkpoint']}",
        f"results: {join(summary['sweep_dir'], 'results.csv')} and sweep.png; "
        f"{summary['wall_s']:.0f} s wall",
    ]
    return "\n".join(lines)
