"""GPU path check without Ray: ray_ddp's own epoch function on a GPU, under DDP on NCCL.

    python benchmarks/gpu_path.py            # ~1 min on one GPU; skips without one
    python benchmarks/gpu_path.py --dry-run  # the same on CPU (gloo; no fp16), to test it

The development machines have no GPU, so the code that only runs there (NCCL, fp16 with
the GradScaler, bf16 autocast on CUDA, the deferred non-finite-loss check, pinned memory
with non-blocking copies) is exercised here, in one process (world size 1: DDP and its
all-reduce hook are real, the ring is trivial). What Ray adds on top (placement, the
process group set-up, ``prepare_data_loader``'s side-stream copies) is not; the GPU
machines this runs on have no Ray installed.

Checks, each printed as a table row and asserted:
- every precision (off, bf16, fp16), accumulation (1, 4) and channels_last trains: the
  loss falls;
- exactly one gradient all-reduce per optimizer step, accumulation included;
- fp16 with a scale that overflows at first: the skipped steps are counted and the LR
  schedule advances once per applied step only;
- a NaN injected at step 7 stops the epoch with NonFiniteLossError naming step 7 and the
  rank, though the GPU check is deferred (read every ``log_every_steps``).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ray_ddp.config.train import TrainConfig  # noqa: E402
from ray_ddp.data.order.global_order import GlobalOrderBatches  # noqa: E402
from ray_ddp.image_classification.models import build_model  # noqa: E402
from ray_ddp.image_classification.synthetic import make_synthetic  # noqa: E402
from ray_ddp.image_classification.task import ImageClassification  # noqa: E402
from ray_ddp.reliability.loss_guard import LossGuard, NonFiniteLossError  # noqa: E402
from ray_ddp.testing.harness import Harness  # noqa: E402
from ray_ddp.worker.comm_stats import attach_counter  # noqa: E402
from ray_ddp.worker.hooks import Faults, Guard, Hooks  # noqa: E402
from ray_ddp.worker.optim import build_optimizer, build_scheduler  # noqa: E402
from ray_ddp.worker.precision import grad_scaler  # noqa: E402
from ray_ddp.worker.state import EpochSums, TrainState  # noqa: E402
from ray_ddp.worker.step import Limits, StepCore, train_segment  # noqa: E402


class OnDevice:
    """Batches copied to the GPU from pinned memory without blocking the host."""

    def __init__(self, loader: DataLoader, device: torch.device):
        self.loader, self.device = loader, device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for inputs, targets in self.loader:
            yield (
                inputs.to(self.device, non_blocking=True),
                targets.to(self.device, non_blocking=True),
            )


def run(
    train,
    device,
    amp: str,
    accum: int,
    *,
    scaler=None,
    nan_at: int | None = None,
    channels_last: bool = False,
):
    cfg = TrainConfig(
        amp=amp,
        accum_steps=accum,
        batch_size=128,
        epochs=1,
        num_workers=1,
        lr=3e-3,
        log_every_steps=5,
    )
    torch.manual_seed(0)
    model = build_model("small_cnn", (3, 16, 16), 10).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = DistributedDataParallel(
        model, device_ids=[device.index] if device.index is not None else None
    )
    counter = attach_counter(model)
    order = GlobalOrderBatches(
        len(train),
        batch_size=cfg.optim.batch_size,
        global_batch=cfg.global_batch_size,
        seed=0,
        rank=0,
        world_size=1,
        tag_epoch=False,
    )
    loader = OnDevice(
        DataLoader(train, batch_sampler=order, pin_memory=device.type == "cuda"), device
    )
    steps = order.plan.steps
    optimizer = build_optimizer(cfg.optim, model.parameters())
    scheduler = build_scheduler(cfg.optim, optimizer, steps)
    state = TrainState(model, optimizer, scheduler, scaler or grad_scaler(amp, device))
    core = StepCore(
        state,
        ImageClassification(),  # the built-in task's loss: cross-entropy on class scores
        amp,
        device,
        cfg.optim.seed,
        cfg.optim.grad_clip,
        channels_last,
    )
    observer = Hooks(
        Faults(Harness(nan_step=nan_at), "", rank=0),  # the NaN check: a loss poisoned then
        Guard(LossGuard(device, rank=0, check_every=cfg.logging.log_every_steps)),
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    result = train_segment(core, order, loader, EpochSums(), observer, Limits())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    steps_done = state.progress.step
    return {
        "loss": result.sums.loss_sum / result.sums.samples,
        "steps": steps_done,
        "skipped": result.skipped,
        "schedule_steps": scheduler.last_epoch,
        "allreduces_per_step": counter.syncs / max(1, steps_done),
        "samples_per_s": result.samples / seconds,
        "peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0,
    }


def main(argv: list[str]) -> int:
    dry = "--dry-run" in argv
    if not dry and not torch.cuda.is_available():
        print("gpu_path: no CUDA GPU here, skipped")
        return 0
    # One process: a file store, not a TCP port (two checks on one machine never collide).
    store = tempfile.mkdtemp(prefix="gpu_path_")
    dist.init_process_group(
        "gloo" if dry else "nccl", init_method=f"file://{store}/store", rank=0, world_size=1
    )
    if dry:
        device = torch.device("cpu")
        print(f"gpu_path --dry-run: CPU, torch {torch.__version__}, gloo")
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        print(f"gpu_path: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, NCCL")
    train, _ = make_synthetic(0, train_samples=4096 if dry else 16384, val_samples=128)
    first_loss = run(train, device, "off", 1)["loss"]  # warms up CUDA and cuDNN too

    print("amp   accum  nhwc  steps  skipped  sched  allreduce/step  loss    samples/s  peak MB")
    failures = []
    for amp in ("off", "bf16") if dry else ("off", "bf16", "fp16"):
        for accum, nhwc in ((1, False), (4, False), (1, True)):
            r = run(train, device, amp, accum, channels_last=nhwc)
            print(
                f"{amp:5} {accum:5}  {'on' if nhwc else 'off':4}  {r['steps']:5}  {r['skipped']:7}"
                f"  {r['schedule_steps']:5}  {r['allreduces_per_step']:14.2f}  {r['loss']:.4f}"
                f"  {r['samples_per_s']:9.0f}  {r['peak_mb']:7.0f}"
            )
            tag = f"{amp}/accum {accum}/nhwc {nhwc}"
            if r["allreduces_per_step"] != 1.0:
                failures.append(f"{tag}: {r['allreduces_per_step']} all-reduces/step")
            if r["schedule_steps"] != r["steps"] - r["skipped"]:
                failures.append(f"{tag}: schedule advanced on skipped steps")
            if not r["loss"] < 2.3:  # log(10): chance level
                failures.append(f"{tag}: loss {r['loss']:.3f} did not fall")

    if not dry:
        overflowing = torch.amp.GradScaler("cuda", init_scale=2.0**40)  # fp16 grads overflow
        r = run(train, device, "fp16", 1, scaler=overflowing)
        print(
            f"fp16 from scale 2^40: {r['skipped']} of {r['steps']} steps skipped, "
            f"schedule advanced {r['schedule_steps']} times, loss {r['loss']:.4f}"
        )
        if not (r["skipped"] > 0 and r["schedule_steps"] == r["steps"] - r["skipped"]):
            failures.append("fp16 overflow: skipped steps not handled")

    try:
        run(train, device, "bf16", 1, nan_at=7)
        failures.append("an injected NaN did not stop the epoch")
    except NonFiniteLossError as exc:
        print(f"NaN injected at step 7: {exc}")
        if "optimizer step 7 on rank 0" not in str(exc):
            failures.append(f"NaN reported as: {exc}")

    dist.destroy_process_group()
    shutil.rmtree(store, ignore_errors=True)
    print(f"first warm-up loss {first_loss:.4f}")
    for failure in failures:
        print(f"FAILED: {failure}")
    print("gpu_path: " + ("all checks passed" if not failures else f"{len(failures)} failed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
