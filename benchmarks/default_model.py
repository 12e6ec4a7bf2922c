"""Which default model trains well on small real images: ``small_resnet`` against
``small_cnn``, through the real ``jobs/train.py`` (2 CPU workers, default flags otherwise).

    .venv/bin/pip install scikit-learn          # only for this script: the digits ship in it
    python benchmarks/default_model.py          # every case (~20 min on 2 cores)
    python benchmarks/default_model.py --only digits-parquet --models small_resnet

Data: scikit-learn's handwritten digits (1,797 8x8 grey images, 10 classes), split 80/20
(1,437 train / 360 val, ``random_state=0``), written as the two file formats
``jobs/train.py`` reads: an ImageFolder tree of PNG files (``train/<class>/*.png``,
``val/<class>/*.png``) and Parquet files (``train.parquet``, ``val.parquet``: ``image``
PNG bytes, ``label`` int). Both are read at ``--image-size`` 32 (the file default). The
built-in synthetic dataset (``python jobs/train.py``'s first run) is measured too.

Each run is a subprocess started the way a user starts it; its ``--summary-json`` gives the
validation accuracy and the run's wall time; the time of the whole command (Ray start-up
included) is measured from outside. Results: ``benchmarks/results/default_model.md`` and
``default_model.json``. Nothing here is imported by the library or the tests: scikit-learn
is not a dependency of ray_ddp.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass(frozen=True)
class Case:
    name: str
    dataset: str  # synthetic | imagefolder | parquet
    augment: str | None  # None: the dataset's default
    epochs: int

    def describe(self) -> str:
        data = {
            "synthetic": "built-in synthetic (12,000 / 2,000, 16x16 RGB)",
            "imagefolder": "digits as ImageFolder PNGs",
            "parquet": "digits as Parquet image bytes",
        }[self.dataset]
        augment = self.augment or "default"
        if self.augment is None:
            augment += {"imagefolder": " (crop-flip)"}.get(self.dataset, " (none)")
        return f"{data}, augment {augment}, {self.epochs} epochs"


CASES = [
    Case("synthetic", "synthetic", None, 10),
    Case("digits-imagefolder", "imagefolder", None, 15),
    Case("digits-imagefolder-none", "imagefolder", "none", 15),
    Case("digits-imagefolder-crop", "imagefolder", "crop", 15),
    Case("digits-parquet", "parquet", None, 15),
    Case("digits-parquet-crop", "parquet", "crop", 15),
]
MODELS = ("small_cnn", "small_resnet")


# ------------------------------------------------------------------------------- data
def _png(array) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def write_digits(root: str) -> dict[str, int]:
    """``root/imagefolder`` and ``root/parquet`` from scikit-learn's digits; returns the
    split sizes."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = np.round(digits.images * (255 / 16)).astype(np.uint8)  # 0..16 -> 0..255 grey
    x_train, x_val, y_train, y_val = train_test_split(
        images, digits.target, test_size=0.2, random_state=0
    )
    os.makedirs(os.path.join(root, "parquet"))
    for split, xs, ys in (("train", x_train, y_train), ("val", x_val, y_val)):
        encoded = [_png(x) for x in xs]
        for i, (data, label) in enumerate(zip(encoded, ys, strict=True)):
            folder = os.path.join(root, "imagefolder", split, str(label))
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{i:04d}.png"), "wb") as f:
                f.write(data)
        table = pa.table({"image": pa.array(encoded, pa.binary()), "label": ys.astype("int64")})
        pq.write_table(table, os.path.join(root, "parquet", f"{split}.parquet"))
    return {"train": len(x_train), "val": len(x_val)}


# ------------------------------------------------------------------------------- runs
def command(case: Case, model: str, data_root: str, out: str) -> list[str]:
    argv = [sys.executable, os.path.join(ROOT, "jobs", "train.py"), "--model", model]
    argv += ["--epochs", str(case.epochs), "--storage-path", os.path.join(out, "runs")]
    argv += ["--name", f"{case.name}-{model}", "--summary-json", _summary_path(case, model, out)]
    if case.dataset != "synthetic":
        argv += ["--dataset", case.dataset, "--data-dir", os.path.join(data_root, case.dataset)]
    if case.augment:
        argv += ["--augment", case.augment]
    return argv


def _summary_path(case: Case, model: str, out: str) -> str:
    return os.path.join(out, f"{case.name}-{model}.json")


def checkpoint_accuracy(checkpoint_dir: str) -> float:
    """The validation accuracy of a checkpoint's weights (and BatchNorm statistics), in
    this one process: what ``jobs/evaluate.py`` or a user of the export would get."""
    import torch

    sys.path.insert(0, ROOT)
    from ray_ddp.checkpoint.format import load_model, load_state
    from ray_ddp.config import TrainConfig
    from ray_ddp.image_classification.datasets import build_datasets

    model = load_model(checkpoint_dir)
    cfg = TrainConfig.from_dict(load_state(checkpoint_dir)["config"])
    _, val, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed, augment=False)
    correct = 0
    with torch.no_grad():
        for images, labels in torch.utils.data.DataLoader(val, batch_size=256):
            correct += int((model(images).argmax(1) == labels).sum())
    return correct / len(val)  # type: ignore[arg-type]


def _shown(argv: list[str], tmp: str) -> str:
    """The command as a reader can re-type it: repository paths relative, the temporary
    folder as $TMP."""
    words = [os.path.relpath(a, ROOT) if a.startswith(ROOT) else a for a in argv]
    return " ".join(words).replace(tmp, "$TMP")


def run(case: Case, model: str, data_root: str, out: str, timeout: float) -> dict:
    argv = command(case, model, data_root, out)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    start = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    elapsed = time.time() - start
    with open(os.path.join(out, f"{case.name}-{model}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{case.name} {model} exited {proc.returncode}: {proc.stderr[-2000:]}")
    with open(_summary_path(case, model, out)) as f:
        summary = json.load(f)
    return {
        "case": case.name,
        "model": model,
        "data": case.describe(),
        "command": _shown(argv, out),
        "final_val_acc": summary["final"]["val_acc"],
        "checkpoint_val_acc": checkpoint_accuracy(summary["latest_checkpoint"]),
        "best_val_acc": summary["best"]["val_acc"],
        "train_wall_s": summary["wall_s"],
        "samples_per_s": summary["samples_per_s"],
        "command_wall_s": elapsed,
        "history": [round(epoch["val_acc"], 4) for epoch in summary["history"]],
    }


# ------------------------------------------------------------------------------- report
def write_report(rows: list[dict], sizes: dict[str, int], out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "default_model.json"), "w") as f:
        json.dump({"digits": sizes, "rows": rows}, f, indent=2)
    lines = [
        "# Default model: small_resnet against small_cnn on small real images",
        "",
        f"{datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs, no GPU; "
        "`jobs/train.py` with 2 CPU workers and its default flags (AdamW lr 3e-3, batch 64 "
        "per worker, warm-up + cosine) except those in the command. Digits: scikit-learn's "
        f"8x8 handwritten digits, {sizes['train']:,} train / {sizes['val']:,} val "
        "(`random_state=0`), read at 32x32. Reproduce: `python benchmarks/default_model.py` "
        "(needs `pip install scikit-learn`).",
        "",
        "| data | model | final val_acc | its checkpoint, one process | best val_acc "
        "| training wall s | command wall s | samples/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['data']} | {r['model']} | {100 * r['final_val_acc']:.2f}% "
            f"| {100 * r['checkpoint_val_acc']:.2f}% | {100 * r['best_val_acc']:.2f}% "
            f"| {r['train_wall_s']:.1f} "
            f"| {r['command_wall_s']:.1f} | {r['samples_per_s']:.0f} |"
        )
    lines += [
        "",
        "- final val_acc: the run's own validation after the last epoch (each worker scores "
        "its shard); its checkpoint, one process: the last checkpoint's weights and BatchNorm "
        "statistics evaluated on the whole validation split in this script's process.",
        "- training wall s: the run's own `wall_s` (from the trainer's start to the end of "
        "fit, export excluded); command wall s: the whole `jobs/train.py` process, Ray "
        "start-up and export included.",
        "- samples/s: the whole run's training throughput (both workers).",
        "",
        "Commands (`$TMP`: a temporary folder holding the digits, the runs and summaries):",
        "",
    ]
    lines += [f"    {r['command']}" for r in rows]
    lines += ["", "Validation accuracy per epoch:", ""]
    lines += [f"- {r['case']} {r['model']}: {r['history']}" for r in rows]
    with open(os.path.join(out_dir, "default_model.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated case names (default: all)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="results folder")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--merge", action="store_true", help="keep earlier rows of other cases")
    args = p.parse_args()
    wanted = set(filter(None, args.only.split(",")))
    cases = [c for c in CASES if not wanted or c.name in wanted]
    models = [m for m in args.models.split(",") if m]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sizes = write_digits(os.path.join(tmp, "data"))
        for case in cases:
            for model in models:
                row = run(case, model, os.path.join(tmp, "data"), tmp, args.timeout)
                print(
                    f"{case.name:26s} {model:13s} val_acc {100 * row['final_val_acc']:6.2f}% "
                    f"(checkpoint {100 * row['checkpoint_val_acc']:6.2f}%, best "
                    f"{100 * row['best_val_acc']:6.2f}%)  {row['train_wall_s']:6.1f} s "
                    f"training, {row['command_wall_s']:6.1f} s in all",
                    flush=True,
                )
                rows.append(row)
    if args.merge:
        path = os.path.join(args.out, "default_model.json")
        if os.path.exists(path):
            with open(path) as f:
                earlier = json.load(f)["rows"]
            done = {(r["case"], r["model"]) for r in rows}
            rows = [r for r in earlier if (r["case"], r["model"]) not in done] + rows
            order = {c.name: i for i, c in enumerate(CASES)}
            rows.sort(key=lambda r: (order.get(r["case"], 99), r["model"]))
    write_report(rows, sizes, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
