"""How long a checkpoint stops training, synchronous against asynchronous, and what
checkpointing costs the rate of a run (issue 28).

    python benchmarks/checkpoint_stall.py --repeats 3 --out benchmarks/results/checkpoints

Every case is ``jobs/train.py`` on one worker of one Ray this script starts, with a model
whose state is sizeable (torchvision ResNet-50 with AdamW: about 300 MB of weights and
moments), ``--max-steps`` steps and a checkpoint every ``--every`` of them:

- ``sync`` / ``async`` (``--checkpoint-mode``), to a local folder and to an S3-compatible
  server on 127.0.0.1 (moto's, as the tests use; ``pip install -e '.[test]'``);
- ``never``: the same run without checkpoints inside it (only the one at the stop).

Per run it reads the summary: ``checkpoints.blocked_s`` (seconds rank 0's training thread
was held by each checkpoint: the gather, the snapshot or the write and upload, any wait
for the previous upload, the report's barrier) and ``samples_per_s`` (the run's, stalls
included). Cases are interleaved, repeat by repeat; medians with min-max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=24, help="optimizer steps per run")
    p.add_argument("--every", type=int, default=6, help="a checkpoint every this many steps")
    p.add_argument("--storages", default="local,s3", help="local, s3 or both")
    p.add_argument("--out", default=None, help="where results.md and the logs go")
    p.add_argument("--dry-run", action="store_true", help="a tiny model, a few steps")
    args = p.parse_args(argv)
    if args.dry_run:
        args.model, args.steps, args.every, args.repeats = "small_cnn", 6, 2, 1
    return args


def cases(args) -> list[tuple[str, str]]:
    """(storage, mode) pairs, in the order each repeat runs them."""
    found = []
    for storage in args.storages.split(","):
        found += [(storage, "sync"), (storage, "async")]
    return [*found, ("local", "never")]


def run_case(args, address: str, storage: str, mode: str, repeat: int, roots: dict) -> dict:
    name = f"{storage}-{mode}-{repeat}"
    summary = os.path.join(args.out, "logs", f"{name}.json")
    cmd = [
        sys.executable, os.path.join(ROOT, "jobs", "train.py"), "--address", address,
        "--model", args.model, "--num-workers", "1",
        "--batch-size", str(args.batch_size), "--train-samples", str(args.batch_size * 1000),
        "--val-samples", "16", "--epochs", "1", "--max-steps", str(args.steps),
        "--checkpoint-mode", "sync" if mode == "never" else mode,
        "--storage-path", roots[storage], "--name", name, "--no-export", "--no-tensorboard",
        "--summary-json", summary,
    ]  # fmt: skip
    if mode != "never":
        cmd += ["--checkpoint-every", str(args.every)]
    log = os.path.join(args.out, "logs", f"{name}.log")
    started = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    print(f"  {name}: exit {code} in {time.perf_counter() - started:.0f} s", flush=True)
    if code:
        raise SystemExit(f"{name} failed: see {log}")
    with open(summary) as f:
        result = json.load(f)
    blocked = result["checkpoints"]["blocked_s"]
    inside = blocked[:-1] if mode != "never" else blocked  # the stop's own is the last
    return {
        "blocked_s": statistics.median(inside),
        "samples_per_s": result["samples_per_s"],
        "snapshot_mb": result["checkpoints"]["snapshot_bytes"] / 2**20,
        "checkpoints": len(blocked),
    }


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def markdown(args, results: dict, seconds: float) -> str:
    never = statistics.median(r["samples_per_s"] for r in results[("local", "never")])
    lines = [
        f"# Checkpoints that stop training, sync against async ({time.strftime('%Y-%m-%d')})",
        "",
        f"`python benchmarks/checkpoint_stall.py --repeats {args.repeats}` (model {args.model}"
        f" on the built-in dataset, batch {args.batch_size}, 1 CPU worker,"
        f" {args.steps} steps, a checkpoint every {args.every}); {seconds / 60:.0f} minutes."
        " Medians over repeats (min-max); blocked: rank 0's training thread per checkpoint"
        " inside the run; samples/s: the run's, stalls included.",
        "",
        "| storage | mode | blocked per checkpoint, s | samples/s | x never | snapshot MB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (storage, mode), runs in results.items():
        rate = [r["samples_per_s"] for r in runs]
        lines.append(
            f"| {storage} | {mode} | {spread([r['blocked_s'] for r in runs], '.3f')} | "
            f"{spread(rate, '.1f')} | {statistics.median(rate) / never:.3f} | "
            f"{statistics.median(r['snapshot_mb'] for r in runs):.0f} |"
        )
    for storage in args.storages.split(","):
        sync = statistics.median(r["blocked_s"] for r in results[(storage, "sync")])
        asynchronous = statistics.median(r["blocked_s"] for r in results[(storage, "async")])
        lines.append("")
        lines.append(f"{storage}: async blocks {asynchronous / sync:.1%} of sync's time "
                     f"({asynchronous:.3f} s against {sync:.3f} s).")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out = args.out or tempfile.mkdtemp(prefix="checkpoint_stall_")
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    sys.path.insert(0, os.path.join(ROOT, "tests"))  # the tests' S3 server
    import contextlib

    import ray

    with contextlib.ExitStack() as stack:
        roots = {"local": os.path.join(args.out, "runs")}
        if "s3" in args.storages.split(","):
            import s3server

            stack.enter_context(s3server.serving())  # before Ray: its workers inherit it
            roots["s3"] = f"s3://{s3server.BUCKET}/checkpoint-stall"
        ray.init(address="local", include_dashboard=False, logging_level="WARNING")
        stack.callback(ray.shutdown)
        address = ray.get_runtime_context().gcs_address
        results: dict[tuple[str, str], list[dict]] = {case: [] for case in cases(args)}
        started = time.perf_counter()
        for repeat in range(args.repeats):
            for storage, mode in cases(args):
                results[(storage, mode)].append(
                    run_case(args, address, storage, mode, repeat, roots)
                )
        report = markdown(args, results, time.perf_counter() - started)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
