"""The GPU path under Ray, measured in one call on a lent GPU machine (issue 18).

    python benchmarks/gpu_ray.py --out $OUT            # on the GPU machine (~7 min on an H200)
    python benchmarks/gpu_ray.py --dry-run --out DIR   # the same steps on CPU, tiny (~1 min)

1. Throughput, ResNet-50 on 224-pixel images made on the GPU (no data pipeline), channels_last,
   bf16 and fp16 (GradScaler), and bf16 with torch.compile, three ways on the same GPU:
   - *bare*: the training step in a loop (``benchmarks/gpu.py``'s ``measure``);
   - *torchrun*: the same loop, the model in DDP, under ``torch.distributed.run`` (1 process);
   - *ray_ddp*: ``jobs/train.py --task examples.synthetic_images:SyntheticImages --use-gpu
     --num-workers 1``: Ray's GPU placement, NCCL process group, prepare_model, the epoch loop.
   samples/s (ray_ddp: its steady state after 10 warm-up steps), TFLOP/s and MFU; ratios to
   bare (the target: ray_ddp >= 0.97x bare).
2. A short real run on the built-in dataset with --use-gpu --amp fp16 (pinned memory,
   non-blocking copies, GradScaler): stopped by --max-steps after a --checkpoint-every
   checkpoint, resumed to the end under the same name, evaluated with jobs/evaluate.py, and
   its export checked.
Writes gpu_ray.json and gpu_ray.md to --out; each step's output goes to --out/logs/.

Every job joins one Ray (``--address``): the one given, else one this script starts for
all of them (without the dashboard, whose packages the GPU machine lacks), instead of each
starting and stopping its own. The ray_ddp throughput is its steady state, which does not
depend on who started Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the results and logs")
    p.add_argument("--dry-run", action="store_true", help="CPU, resnet18 at 32 px, few steps")
    p.add_argument("--steps", type=int, default=60, help="timed steps per configuration")
    p.add_argument("--no-compile", action="store_true", help="leave the compiled case out")
    p.add_argument("--address", help="a running Ray for every job (default: start one)")
    p.add_argument("--torchrun-child", help=argparse.SUPPRESS)  # internal: one DDP measurement
    args = p.parse_args(argv)
    args.model, args.image_size, args.batch_size, args.warmup = "resnet50", 224, 256, 15
    args.precisions = ["bf16", "fp16"]
    if args.dry_run:
        args.model, args.image_size, args.batch_size, args.warmup = "resnet18", 32, 8, 2
        args.steps, args.precisions, args.no_compile = 4, ["bf16"], True
    return args


def configs(args) -> list[tuple[str, bool]]:
    """(precision, compiled) pairs, channels_last throughout."""
    cases = [(p, False) for p in args.precisions]
    return cases if args.no_compile else [*cases, ("bf16", True)]


def run(cmd: list[str], log: str, env: dict | None = None, timeout: float = 900) -> int:
    """A step in a subprocess, its output to ``log``; returns its exit code."""
    started = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "w") as out:
        code = subprocess.call(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout, env=env
        )
    print(f"  {os.path.basename(log)}: exit {code} in {time.perf_counter() - started:.0f} s")
    return code


# ------------------------------------------------------------------------ the three ways
def bare(args, device, precision: str, compiled: bool) -> float:
    import gpu
    import torch
    import torchvision

    return gpu.measure(args, torch, torchvision, device, precision, True, compiled)[0]


def torchrun_child(args) -> None:
    """Inside torch.distributed.run: one DDP measurement, written as JSON."""
    import gpu
    import torch
    import torch.distributed as dist
    import torchvision

    precision, compiled, path = args.torchrun_child.split(",")
    cuda = torch.cuda.is_available() and not args.dry_run
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    sps = gpu.measure(args, torch, torchvision, device, precision, True, compiled == "1", True)[0]
    with open(path, "w") as f:
        json.dump({"samples_per_s": sps}, f)
    dist.destroy_process_group()


def torchrun(args, precision: str, compiled: bool) -> float | None:
    result = os.path.join(args.out, "logs", f"torchrun-{precision}-{int(compiled)}.json")
    flags = ["--out", args.out, "--steps", str(args.steps)]
    flags += ["--dry-run"] if args.dry_run else []
    code = run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         os.path.join(ROOT, "benchmarks", "gpu_ray.py"), *flags,
         "--torchrun-child", f"{precision},{int(compiled)},{result}"],
        os.path.join(args.out, "logs", f"torchrun-{precision}-{int(compiled)}.log"),
    )  # fmt: skip
    if code:
        return None
    with open(result) as f:
        return json.load(f)["samples_per_s"]


def ray_ddp(args, precision: str, compiled: bool) -> dict:
    """jobs/train.py on one GPU worker: its steady samples/s and counted FLOPs."""
    name = f"synthetic-{precision}{'-compiled' if compiled else ''}"
    summary = os.path.join(args.out, "logs", f"{name}.json")
    steps = 10 + args.steps  # StepTimer leaves the first 10 out of the steady rate
    cmd = [
        sys.executable, os.path.join(ROOT, "jobs", "train.py"),
        "--task", "examples.synthetic_images:SyntheticImages", "--num-workers", "1",
        "--amp", precision, "--batch-size", str(args.batch_size), "--epochs", "1",
        "--max-steps", str(steps), "--val-samples", str(2 * args.batch_size),
        "--storage-path", os.path.join(args.out, "runs"), "--name", name,
        "--no-export", "--no-tensorboard", "--summary-json", summary, "--address", args.address,
    ]  # fmt: skip
    cmd += ["--no-gpu", "--amp", "bf16"] if args.dry_run else ["--use-gpu", "--channels-last"]
    cmd += ["--compile"] if compiled else []
    env = {
        "SYNTHETIC_MODEL": args.model,
        "SYNTHETIC_IMAGE_SIZE": str(args.image_size),
        "SYNTHETIC_SAMPLES": str(steps * args.batch_size),
    }
    if run(cmd, os.path.join(args.out, "logs", f"{name}.log"), env):
        return {}
    with open(summary) as f:
        s = json.load(f)
    return {
        "samples_per_s": s["timing"].get("steady_samples_per_s_per_worker"),
        "flops_per_sample": s.get("flops_per_sample"),
        "wall_s": s["wall_s"],
    }


# ------------------------------------------------------------------------ the real run
def real_run(args) -> dict:
    """Built-in data with fp16 on the GPU: stop after a checkpoint, resume, evaluate."""
    runs = os.path.join(args.out, "runs")
    samples, every, stop = ("512", "4", "6") if args.dry_run else ("4096", "20", "30")
    base = [
        sys.executable, os.path.join(ROOT, "jobs", "train.py"), "--num-workers", "1",
        "--epochs", "2", "--train-samples", samples, "--val-samples", "256",
        "--batch-size", "64", "--checkpoint-every", every, "--storage-path", runs,
        "--name", "real", "--address", args.address,
    ]  # fmt: skip
    base += ["--no-gpu", "--amp", "bf16"] if args.dry_run else ["--use-gpu", "--amp", "fp16"]
    summary = os.path.join(args.out, "logs", "real.json")
    logs = os.path.join(args.out, "logs")
    first = run([*base, "--max-steps", stop], os.path.join(logs, "real-1-stopped.log"))
    second = run([*base, "--summary-json", summary], os.path.join(logs, "real-2-resumed.log"))
    result = {"stopped_exit": first, "resumed_exit": second}
    if second:
        return result
    with open(summary) as f:
        s = json.load(f)
    with open(os.path.join(logs, "real-2-resumed.log")) as f:
        # Ray prefixes a worker's lines with "(RayTrainWorker pid=...)".
        resumed = ["resumed from" + line.split("resumed from", 1)[1].rstrip() for line in f
                   if "resumed from" in line]  # fmt: skip
    evaluated = os.path.join(logs, "real-evaluate.json")
    code = run(
        [sys.executable, os.path.join(ROOT, "jobs", "evaluate.py"), s["latest_checkpoint"],
         "--num-workers", "1", "--summary-json", evaluated, "--address", args.address]
        + (["--no-gpu"] if args.dry_run else ["--use-gpu"]),
        os.path.join(logs, "real-evaluate.log"),
    )  # fmt: skip
    result.update(
        resumed=resumed[0] if resumed else None,
        final=s["final"],
        export=os.path.isfile(os.path.join(runs, "real", "export", "model.pt2")),
        evaluate_exit=code,
    )
    if not code:
        with open(evaluated) as f:
            result["evaluated"] = json.load(f).get("metrics")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.torchrun_child:
        torchrun_child(args)
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_ray.py: no CUDA GPU here (use --dry-run on CPU)")
        return 0
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU dry run ({platform.machine()})"
    started = time.perf_counter()
    own_ray = not args.address
    if own_ray:  # one Ray for every job below
        import ray

        ray.init(include_dashboard=False, logging_level="WARNING")
        args.address = ray.get_runtime_context().gcs_address
    try:
        report = measure(args, device, name, started)
    finally:
        if own_ray:
            ray.shutdown()
    rows, real = report["rows"], report["real_run"]
    ok = all(r.get("ray_ddp_samples_per_s") and r.get("torchrun") for r in rows)
    ok = ok and not real.get("resumed_exit") and not real.get("evaluate_exit") and real["export"]
    return 0 if ok else 1


def measure(args, device, name: str, started: float) -> dict:
    """The three ways for every configuration, then the real run; the report, written."""
    import torch

    from ray_ddp.worker.flops import peak_tflops

    # A dry run checks that every step works, not how fast: its real run (three 1-worker
    # jobs) goes beside the measurements, on the core a 1-worker job leaves idle (on 2
    # cores 68 s instead of 84-88 s). On the GPU nothing runs beside a measurement.
    beside = ThreadPoolExecutor(1).submit(real_run, args) if args.dry_run else None
    rows = []
    for precision, compiled in configs(args):
        print(f"{precision}{' compiled' if compiled else ''}:", flush=True)
        row = {"precision": precision, "compiled": compiled}
        row["bare"] = bare(args, device, precision, compiled)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row["torchrun"] = torchrun(args, precision, compiled)
        row.update({f"ray_ddp_{k}": v for k, v in ray_ddp(args, precision, compiled).items()})
        peak = peak_tflops(name, precision) if device.type == "cuda" else None
        flops = row.get("ray_ddp_flops_per_sample")
        for way in ("bare", "torchrun", "ray_ddp"):
            sps = row.get(way if way != "ray_ddp" else "ray_ddp_samples_per_s")
            if sps and flops:
                row[f"{way}_tflops"] = sps * flops / 1e12
                row[f"{way}_mfu"] = row[f"{way}_tflops"] / peak if peak else None
            if sps and row["bare"]:
                row[f"{way}_vs_bare"] = sps / row["bare"]
        rows.append(row)
        print(f"  {json.dumps(row)}", flush=True)
    real = beside.result() if beside else real_run(args)
    print(f"real run: {json.dumps(real)}", flush=True)
    total = time.perf_counter() - started
    report = {"device": name, "torch": torch.__version__, "model": args.model,
              "image_size": args.image_size, "batch_size": args.batch_size,
              "steps": args.steps, "rows": rows, "real_run": real, "seconds": total}  # fmt: skip
    with open(os.path.join(args.out, "gpu_ray.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(args.out, "gpu_ray.md"), "w") as f:
        f.write(markdown(report))
    print(f"written: {args.out}/gpu_ray.md ({total:.0f} s)")
    return report


def markdown(report: dict) -> str:
    def cell(value, fmt):
        return format(value, fmt) if isinstance(value, int | float) else "n/a"

    lines = [
        f"# GPU path under Ray: {report['device']}",
        "",
        f"{report['model']}, batch {report['batch_size']} at {report['image_size']} px, "
        f"channels_last, images made on the device; torch {report['torch']}; "
        f"{report['steps']} timed steps per case. `python benchmarks/gpu_ray.py --out DIR`.",
        "",
        "| precision | compile | bare samples/s | torchrun | ray_ddp | ray_ddp / bare "
        "| ray_ddp TFLOP/s | ray_ddp MFU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['precision']} | {'yes' if r['compiled'] else 'no'} | {cell(r['bare'], '.0f')} "
            f"| {cell(r['torchrun'], '.0f')} | {cell(r.get('ray_ddp_samples_per_s'), '.0f')} "
            f"| {cell(r.get('ray_ddp_vs_bare'), '.3f')} | {cell(r.get('ray_ddp_tflops'), '.1f')} "
            f"| {cell(r.get('ray_ddp_mfu'), '.1%')} |"
        )
    real = report["real_run"]
    lines += ["", "Real run (built-in data, checkpoint, stop, resume, evaluate, export):", "",
              "```", json.dumps(real, indent=2), "```", ""]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
