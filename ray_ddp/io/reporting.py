"""What rank 0 and the driver print: pure formatting, no Ray, no torch."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

STRAGGLER_RATIO = 1.5
"""A straggler's median time per step until it is ready for the gradient all-reduce is at
least this many times the median of the other ranks (with as many micro-batches per step),
over a whole epoch: more than half its steps, a sustained slowdown, not a hiccup. (1.25
named rank 1 of the default job on a 2-core machine, 10.3 against 8.2 ms: two workers
sharing two cores with Ray's daemons, not a node to look at.)"""
STRAGGLER_MIN_MS = 5.0
"""...and at least this many milliseconds more (timer noise on very short steps)."""
DATA_WAIT_SHOWN = 0.10
"""The epoch line shows the data wait of the rank that waited most from this fraction of
its training time on (every rank's is in the worker table, metrics.csv and TensorBoard)."""


def rank_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per worker: how Ray mapped ranks to nodes and devices."""
    header = (
        f"{'rank':>4}  {'local':>5}  {'node':>4}  {'node id':<8}  {'host':<20} {'pid':>7}  device"
    )
    lines = [header]
    for r in sorted(rows, key=lambda r: r["rank"]):
        lines.append(
            f"{r['rank']:>4}  {r['local_rank']:>5}  {r['node_rank']:>4}  {r['node_id'][:8]:<8}  "
            f"{r['host'][:20]:<20} {r['pid']:>7}  {r['device']}"
        )
    return "\n".join(lines)


def short(value: Any) -> str:
    """A value for one line: long lists and strings cut, e.g. ``[0.5, 0.3, 0.9, ... (10)]``."""
    import reprlib

    if isinstance(value, str):
        return value if len(value) <= 40 else value[:37] + "..."
    shown = reprlib.Repr()
    shown.maxlist = shown.maxtuple = shown.maxdict = 3
    shown.maxstring = shown.maxother = 40
    text = shown.repr(value)
    if isinstance(value, (list, tuple)) and len(value) > 3:
        text = text.replace("...", f"... ({len(value)})")
    return text


def batch_line(per_worker: int, workers: int, accum: int, global_batch: int | None = None) -> str:
    """The batch arithmetic; where ``workers`` does not divide the step's micro-batches
    (an elastic run on fewer workers), how they are split and what that costs."""
    if global_batch is None or global_batch == per_worker * workers * accum:
        return (
            f"batch: {per_worker} per worker x {workers} workers x {accum} accumulation = "
            f"{per_worker * workers * accum} samples per optimizer step (global batch)"
        )
    per_step = global_batch // per_worker
    more = per_step % workers
    ranks = "rank 0" if more == 1 else f"ranks 0-{more - 1}"
    return (
        f"batch: {per_step} micro-batches of {per_worker} per optimizer step over {workers} "
        f"workers ({accum} on {ranks}, {accum - 1} on the others) = {global_batch} samples "
        f"(global batch); the workers are busy {per_step / (workers * accum):.0%} of each step"
    )


def validation(m: dict[str, Any]) -> str:
    """The ``val_*`` metrics of ``m``, in their order, as ``name value`` pairs."""
    return "  ".join(f"{k} {v:.4f}" for k, v in m.items() if k.startswith("val_"))


def flop_rate(tflops: float) -> str:
    """``12.3 TFLOP/s``, or ``45 GFLOP/s`` below one TFLOP/s (CPUs)."""
    return f"{tflops:.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.0f} GFLOP/s"


def epoch_line(m: dict[str, Any], epochs: int) -> str:
    line = (
        f"epoch {m['epoch']:>3}/{epochs}  train_loss {m['train_loss']:.4f}  {validation(m)}  "
        f"lr {m['lr']:.2e}  {m['samples_per_s']:8.0f} samples/s  {m['epoch_s']:6.1f} s"
    )
    if "mfu" in m:  # on GPUs of a known peak
        line += f"  {flop_rate(m['tflops'])}  MFU {m['mfu']:.0%}"
    if "allreduces_per_step" in m:
        line += f"  all-reduces/step {m['allreduces_per_step']:.2f}"
    if m.get("data_wait_max", 0.0) >= DATA_WAIT_SHOWN:
        line += f"  data wait {m['data_wait_max']:.0%} (rank {m['data_wait_rank']})"
    if m.get("bad_samples"):
        noun = "sample" if m["bad_samples"] == 1 else "samples"
        line += f"  skipped {m['bad_samples']} unreadable {noun} (bad_samples.csv)"
    return line


def progress_line(
    epoch: int,
    epochs: int,
    done: int,
    total: int,
    loss: float | None,
    samples_per_s: float,
    eta_s: float,
    width: int = 24,
) -> str:
    """An in-epoch progress bar as one line (Ray forwards worker output line by line, so
    an in-place terminal bar cannot reach the driver). ``loss``: None, where the loop's
    losses are its own."""
    filled = round(width * done / max(1, total))
    shown = "" if loss is None else f"loss {loss:.4f}  "
    return (
        f"  epoch {epoch}/{epochs} [{'#' * filled}{'.' * (width - filled)}] "
        f"{100 * done / max(1, total):3.0f}%  {done}/{total} samples  {shown}"
        f"{samples_per_s:.0f} samples/s  eta {eta_s:.0f} s"
    )


def balance(per_rank: Sequence[dict[str, Any]]) -> dict[str, float]:
    """max/min across ranks of speed and peak memory: 1.00 is perfectly balanced."""
    speeds = [r["samples_per_s"] for r in per_rank]
    memory = [r["peak_memory_mb"] for r in per_rank]
    return {
        "speed_max_min": max(speeds) / max(min(speeds), 1e-9),
        "memory_max_min": max(memory) / max(min(memory), 1e-9),
        "peak_memory_mb": max(memory),
    }


def stragglers(per_rank: Sequence[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """``(rank, its ready ms, the other ranks' median)`` of every straggler: see
    ``STRAGGLER_RATIO``. Ranks are compared with those that train as many micro-batches per
    step (an uneven split gives some ranks one more)."""
    timed = [r for r in per_rank if r.get("ready_ms") is not None]
    found = []
    for row in timed:
        peers = [
            o["ready_ms"]
            for o in timed
            if o["rank"] != row["rank"] and o["micro_per_step"] == row["micro_per_step"]
        ]
        if not peers:
            continue
        typical = statistics.median(peers)
        if row["ready_ms"] >= STRAGGLER_RATIO * typical and row["ready_ms"] - typical >= (
            STRAGGLER_MIN_MS
        ):
            found.append((row["rank"], row["ready_ms"], typical))
    return found


def rank_timing(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The epoch's metrics from every rank's timing: the largest data wait (a fraction of
    the training time) and its rank, and the stragglers' ranks (space-separated, empty
    for none)."""
    timed = [r for r in per_rank if "data_wait" in r]
    if not timed:
        return {}
    most = max(timed, key=lambda r: r["data_wait"])
    return {
        "data_wait_max": most["data_wait"],
        "data_wait_rank": most["rank"],
        "stragglers": " ".join(str(rank) for rank, _, _ in stragglers(per_rank)),
    }


def straggler_lines(
    per_rank: Sequence[dict[str, Any]], ranks: Sequence[dict[str, Any]]
) -> list[str]:
    """One warning line per straggler, naming its host and node (``ranks``: the rank
    table's rows)."""
    where = {r["rank"]: f"{r['host']}, node {r['node_id'][:8]}" for r in ranks}
    return [
        f"straggler: rank {rank} ({where.get(rank, '?')}) needs {own:.1f} ms per step "
        f"before the gradient all-reduce, the other ranks {typical:.1f} ms ({own / typical:.1f}x) "
        "over this epoch: every step waits for it. Its data wait is in the table below; "
        "otherwise look at that node (thermal throttling, a noisy neighbour, a slower device)"
        for rank, own, typical in stragglers(per_rank)
    ]


def worker_table(per_rank: Sequence[dict[str, Any]]) -> str:
    """Per-worker speed and peak memory (CUDA peak allocated on GPU, resident set on CPU),
    and where timed, the time per step until ready for the all-reduce and the data wait."""
    timed = all("ready_ms" in r for r in per_rank)
    extra = f"  {'ready ms/step':>13}  {'data wait (ms/step)':>19}" if timed else ""
    lines = [f"  {'rank':>4}  {'samples/s':>9}{extra}  {'peak memory':>12}"]
    for r in sorted(per_rank, key=lambda r: r["rank"]):
        wait = f"{r['data_wait']:.0%} ({r.get('data_wait_ms', 0.0):.1f})"
        cells = f"  {r['ready_ms']:>13.1f}  {wait:>19}" if timed else ""
        lines.append(
            f"  {r['rank']:>4}  {r['samples_per_s']:>9.0f}{cells}  {r['peak_memory_mb']:>9.0f} MB "
            f"({r['memory_kind']})"
        )
    b = balance(per_rank)
    lines.append(
        f"  balance max/min: samples/s {b['speed_max_min']:.2f}, memory {b['memory_max_min']:.2f}"
    )
    return "\n".join(lines)


def summary_text(summary: dict[str, Any]) -> str:
    final, best = summary["final"], summary["best"]
    lines = [
        f"run:          {summary['run_dir']}",
        f"workers:      {summary['world_size']} ({summary['device']}), global batch "
        f"{summary['global_batch_size']}",
        f"epochs:       {summary['epochs_completed']} of {summary['epochs']}",
    ]
    if final:
        lines.append(f"final:        {validation(final)}")
    if best:
        score = summary["score"]
        lines.append(
            f"best:         {score} {best[score]:.4f} at epoch {best['epoch']}  "
            f"-> {best['checkpoint']}"
        )
    rate = summary.get("utilisation", {})
    lines.append(
        f"time:         {summary['wall_s']:.1f} s wall, "
        f"{summary['samples_per_s']:.0f} samples/s while training"
        + (f", {flop_rate(rate['tflops'])}" if "tflops" in rate else "")
        + (f", MFU {rate['mfu']:.0%}" if "mfu" in rate else "")
    )
    return "\n".join(lines)
