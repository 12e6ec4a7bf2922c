"""Issue 47's "Done when": the default job on a billion training samples against the
same job on the built-in 12000, both ``--max-steps 20 --num-workers 2 --no-gpu``, each a
``jobs/train.py`` process of its own (its own Ray), interleaved pair by pair (which goes
first alternates). Per run: the wall of the process and every rank's peak resident
memory (``per_rank``'s ``peak_memory_mb`` in its summary JSON, ``ru_maxrss``).

The target: per-rank peak memory within 1.2x of the 12000-sample run's, and the wall
within 5 s of it.

    python benchmarks/billion_samples.py --pairs 3     # about 2 minutes on 2 cores

Writes benchmarks/results/billion_samples.md (and .json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import ROOT, arms_in_turn, median_range, write_report

SAMPLES = {"on": 1_000_000_000, "off": 12000}
"""``--train-samples`` of each arm: a billion (on) and the built-in split's (off)."""
FLAGS = ["--max-steps", "20", "--num-workers", "2", "--no-gpu"]


def one_run(storage: str, name: str, samples: int) -> dict:
    """One jobs/train.py process: its wall (s) and each rank's peak memory (MB)."""
    import json

    summary = os.path.join(storage, f"{name}.json")
    argv = [sys.executable, os.path.join(ROOT, "jobs", "train.py"), *FLAGS,
            "--train-samples", str(samples), "--storage-path", storage, "--name", name,
            "--summary-json", summary]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    with open(summary) as file:
        ranks = json.load(file)["per_rank"]
    return {"wall_s": wall, "peak_mb": [r["peak_memory_mb"] for r in ranks]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args(argv)
    pairs = []
    with tempfile.TemporaryDirectory() as storage:
        for pair in range(args.pairs):
            runs = {arm: one_run(storage, f"{arm}-{pair}", SAMPLES[arm])
                    for arm in arms_in_turn(pair)}  # fmt: skip
            pairs.append(runs)
            on, off = runs["on"], runs["off"]
            print(f"pair {pair + 1}: 1e9 {on['wall_s']:.1f} s, peak {on['peak_mb']} MB; "
                  f"12000 {off['wall_s']:.1f} s, peak {off['peak_mb']} MB", flush=True)  # fmt: skip
    memory = [max(p["on"]["peak_mb"]) / max(p["off"]["peak_mb"]) for p in pairs]
    extra = [p["on"]["wall_s"] - p["off"]["wall_s"] for p in pairs]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "flags": FLAGS,
        "pairs": pairs,
        "memory_ratio": memory,
        "extra_wall_s": extra,
        "load_average": os.getloadavg(),
    }
    write_report(args.out, "billion_samples", result, markdown(result))
    return 0


def markdown(r: dict) -> str:
    rows = "".join(
        f"| {i + 1} | {p['on']['wall_s']:.1f} | {p['off']['wall_s']:.1f} | "
        f"{r['extra_wall_s'][i]:+.1f} | {', '.join(f'{m:.0f}' for m in p['on']['peak_mb'])} | "
        f"{', '.join(f'{m:.0f}' for m in p['off']['peak_mb'])} | {r['memory_ratio'][i]:.3f} |\n"
        for i, p in enumerate(r["pairs"])
    )
    return (
        f"# A billion training samples against 12000 ({r['date']})\n\n"
        f"`python jobs/train.py {' '.join(r['flags'])} --train-samples N`, N = 1e9 against "
        f"12000, {len(r['pairs'])} interleaved pairs, each run a process of its own "
        "(`benchmarks/billion_samples.py`). Peak memory: each rank's peak resident set "
        "(MB); the ratio is the larger rank's, 1e9 over 12000.\n\n"
        "| pair | wall 1e9 (s) | wall 12000 (s) | difference (s) | peak 1e9 (MB) | "
        "peak 12000 (MB) | memory ratio |\n|---|---|---|---|---|---|---|\n"
        + rows
        + f"\nWall difference, median (min-max): {median_range(r['extra_wall_s'], 1)} s "
        f"(target: within 5 s); memory ratio {median_range(r['memory_ratio'], 3)} "
        f"(target: within 1.2). Median walls: "
        f"{statistics.median(p['on']['wall_s'] for p in r['pairs']):.1f} s against "
        f"{statistics.median(p['off']['wall_s'] for p in r['pairs']):.1f} s. The 1-minute "
        f"load average at the end: {r['load_average'][0]:.1f} on 2 cores.\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())
