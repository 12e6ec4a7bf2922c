"""The bare single-process loop: no process group, no DDP, no launcher. The limit of what
one worker can do, and the denominator of scaling efficiency.

    python benchmarks/single_process.py --max-steps 60 --result out.json
"""

from __future__ import annotations

import time

SCRIPT_START_UNIX = time.time()

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402

import common  # noqa: E402  (puts the repository root on sys.path)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_arguments(parser)
    args = parser.parse_args()
    common.one_thread()

    train_ds, val_ds = common.datasets(args)
    generator = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(
        train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=generator
    )
    model = common.model(args, train_ds)
    optimizer, scheduler = common.optimizer_and_schedule(model.parameters(), args.max_steps)

    timer = common.StepTimer(args.timing_warmup)
    accum = args.accum_steps
    epochs = math.ceil(args.max_steps / (len(loader) // accum))
    step = 0
    for epoch in range(epochs):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for batch_idx, (data, target) in enumerate(loader):
            loss = F.cross_entropy(model(data).float(), target)
            (loss / accum).backward()
            if (batch_idx + 1) % accum:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), common.GRAD_CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            timer.step_done()
            if step >= args.max_steps:
                break
        # The same end-of-epoch work as the DDP scripts: validation and a checkpoint.
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for data, target in DataLoader(val_ds, batch_size=2 * args.batch_size):
                correct += (model(data).argmax(1) == target).sum().item()
                total += target.numel()
        print(f"epoch {epoch + 1}: val_acc {correct / total:.2%}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(
                {"model_state_dict": model.state_dict(), "optimizer": optimizer.state_dict()},
                os.path.join(tmp, "checkpoint.pt"),
            )
        if step >= args.max_steps:
            break

    common.write_result(
        args.result,
        {
            "impl": "single",
            "world_size": 1,
            "per_worker_batch_size": args.batch_size,
            "accum_steps": accum,
            "steps": step,
            "script_start_unix": SCRIPT_START_UNIX,
            "allreduces_per_step": 0.0,
            **timer.figures(args.batch_size * accum),
        },
    )


if __name__ == "__main__":
    main()
