"""What every benchmark script shares: the flags, the data and model (the very ones
``jobs/train.py`` uses), the optimizer recipe, the step timer and the result file.

Imports torch and the Ray-free parts of ray_ddp only (``models``, ``synthetic_data``,
``optim``, ``comm_stats``), so the torchrun, Lightning and single-process baselines
never start or import Ray.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

# Run from a checkout without installing, like jobs/train.py does.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

# ray_ddp's defaults (TrainConfig): AdamW, lr 3e-3, weight decay 0.01, clip at 1.0,
# 5% linear warm-up then cosine to 1% of the peak.
LR = 3e-3
WEIGHT_DECAY = 0.01
GRAD_CLIP = 1.0
MIN_LR_RATIO = 0.01


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that pin down the work; run.py passes the same values to every case."""
    parser.add_argument("--model", default="small_cnn")
    parser.add_argument("--batch-size", type=int, default=64, help="per worker (micro-batch)")
    parser.add_argument("--accum-steps", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps")
    parser.add_argument(
        "--timing-warmup", type=int, default=10, help="optimizer steps left out of the timing"
    )
    parser.add_argument("--train-samples", type=int, default=12_000)
    parser.add_argument("--val-samples", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result", default=None, help="write this process's figures here")


def one_thread() -> None:
    """One torch thread per worker, as Ray gives a worker with --cpus-per-worker 1."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def datasets(args: argparse.Namespace):
    """The built-in dataset of ``jobs/train.py --dataset synthetic``: same seed, same tensors."""
    from ray_ddp.image_classification.synthetic import make_synthetic

    return make_synthetic(args.seed, args.train_samples, args.val_samples)


def model(args: argparse.Namespace, train_ds) -> torch.nn.Module:
    """The model of ``jobs/train.py --model ...``, with the same initial weights."""
    from ray_ddp.image_classification.models import build_model
    from ray_ddp.image_classification.synthetic import NUM_CLASSES

    torch.manual_seed(args.seed)
    return build_model(args.model, tuple(train_ds[0][0].shape), NUM_CLASSES)


def optimizer_and_schedule(params, total_steps: int):
    """AdamW and the warm-up + cosine schedule, as ray_ddp builds them by default."""
    from ray_ddp.worker.optim import default_warmup, lr_factor

    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    warmup = default_warmup(total_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: lr_factor(step, warmup, total_steps, MIN_LR_RATIO)
    )
    return opt, sched


class StepTimer:
    """Timestamps at the end of every optimizer step.

    A step's time is from the end of the previous optimizer step to the end of this one
    (data loading, forward, backward, all-reduce, optimizer). The first ``warmup`` steps are
    left out: steady-state figures cover steps warmup+1 .. last.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = max(1, warmup)
        self.ends: list[float] = []
        self.first_step_unix: float | None = None

    def step_done(self) -> None:
        now = time.perf_counter()
        if not self.ends:
            self.first_step_unix = time.time()
        self.ends.append(now)

    def figures(self, samples_per_step_per_worker: int) -> dict[str, Any]:
        timed = self.ends[self.warmup - 1 :]
        if len(timed) < 2:
            raise SystemExit(
                f"only {len(self.ends)} optimizer steps for a timing warm-up of "
                f"{self.warmup}: raise --max-steps"
            )
        durations = [b - a for a, b in zip(timed, timed[1:], strict=False)]
        return {
            "warmup_steps": self.warmup,
            "steps_timed": len(durations),
            "first_step_unix": self.first_step_unix,
            "step_time_median_s": statistics.median(durations),
            "steady_samples_per_s_per_worker": samples_per_step_per_worker
            * len(durations)
            / (timed[-1] - timed[0]),
        }


def median_range(values: list[float], digits: int = 2) -> str:
    """Repeated figures as the reports give them: the median (min–max)."""
    lo, med, hi = min(values), statistics.median(values), max(values)
    return f"{med:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def arms_in_turn(pair: int) -> tuple[str, str]:
    """Which arm of an interleaved A/B runs first in pair ``pair`` (0-based): they take
    turns, so drift on the machine weighs on both alike."""
    return ("on", "off") if pair % 2 == 0 else ("off", "on")


def median_interval(values: list[float], coverage: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of what ``values`` are drawn from: the
    k-th smallest and k-th largest value, k the largest whose interval covers the median
    with at least ``coverage`` (from the binomial: each value falls below the median with
    probability 1/2). None for too few values (5 or fewer, at 95%)."""
    ordered, n = sorted(values), len(values)
    best = None
    for k in range(1, n // 2 + 1):
        outside = sum(math.comb(n, i) for i in range(k)) / 2**n  # P(Binomial(n, 1/2) < k)
        if 1 - 2 * outside < coverage:
            break
        best = (ordered[k - 1], ordered[n - k])
    return best


def paired_figures(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """An interleaved A/B's figures from its pairs (each with an ``on`` and an ``off``
    figure): the on/off ratio pair by pair (median, min, max, and the median's 95%
    interval where there are pairs enough) and each arm's median."""
    ratios = [p["on"] / p["off"] for p in pairs]
    return {
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_median_95": median_interval(ratios),
        "on_median": statistics.median(p["on"] for p in pairs),
        "off_median": statistics.median(p["off"] for p in pairs),
    }


def paired_table(r: dict[str, Any], on: str, off: str, ratio: str) -> str:
    """An interleaved A/B's table (markdown): each arm's median and range, and the on/off
    ratio pair by pair (``r``: ``paired_figures``' keys and the ``pairs``)."""

    def spread(arm: str) -> str:
        values = [p[arm] for p in r["pairs"]]
        return f"{min(values):.1f}-{max(values):.1f}"

    return (
        "| | median | range |\n|---|---|---|\n"
        f"| {on} | {r['on_median']:.1f} | {spread('on')} |\n"
        f"| {off} | {r['off_median']:.1f} | {spread('off')} |\n"
        f"| {ratio}, pair by pair | {r['ratio_median']:.3f} | "
        f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f} |\n\n"
        + interval_line(r.get("ratio_median_95"), f"median {ratio}", ".3f")
    )


def interval_line(interval: tuple[float, float] | None, what: str, spec: str) -> str:
    """A sentence giving ``median_interval``'s interval for ``what`` ("" for None)."""
    if not interval:
        return ""
    low, high = interval
    return (
        f"The {what} lies in {low:{spec}} to {high:{spec}} with 95% confidence (the order "
        "statistics' interval for a median: it assumes nothing of the noise).\n\n"
    )


def write_report(out: str, stem: str, result: dict[str, Any], text: str) -> None:
    """A benchmark's figures as ``<out>/<stem>.json`` and its text as ``<stem>.md``, the
    text also printed."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as file:
        json.dump(result, file, indent=2)
    with open(os.path.join(out, f"{stem}.md"), "w") as file:
        file.write(text)
    print(text)


def write_result(path: str | None, figures: dict[str, Any]) -> None:
    """One JSON object per run (rank 0 only), also printed as one line."""
    figures = {**figures, "end_unix": time.time()}
    line = json.dumps(figures)
    print("BENCH_RESULT " + line, flush=True)
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(line + "\n")
        os.replace(tmp, path)
