"""What the epoch order costs one rank as the training set grows (issue 47): the keyed
permutation computed when read (``ray_ddp.data.order.permutation``, order version 2)
beside the ``torch.randperm`` order it replaced (version 1, as commit 41f20c4 built it:
the whole permutation as a list, and every slot of the epoch made at each position), and
the streamed Parquet order (``streaming``, version 3, computed by position) beside the
whole-list streamed order of versions 1 and 2 (``streamed-v2``), both on a simulated split
of row groups of ``GROUP_ROWS`` rows (``tests/formats.SimulatedLayout``: no files, a
group's values are a ``range``), read through the real ``StreamedBatches`` and
``RowStream``, so the stream's planning is measured too (not the groups' data).

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

For the streamed orders also: the split's own memory (its row groups' records, made
before the baseline: a worker holds them whatever the order), the most row groups the
stream held and its time a row over the first ``STREAM_BATCHES`` micro-batches.

The old orders are run only where they fit (``--old-up-to``, default 1e8; at 1e9 randperm
would need about 45 GB a rank; ``--streamed-v2-up-to``, default 1e7). Repeats are
interleaved (every case once, then again). ``--kinds`` runs some orders only and keeps the
other orders' records of the JSON already in ``--out``.

    python benchmarks/order_scale.py                # about 15 minutes on 2 cores
    python benchmarks/order_scale.py --kinds streamed,streamed-v2   # the streamed rows
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
sys.path.insert(1, os.path.join(ROOT, "tests"))  # formats.SimulatedLayout

from common import median_range, write_report  # noqa: E402 - benchmarks/ is on the path

OLD_COMMIT = "41f20c4"
"""The last commit with the ``torch.randperm`` order (its global_order.py is loaded)."""
BATCH = 64
SAMPLED_SLOTS = 20_000
"""Slots read to time a pass; a longer epoch's pass is extrapolated from them."""
GROUP_ROWS = 10_000
"""The streamed order's simulated row groups: N / 10,000 of them (1e5 at 1e9 rows)."""
BUFFER = 2048  # --shuffle-buffer's default
STREAM_BATCHES = 2_000
"""Micro-batches read through the row stream to time it and count the groups it holds."""
KINDS = ("keyed", "randperm", "streamed", "streamed-v2")


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


def _split(size: int):
    """A simulated streamed split of ``size`` rows in groups of ``GROUP_ROWS``."""
    from formats import SimulatedLayout

    from ray_ddp.data.parquet_stream import StreamingParquet

    return StreamingParquet(SimulatedLayout([GROUP_ROWS] * (size // GROUP_ROWS)), None)


def _sampler(kind: str, size: int, world: int, split=None):
    """Rank 0's sampler of ``kind`` (made here: its cost is the first batch's)."""
    from ray_ddp.data.order import global_order
    from ray_ddp.data.order.streamed_batches import StreamedBatches

    module = _old_module() if kind == "randperm" else global_order
    options = {"batch_size": BATCH, "global_batch": BATCH * world, "seed": 0, "rank": 0,
               "world_size": world, "tag_epoch": False}  # fmt: skip
    if split is None:
        return module.GlobalOrderBatches(size, **options)

    class WholeList(StreamedBatches):  # every epoch in versions 1 and 2's order
        def set_position(self, epoch: int, start: int) -> None:
            self.finish_in(epoch, global_order.ORDER_VERSION)
            super().set_position(epoch, start)

    made = WholeList if kind == "streamed-v2" else StreamedBatches
    return made(split, buffer=BUFFER, **options)


def _stream(order) -> dict[str, Any]:
    """The first ``STREAM_BATCHES`` micro-batches of the epoch through the row stream."""
    stream = order.dataset.stream((slot.indices for slot in order.slots), order.horizon)
    rows, began = 0, time.perf_counter()
    for number, batch in enumerate(stream):
        rows += len(batch)
        if number + 1 == STREAM_BATCHES:
            break
    return {"held_groups": stream.held, "stream_us_row": (time.perf_counter() - began) / rows * 1e6}


def measure(kind: str, size: int, world: int) -> dict[str, Any]:
    """One case, in this process (see the module docstring)."""
    if kind == "randperm":
        _old_module()  # its import is not the order's cost
    import torch  # noqa: F401 - imported before the baseline, as in a worker

    import ray_ddp.data.order.global_order  # noqa: F401

    streamed, stream = kind.startswith("streamed"), {}
    if streamed:  # their imports are not the split's
        import formats  # noqa: F401

        import ray_ddp.data.order.streamed_batches  # noqa: F401
    split_began = rss_mb()
    split = _split(size) if streamed else None
    before = rss_mb()
    started = time.perf_counter()
    order = _sampler(kind, size, world, split)
    first = next(iter(order))
    first_batch = time.perf_counter() - started
    moves, middle = [], order.plan.steps // 2 * order.plan.global_batch  # a step boundary
    for _ in range(3 if kind in ("randperm", "streamed-v2") else 50):
        began = time.perf_counter()
        order.set_position(1, middle)
        next(iter(order))  # an order made when first read (streamed) pays here
        moves.append(time.perf_counter() - began)
    order.set_position(0, 0)
    if streamed:
        stream = _stream(order)
    slots, read, began = len(order), 0, time.perf_counter()
    for _ in order.slots if streamed else order:  # the order's slots (the stream: above)
        read += 1
        if read == SAMPLED_SLOTS:
            break
    passed = (time.perf_counter() - began) * slots / read
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "kind": kind, "size": size, "world": world, "slots": slots,
        "memory_mb": peak - before, "first_batch_s": first_batch,
        "set_position_s": statistics.median(moves), "epoch_s": statistics.median(moves) + passed,
        "first_batch_len": len(first), "split_mb": before - split_began, **stream,
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
    kinds = args.kinds.split(",") if args.kinds else KINDS
    out = []
    for size in sizes:
        for world in (8, 1024):
            fits = {"keyed": True, "randperm": size <= args.old_up_to,
                    "streamed": size >= GROUP_ROWS,
                    "streamed-v2": GROUP_ROWS <= size <= args.streamed_v2_up_to}  # fmt: skip
            out += [(kind, size, world) for kind in KINDS if kind in kinds and fits[kind]]
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
        f"order of {OLD_COMMIT} (version 1), only where it fits; `streamed`: today's streamed "
        "Parquet order (version 3); `streamed-v2`: the whole-list streamed order of versions "
        f"1 and 2, only where it fits; both on a simulated split of row groups of {GROUP_ROWS} "
        f"rows (1e5 groups at 1e9 rows), shuffle buffer {BUFFER}, read through the row stream.",
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
    lines += [
        "",
        "The streamed orders' split (its row groups' records, held by a worker whatever the "
        f"order; not in the memory above) and their row stream over the first "
        f"{STREAM_BATCHES} micro-batches:",
        "",
        "| N | ranks | order | split (MB) | row groups held (most) | stream (µs a row) |",
        "|---|---|---|---|---|---|",
    ]
    for (size, world, kind), rs in sorted(groups.items()):
        if "held_groups" in rs[0]:
            lines.append(
                f"| {size:.0e} | {world} | {kind} | {median_range([r['split_mb'] for r in rs], 1)} "
                f"| {median_range([r['held_groups'] for r in rs], 0)} "
                f"| {median_range([r['stream_us_row'] for r in rs], 2)} |"
            )
    return "\n".join(lines) + "\n"


def kept_records(args: argparse.Namespace, stem: str) -> list[dict[str, Any]]:
    """With ``--kinds``: the other orders' records of the JSON already in ``--out``."""
    path = os.path.join(args.out, f"{stem}.json")
    if not args.kinds or not os.path.exists(path):
        return []
    with open(path) as file:
        kept = json.load(file)["records"]
    return [r for r in kept if r["kind"] not in args.kinds.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--old-up-to", type=float, default=1e8)
    parser.add_argument("--streamed-v2-up-to", type=float, default=1e7)
    parser.add_argument("--kinds", default=None, help=f"some of {','.join(KINDS)}")
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
    records += kept_records(args, stem)
    write_report(args.out, stem, {"records": records, "batch": BATCH}, report(records, args))


if __name__ == "__main__":
    main()
