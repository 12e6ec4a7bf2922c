"""What the epoch order costs one rank as the training set grows (issue 47): the keyed
permutation computed when read (``ray_ddp.data.order.permutation``, order version 2)
beside the ``torch.randperm`` order it replaced (version 1, as commit 41f20c4 built it:
the whole permutation as a list, and every slot of the epoch made at each position), and
the streamed Parquet order (``streaming``) on simulated row groups (no files).

For N = 1e6 ... 1e9 samples at 8 and 1,024 ranks (64 samples a micro-batch, one per rank
per step), rank 0's sampler (``GlobalOrderBatches``), each case in a fresh process:

- memory: the process's peak resident memory above what it held before the sampler was
  made (``ru_maxrss``), once it has made the plan, the first batch and a new position;
- time to the first batch: making the sampler at the epoch's start and reading its first
  micro-batch;
- ``set_position``: moving to the middle of the next epoch and reading the micro-batch
  there (the median of a few);
- the order per epoch: what the rank spends making its whole epoch's micro-batches (the
  ``set_position`` and one pass over them, as the DataLoader's sampler reads them; the
  step loop reads each slot once more), extrapolated from the first slots where an epoch
  is longer.

The old order is run only where it fits (``--old-up-to``, default 1e8; at 1e9 it would
need about 45 GB a rank). Repeats are interleaved (every case once, then again).

    python benchmarks/order_scale.py                # about 10 minutes on 2 cores
    python benchmarks/order_scale.py --quick        # 1e4 and 1e5 samples: a harness check

Writes benchmarks/results/order_scale.md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from common import median_range, write_report  # noqa: E402 - benchmarks/ is on the path

OLD_COMMIT = "41f20c4"
"""The last commit with the ``torch.randperm`` order (its global_order.py is loaded)."""
BATCH = 64
SAMPLED_SLOTS = 20_000
"""Slots read to time a pass; a longer epoch's pass is extrapolated from them."""
GROUP_ROWS = 10_000
"""The streamed order's simulated row groups: N / 10,000 of them (1e5 at 1e9 rows)."""
BUFFER = 2048  # --shuffle-buffer's default


def rss_mb() -> float:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@functools.cache
def _old_module():
    """Commit ``OLD_COMMIT``'s global_order.py, loaded from git as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{OLD_COMMIT}:ray_ddp/data/order/global_order.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = os.path.join(tempfile.mkdtemp(), "old_global_order.py")
    with open(path, "w") as file:
        file.write(source)
    spec = importlib.util.spec_from_file_location("old_global_order", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["old_global_order"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _sampler(kind: str, size: int, world: int):
    """Rank 0's sampler of ``kind`` (made here: its cost is the first batch's)."""
    from ray_ddp.data.order import global_order

    module = _old_module() if kind == "randperm" else global_order
    options = {"batch_size": BATCH, "global_batch": BATCH * world, "seed": 0, "rank": 0,
               "world_size": world, "tag_epoch": False}  # fmt: skip
    if kind != "streamed":
        return module.GlobalOrderBatches(size, **options)

    class Simulated(module.GlobalOrderBatches):  # a streamed split's order, no files
        pieces = tuple([GROUP_ROWS] * (size // GROUP_ROWS))
        buffer = BUFFER

    return Simulated(size, **options)


def measure(kind: str, size: int, world: int) -> dict[str, Any]:
    """One case, in this process (see the module docstring)."""
    if kind == "randperm":
        _old_module()  # its import is not the order's cost
    import torch  # noqa: F401 - imported before the baseline, as in a worker

    import ray_ddp.data.order.global_order  # noqa: F401

    before = rss_mb()
    started = time.perf_counter()
    order = _sampler(kind, size, world)
    first = next(iter(order))
    first_batch = time.perf_counter() - started
    moves, middle = [], order.plan.steps // 2 * order.plan.global_batch  # a step boundary
    for _ in range(3 if kind != "keyed" else 50):
        began = time.perf_counter()
        order.set_position(1, middle)
        next(iter(order))  # an order made when first read (streamed) pays here
        moves.append(time.perf_counter() - began)
    order.set_position(0, 0)
    slots, read, began = len(order), 0, time.perf_counter()
    for _ in order:
        read += 1
        if read == SAMPLED_SLOTS:
            break
    passed = (time.perf_counter() - began) * slots / read
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "kind": kind, "size": size, "world": world, "slots": slots,
        "memory_mb": peak - before, "first_batch_s": first_batch,
        "set_position_s": statistics.median(moves), "epoch_s": statistics.median(moves) + passed,
        "first_batch_len": len(first),
    }  # fmt: skip


def run_case(kind: str, size: int, world: int, timeout: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--case", f"{kind},{size},{world}"],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT},
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} {size} {world}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cases(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    sizes = [10**4, 10**5] if args.quick else [10**6, 10**7, 10**8, 10**9]
    out = []
    for size in sizes:
        for world in (8, 1024):
            out.append(("keyed", size, world))
            if size <= args.old_up_to:
                out.append(("randperm", size, world))
            if size <= args.streamed_up_to and size >= GROUP_ROWS:
                out.append(("streamed", size, world))
    return out


def report(records: list[dict[str, Any]], args: argparse.Namespace) -> str:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["size"], r["world"], r["kind"]), []).append(r)
    lines = [
        f"# The epoch order's cost per rank ({datetime.date.today()})",
        "",
        f"Rank 0's sampler, {BATCH} samples a micro-batch, one micro-batch per rank per step; "
        f"each case in a fresh process, {args.repeats} interleaved repeats: median "
        "(min–max). The machine was shared with other sessions (2 cores), so the times "
        "spread; memory is steady. `keyed`: today's order (version 2); `randperm`: the "
        f"order of {OLD_COMMIT} (version 1), only where it fits; `streamed`: the streamed "
        f"Parquet order on simulated row groups of {GROUP_ROWS} rows, shuffle buffer {BUFFER}.",
        "",
        "| N | ranks | order | memory (MB) | first batch (s) | set_position + 1 batch (ms) "
        "| order per epoch (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (size, world, kind), rs in sorted(groups.items()):
        lines.append(
            f"| {size:.0e} | {world} | {kind} | {median_range([r['memory_mb'] for r in rs], 1)} "
            f"| {median_range([r['first_batch_s'] for r in rs], 3)} "
            f"| {median_range([r['set_position_s'] * 1e3 for r in rs], 3)} "
            f"| {median_range([r['epoch_s'] for r in rs], 2)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--old-up-to", type=float, default=1e8)
    parser.add_argument("--streamed-up-to", type=float, default=1e7)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.case:
        kind, size, world = args.case.split(",")
        print(json.dumps(measure(kind, int(size), int(world))))
        return
    todo, records = cases(args), []
    for repeat in range(args.repeats):
        for kind, size, world in todo:
            record = run_case(kind, size, world, args.timeout)
            print(f"repeat {repeat + 1}: {json.dumps(record)}", flush=True)
            records.append(record)
    stem = "order_scale_quick" if args.quick else "order_scale"
    write_report(args.out, stem, {"records": records, "batch": BATCH}, report(records, args))


if __name__ == "__main__":
    main()
