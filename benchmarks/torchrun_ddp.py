"""The baseline: a plain DDP script written by hand the way the torchrun guide teaches.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/torchrun_ddp.py --max-steps 60 --result out.json

init_process_group (gloo on CPU, NCCL with GPUs), set_device(local_rank), a
DistributedSampler with set_epoch every epoch, the model wrapped in DDP, gradient
accumulation, rank-0 logging, validation across ranks and a rank-0 checkpoint of
``model.module.state_dict()``. The model and data are ray_ddp's (``build_model``,
``make_synthetic``), so the work is the same as ``jobs/train.py``'s.

``--accum-mode every`` all-reduces on every micro-step (the guide's accumulation);
``--accum-mode no_sync`` skips the all-reduce on non-boundary micro-steps with
``model.no_sync()`` (what ray_ddp does).
"""

from __future__ import annotations

import time

SCRIPT_START_UNIX = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402

import common  # noqa: E402  (puts the repository root on sys.path)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from ray_ddp.worker.comm_stats import attach_counter  # noqa: E402


def main() -> None:
    # 1. Arguments. torchrun passes LOCAL_RANK in the environment; --local-rank is the
    #    older torch.distributed.launch way, kept as the guide does.
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_arguments(parser)
    parser.add_argument("--accum-mode", choices=("no_sync", "every"), default="no_sync")
    parser.add_argument("--local-rank", "--local_rank", type=int, default=0)
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    common.one_thread()

    # 2. Process group and device.
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    # 3. Data: every rank builds the same in-memory dataset; the sampler shards it.
    train_ds, val_ds = common.datasets(args)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(
        train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True, pin_memory=use_cuda
    )

    # 4. Model, the same initial weights on every rank, wrapped in DDP.
    model = common.model(args, train_ds).to(device)
    model = DDP(model, device_ids=[local_rank] if use_cuda else None)
    counter = attach_counter(model)  # counts all-reduces through a DDP comm hook
    optimizer, scheduler = common.optimizer_and_schedule(model.parameters(), args.max_steps)
    torch.manual_seed(args.seed + rank)

    timer = common.StepTimer(args.timing_warmup)
    accum = args.accum_steps
    steps_per_epoch = len(loader) // accum
    epochs = math.ceil(args.max_steps / steps_per_epoch)
    step = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a different shuffle every epoch
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for batch_idx, (data, target) in enumerate(loader):
            data, target = data.to(device), target.to(device)
            boundary = (batch_idx + 1) % accum == 0
            sync = (
                model.no_sync()
                if args.accum_mode == "no_sync" and not boundary
                else contextlib.nullcontext()
            )
            with sync:
                loss = F.cross_entropy(model(data).float(), target)
                (loss / accum).backward()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), common.GRAD_CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            timer.step_done()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch + 1} step {step} loss {loss.item():.4f}", flush=True)
            if step >= args.max_steps:
                break

        # 5. Validation: every rank takes its own slice, the sums are all-reduced.
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=device)
        shard = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world_size))
        with torch.no_grad():
            for data, target in DataLoader(shard, batch_size=2 * args.batch_size):
                data, target = data.to(device), target.to(device)
                logits = model.module(data).float()
                totals[0] += F.cross_entropy(logits, target, reduction="sum").double()
                totals[1] += (logits.argmax(1) == target).sum()
                totals[2] += target.numel()
        dist.all_reduce(totals)

        # 6. Log and save on rank 0 only, the unwrapped weights.
        if rank == 0:
            val_loss, val_acc = (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()
            print(f"epoch {epoch + 1}: val_loss {val_loss:.4f} val_acc {val_acc:.2%}", flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                torch.save(
                    {
                        "epoch": epoch,
                        "model_state_dict": model.module.state_dict(),
                        "optimizer_state_dict": optimizer.state_dict(),
                    },
                    os.path.join(tmp, "checkpoint.pt"),
                )
        if step >= args.max_steps:
            break

    if rank == 0:
        common.write_result(
            args.result,
            {
                "impl": "torchrun",
                "world_size": world_size,
                "per_worker_batch_size": args.batch_size,
                "accum_steps": accum,
                "accum_mode": args.accum_mode,
                "steps": step,
                "script_start_unix": SCRIPT_START_UNIX,
                "allreduces_per_step": counter.syncs / max(1, step),
                **timer.figures(args.batch_size * accum),
            },
        )
    # Every rank leaves together: a rank that tears its gloo group down while another is
    # still connected can abort ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
