"""GPU readiness: ResNet-50 training throughput and MFU in fp32 (TF32), bf16 AMP and fp16
AMP + GradScaler, with channels_last off and on, on one GPU.

    python benchmarks/gpu.py                    # ~2 min on an H100-class GPU
    python benchmarks/gpu.py --compile          # also torch.compile (slower to start)
    python benchmarks/gpu.py --dry-run          # tiny CPU run that checks the logic

Synthetic data already on the GPU (no loader): this measures the model step alone, the
ceiling a data pipeline has to feed. MFU = achieved model FLOP/s over the GPU's dense peak
for that precision. Without a CUDA GPU (and without --dry-run) it prints one line and
exits 0. Imports torch, torchvision and ray_ddp.worker.flops (the peaks table; no Ray).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import sys
import time

# ResNet-50 at 224x224: 4.09 G multiply-accumulates forward per image (the "4.1 GFLOPs"
# torchvision and most papers quote count one multiply-add as one operation). MFU counts
# two FLOPs per multiply-add, and a training step is ~3x the forward (forward, and the
# backward's two products: gradients of inputs and of weights).
RESNET50_FORWARD_MACS = 4.09e9
TRAIN_FLOPS_PER_IMAGE = 3 * 2 * RESNET50_FORWARD_MACS


def peak_flops(device_name: str, precision: str, tf32: bool) -> float | None:
    """The dense peak FLOP/s (``ray_ddp.worker.flops``'s table, the one the training runs use)."""
    from ray_ddp.worker.flops import peak_tflops

    peak = peak_tflops(device_name, "off" if precision == "fp32" else precision, tf32)
    return peak * 1e12 if peak else None


def bf16_supported(torch) -> bool:
    """Native bf16 (Ampere or newer), not the emulation older GPUs report."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # older torch without the argument
        return torch.cuda.is_bf16_supported()


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--model", default="resnet50", help="a torchvision model (MFU: resnet50)")
    p.add_argument("--warmup", type=int, default=15, help="untimed steps per configuration")
    p.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    p.add_argument("--precisions", default="fp32,bf16,fp16", help="comma-separated")
    p.add_argument("--compile", action="store_true", help="also measure torch.compile")
    p.add_argument("--no-tf32", action="store_true", help="fp32 without TF32 tensor cores")
    p.add_argument(
        "--budget-s", type=float, default=240, help="skip what is left after this many seconds"
    )
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu.md"))
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="on CPU: resnet18, 32x32 images, batch 4, 2 steps (checks the logic, no figures)",
    )
    args = p.parse_args(argv)
    if args.dry_run:
        args.model, args.image_size, args.batch_size = "resnet18", 32, 4
        args.warmup, args.steps = 1, 2
    return args


def measure(
    args, torch, torchvision, device, precision: str, channels_last: bool, compiled: bool,
    ddp: bool = False,
):  # fmt: skip
    """One configuration: returns (samples/s, peak memory GB) or raises. ``ddp``: the model
    in DistributedDataParallel (a process group must exist: under torchrun)."""
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None, num_classes=1000).to(device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    if ddp:
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    x = x.to(memory_format=fmt)
    y = torch.randint(0, 1000, (args.batch_size,), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    step_model = torch.compile(model) if compiled else model
    model.train()

    def step() -> None:
        amp = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
        with amp:
            loss = torch.nn.functional.cross_entropy(step_model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step()
    sync()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    elapsed = time.perf_counter() - started
    memory = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0
    return args.batch_size * args.steps / elapsed, memory


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        import torch
    except ImportError:
        print("gpu.py: torch is not installed, skipping")
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu.py: no CUDA GPU here, skipping (nothing measured)")
        return 0
    try:
        import torchvision
    except ImportError:
        print(
            "gpu.py: torchvision is needed for the model: pip install torchvision", file=sys.stderr
        )
        return 2

    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    tf32 = not args.no_tf32
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: pick the fastest kernels
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        name = torch.cuda.get_device_name(device)
        gpus = torch.cuda.device_count()
        stack = f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
    else:
        name, gpus, stack = platform.processor() or platform.machine(), 0, "CPU (dry run)"

    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    configs = [(p, cl, False) for p in precisions for cl in (False, True)]
    if args.compile:
        configs += [(p, True, True) for p in precisions]
    flops_note = (
        f"{TRAIN_FLOPS_PER_IMAGE / 1e9:.1f} GFLOP per training image"
        if args.model == "resnet50" and args.image_size == 224
        else None
    )

    print(
        f"{name} ({gpus} visible), torch {torch.__version__}, torchvision "
        f"{torchvision.__version__}, {stack}; {args.model} batch {args.batch_size} at "
        f"{args.image_size}x{args.image_size}",
        flush=True,
    )
    rows = []
    started = time.perf_counter()
    for precision, channels_last, compiled in configs:
        label = f"{precision:<5} channels_last={'on ' if channels_last else 'off'}" + (
            " compile" if compiled else ""
        )
        result: dict = {
            "precision": precision,
            "channels_last": channels_last,
            "compiled": compiled,
        }
        if time.perf_counter() - started > args.budget_s:
            result["error"] = f"skipped: past the {args.budget_s:.0f} s budget"
        elif precision == "bf16" and device.type == "cuda" and not bf16_supported(torch):
            result["error"] = "skipped: no bf16 on this GPU"
        else:
            try:
                sps, mem = measure(
                    args, torch, torchvision, device, precision, channels_last, compiled
                )
                result.update(samples_per_s=sps, memory_gb=mem)
            except torch.OutOfMemoryError:
                result["error"] = f"out of memory at batch {args.batch_size}"
            except Exception as exc:  # noqa: BLE001 - one failing configuration is reported
                result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        peak = peak_flops(name, precision, tf32) if device.type == "cuda" else None
        if "samples_per_s" in result and flops_note:
            achieved = result["samples_per_s"] * TRAIN_FLOPS_PER_IMAGE
            result["tflops"] = achieved / 1e12
            result["mfu"] = achieved / peak if peak else None
        rows.append(result)
        if "error" in result:
            print(f"  {label}: {result['error']}", flush=True)
        else:
            mfu = result.get("mfu")
            if not flops_note:
                flops_text = "MFU: resnet50 at 224 only"
            else:
                flops_text = f"{result['tflops']:6.1f} TFLOP/s  " + (
                    f"MFU {mfu:.1%}" if mfu is not None else "MFU: unknown peak"
                )
            print(
                f"  {label}: {result['samples_per_s']:8.1f} samples/s  {flops_text}  "
                f"{result['memory_gb']:.1f} GB peak",
                flush=True,
            )

    total = time.perf_counter() - started
    write_markdown(args, rows, name, gpus, torch, torchvision, stack, tf32, flops_note, total)
    print(f"written: {args.out} ({total:.0f} s)")
    return 0


def write_markdown(args, rows, name, gpus, torch, torchvision, stack, tf32, flops_note, total):
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    fp32_peak = peak_flops(name, "fp32", tf32)
    half_peak = peak_flops(name, "bf16", tf32)
    peaks = (
        f"dense peak used for MFU: bf16/fp16 {half_peak / 1e12:.0f} TFLOP/s, fp32 "
        f"({'TF32' if tf32 else 'no TF32'}) {fp32_peak / 1e12:.0f} TFLOP/s"
        if half_peak and fp32_peak
        else "unknown peak for this device: no MFU"
    )
    lines = [
        f"# GPU readiness: {args.model} training step"
        + (" (dry run on CPU)" if args.dry_run else ""),
        "",
        f"Measured {when} with `python benchmarks/gpu.py {' '.join(sys.argv[1:])}` "
        f"in {total:.0f} s.",
        "",
        f"- device: {name} ({gpus} visible; one used); torch {torch.__version__}, torchvision "
        f"{torchvision.__version__}, {stack}; Python {platform.python_version()}",
        f"- {args.model}, batch {args.batch_size}, {args.image_size}×{args.image_size} random "
        f"images on the device, SGD momentum; {args.warmup} untimed + {args.steps} timed steps "
        "per configuration; cudnn.benchmark on",
        f"- {flops_note} (ResNet-50 4.09 G multiply-adds forward × 2 FLOPs × 3 for forward + "
        f"backward); {peaks}"
        if flops_note
        else "- MFU is only computed for resnet50 at 224×224",
        "",
        "| precision | channels_last | compile | samples/s | TFLOP/s | MFU | peak memory GB |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        head = (
            f"| {r['precision']} | {'on' if r['channels_last'] else 'off'} | "
            f"{'on' if r['compiled'] else 'off'} |"
        )
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | |")
            continue
        mfu = r.get("mfu")
        lines.append(
            f"{head} {r['samples_per_s']:.1f} | "
            + (f"{r['tflops']:.1f}" if "tflops" in r else "–")
            + " | "
            + (f"{mfu:.1%}" if mfu is not None else ("unknown peak" if flops_note else "–"))
            + f" | {r['memory_gb']:.1f} |"
        )
    directory = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(directory, exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
