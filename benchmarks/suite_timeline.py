"""Where a test suite's (or any batch of runs') seconds go around training: its worker
groups' start-ups, read from a timeline of every run.

Run the suite with ``RAY_DDP_TIMELINE=FILE`` set (every process it starts inherits it: a
local Ray's workers, simulated nodes, job drivers), then::

    python benchmarks/suite_timeline.py FILE

It prints how many worker groups started (each attempt of each fit, Tune trials too: one
"loop entered" of rank 0 each), and for the stages between (medians, ranges and sums):

- **start**: the driver's trainer built -> rank 0 in the training loop (Ray Train's
  controller, the worker processes, their imports of Ray Train and torch, the process
  group). Only for fits a driver ran in its own process (``ray_ddp.fit``, ``jobs/train.py``:
  Tune trials mark no "trainer built"), each paired with the next group to start;
- **to the first step**: the loop entered -> the first optimizer step (data, model, the DDP
  wrap: DDP's constructor imports ``torch._dynamo``);
- **training**: the first optimizer step -> training ended (steps, validation, checkpoints).

Where the timeline also marks each test (``tests/conftest.py`` does), it then counts the
groups per test module (``--per-test``: per test), by the test running when each started:
where merging or sharing fits would pay.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ray_ddp.io.timeline import TEST_STARTED, read  # noqa: E402 - after the path is set

LOOP = "loop entered (process group up)"
FIRST = "first optimizer step"
ENDED = "training ended, logs closed"
BUILT = "trainer built"
PAIRED_WITHIN_S = 120.0
"""A driver's trainer and the next group to start are one fit's when this close."""


def stages(marks: list[dict]) -> dict[str, list[float]]:
    """Seconds of each stage, one entry per worker group (per fit for ``start``)."""
    groups: dict[int, dict[str, float]] = {}
    for m in marks:
        if m["who"] == "rank 0":
            groups.setdefault(m["pid"], {}).setdefault(m["stage"], m["t"])
    loops = sorted(g[LOOP] for g in groups.values() if LOOP in g)
    out: dict[str, list[float]] = {"groups": loops, "start": [], "to the first step": [],
                                   "training": []}  # fmt: skip
    for built in (m["t"] for m in marks if m["stage"] == BUILT):
        after = [t - built for t in loops if t > built]
        if after and after[0] < PAIRED_WITHIN_S:
            out["start"].append(after[0])
    for g in groups.values():
        if LOOP in g and FIRST in g:
            out["to the first step"].append(g[FIRST] - g[LOOP])
        if FIRST in g and ENDED in g:
            out["training"].append(g[ENDED] - g[FIRST])
    return out


def report(marks: list[dict]) -> str:
    found = stages(marks)
    lines = [f"{len(found['groups'])} worker groups started"]
    lines.append(f"{'stage':<20}{'n':>5}{'median s':>10}{'range s':>16}{'sum s':>9}")
    for name in ("start", "to the first step", "training"):
        values = found[name]
        if not values:
            lines.append(f"{name:<20}{0:>5}")
            continue
        spread = f"{min(values):.1f}-{max(values):.1f}"
        lines.append(f"{name:<20}{len(values):>5}{statistics.median(values):>10.2f}"
                     f"{spread:>16}{sum(values):>9.0f}")  # fmt: skip
    return "\n".join(lines)


def groups_by_test(marks: list[dict], per_test: bool = False) -> dict[str, int]:
    """Worker groups started per test module (or test), most first: each counted for the
    test marked last before it started."""
    tests = [(m["t"], m["who"]) for m in marks if m["stage"] == TEST_STARTED]
    counts: dict[str, int] = {}
    for t in stages(marks)["groups"]:
        before = [test for when, test in tests if when <= t]
        if before:
            test = before[-1] if per_test else before[-1].split("::")[0]
            counts[test] = counts.get(test, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("timeline", help="the file RAY_DDP_TIMELINE named")
    parser.add_argument("--per-test", action="store_true", help="count groups per test")
    args = parser.parse_args(argv)
    marks = read(args.timeline)
    print(report(marks))
    counts = groups_by_test(marks, args.per_test)
    if counts:
        print(f"\nworker groups per {'test' if args.per_test else 'test module'}:")
        print("\n".join(f"{n:5}  {test}" for test, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
