"""Rank 0's run logs: TensorBoard event files, ``metrics.csv`` and ``curves.png``.

They live in the run directory next to the checkpoints. For a URI storage path (s3://...)
they are written to a local staging folder and copied up after every epoch, so a run that
dies loses at most the current epoch's lines. A resumed run (a re-run, or a restart after a
failure, possibly on another node) appends: ``metrics.csv`` is first read back from the
storage and every upload replaces the whole file, earlier epochs included; each
TensorBoard writer makes a file of its own, so earlier attempts' event files are never
touched.
"""

from __future__ import annotations

import csv
import io
import os
import tempfile
import uuid
from typing import Any

from ray_ddp.io.plots import figure, integer_ticks, png_bytes
from ray_ddp.io.storage import is_uri, join, read_bytes, read_text, remove_local, write_bytes

METRICS_CSV = "metrics.csv"
CURVES_PNG = "curves.png"
TB_DIR = "tensorboard"
# The columns of metrics.csv around the task's validation metrics (``val_*``).
CSV_FIELDS = (
    "epoch", "step", "train_loss", "lr", "samples_per_s", "epoch_s",
    "speed_max_min", "memory_max_min", "peak_memory_mb",
    "world_size", "accum_steps",  # an elastic run's epochs may differ
    "data_wait_max", "data_wait_rank", "stragglers",  # space-separated ranks, or empty
    "bad_samples",  # unreadable samples skipped (named in bad_samples.csv)
    "tflops", "mfu",  # achieved TFLOP/s of all workers, and over their peak (known GPUs)
)  # fmt: skip


def csv_fields(metrics: dict[str, Any]) -> list[str]:
    """metrics.csv's header: epoch, step, train_loss, the val_* metrics, then the rest."""
    validation = [k for k in metrics if k.startswith("val_")]
    return [*CSV_FIELDS[:3], *validation, *CSV_FIELDS[3:]]


class RunLogs:
    """Open on rank 0 only; every method is cheap enough for the training loop."""

    def __init__(self, run_dir: str, tensorboard: bool) -> None:
        self.run_dir = run_dir
        self.staged = is_uri(run_dir)
        self.local_dir = tempfile.mkdtemp(prefix="ray_ddp_logs_") if self.staged else run_dir
        os.makedirs(self.local_dir, exist_ok=True)
        self._uploaded: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime)
        if self.staged:
            # Earlier attempts' rows: the staging folder is new, the history is not.
            # (A failed read raises: better a failed attempt than a lost history.)
            earlier = read_bytes(join(run_dir, METRICS_CSV))
            if earlier is not None:
                with open(os.path.join(self.local_dir, METRICS_CSV), "wb") as f:
                    f.write(earlier)
                self._mark_uploaded(METRICS_CSV)
        self.writer = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # A name no other attempt has (the default one holds the second and host).
            self.writer = SummaryWriter(
                os.path.join(self.local_dir, TB_DIR), filename_suffix=f".{uuid.uuid4().hex[:8]}"
            )

    def step(self, step: int, loss: float, lr: float) -> None:
        if self.writer is not None:
            self.writer.add_scalar("train/loss", loss, step)
            self.writer.add_scalar("train/lr", lr, step)

    def epoch(self, metrics: dict[str, Any], per_rank: list[dict[str, Any]]) -> None:
        path = os.path.join(self.local_dir, METRICS_CSV)
        new = not os.path.exists(path)
        if new:
            fields = csv_fields(metrics)
        else:  # a resumed run appends under the header the run started with
            with open(path, newline="") as f:
                fields = next(csv.reader(f))
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow(metrics)
        if self.writer is not None:
            epoch = metrics["epoch"]
            for key in (
                "train_loss",
                *(k for k in metrics if k.startswith("val_")),
                "samples_per_s",
                *(k for k in ("world_size", "accum_steps", "data_wait_max") if k in metrics),
            ):
                self.writer.add_scalar(f"epoch/{key}", metrics[key], epoch)
            if "stragglers" in metrics:
                self.writer.add_scalar(
                    "epoch/stragglers", len(metrics["stragglers"].split()), epoch
                )
            for row in per_rank:
                for key in ("samples_per_s", "peak_memory_mb", "ready_ms", "data_wait",
                            "data_wait_ms"):  # fmt: skip
                    if key in row:
                        self.writer.add_scalar(f"ranks/{key}/{row['rank']}", row[key], epoch)
            if metrics.get("stragglers"):
                self.writer.add_text("stragglers", f"ranks {metrics['stragglers']}", epoch)
            self.writer.flush()
        self._upload()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        rows = read_metrics(os.path.join(self.local_dir, METRICS_CSV))
        if rows:
            write_bytes(os.path.join(self.local_dir, CURVES_PNG), render_curves(rows))
        self._upload()
        if self.staged:
            remove_local(self.local_dir)

    def _upload(self) -> None:
        """Copy up every staged file that changed since its last upload, each whole."""
        if not self.staged:
            return
        for root, _, files in os.walk(self.local_dir):
            for name in files:
                local = os.path.join(root, name)
                relative = os.path.relpath(local, self.local_dir).replace(os.sep, "/")
                if self._uploaded.get(relative) == _stamp(local):
                    continue
                with open(local, "rb") as f:
                    write_bytes(join(self.run_dir, relative), f.read())
                self._mark_uploaded(relative)

    def _mark_uploaded(self, relative: str) -> None:
        self._uploaded[relative] = _stamp(os.path.join(self.local_dir, relative))


def _stamp(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def read_metrics(path: str) -> list[dict[str, float]]:
    """metrics.csv rows (a local path or a URI), one per epoch: the last row wins where a
    restart from an earlier checkpoint trained an epoch again."""
    text = read_text(path)
    if text is None:
        return []
    by_epoch: dict[int, dict[str, float]] = {}
    for row in csv.DictReader(io.StringIO(text, newline="")):
        by_epoch[int(row["epoch"])] = {k: float(v) for k, v in row.items() if v != ""}
    return [by_epoch[e] for e in sorted(by_epoch)]


def render_curves(rows: list[dict[str, float]]) -> bytes:
    """Loss (train and validation), and each other validation metric, against epoch, as
    PNG bytes (the best epoch of the first one marked, by its direction when known)."""
    epochs = [r["epoch"] for r in rows]
    others = [k for k in rows[-1] if k.startswith("val_") and k != "val_loss"]
    fig, (loss_ax, acc_ax) = figure(2, (10, 4))
    loss_ax.plot(epochs, [r["train_loss"] for r in rows], marker="o", label="train")
    if "val_loss" in rows[-1]:
        loss_ax.plot(epochs, [r["val_loss"] for r in rows], marker="o", label="validation")
    loss_ax.set_title("loss")
    loss_ax.legend()
    for key in others:
        acc_ax.plot(epochs, [r.get(key, float("nan")) for r in rows], marker="o", label=key)
    if others:
        acc_ax.legend()
    acc_ax.set_title("validation metrics")
    for ax in (loss_ax, acc_ax):
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        integer_ticks(ax)
    return png_bytes(fig)
