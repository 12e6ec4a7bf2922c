"""PyTorch Lightning's Trainer with the DDP strategy on 2 CPU processes.

    python benchmarks/lightning_ddp.py --devices 2 --max-steps 60 --result out.json

Started with plain ``python``: Lightning's own launcher re-runs this script for ranks
1..N-1 (``strategy="ddp"``, its subprocess-script launcher), as a Lightning user would run
it. No progress bar, no logger, no checkpointing, no validation, no model summary. Needs
the ``bench`` extra (``pip install -e '.[bench]'``, lightning 2.6.6).
"""

from __future__ import annotations

import time

SCRIPT_START_UNIX = time.time()

import argparse  # noqa: E402
import warnings  # noqa: E402

import common  # noqa: E402  (puts the repository root on sys.path)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from ray_ddp.worker.comm_stats import attach_counter  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_arguments(parser)
    parser.add_argument("--devices", type=int, default=2, help="CPU processes")
    args = parser.parse_args()
    common.one_thread()
    # Lightning's advice to raise DataLoader workers: the data is tensors in memory.
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")

    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self, net: torch.nn.Module) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            data, target = batch
            return F.cross_entropy(self.net(data).float(), target)

        def configure_optimizers(self):
            optimizer, scheduler = common.optimizer_and_schedule(self.parameters(), args.max_steps)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
            }

    class Timing(pl.Callback):
        def __init__(self) -> None:
            self.timer = common.StepTimer(args.timing_warmup)
            self.last_step = 0
            self.counter = None

        def on_train_start(self, trainer, pl_module):
            # Lightning registers DDP comm hooks on CUDA only; on CPU, do it by hand on the
            # DDP wrapper it built.
            ddp_model = trainer.strategy.model
            if isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
                self.counter = attach_counter(ddp_model)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step != self.last_step:  # this batch ended an optimizer step
                self.last_step = trainer.global_step
                self.timer.step_done()

    train_ds, _ = common.datasets(args)
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True)
    module = Module(common.model(args, train_ds))
    timing = Timing()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.max_steps,
        max_epochs=-1,
        gradient_clip_val=common.GRAD_CLIP,
        accumulate_grad_batches=args.accum_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[timing],
    )
    pl.seed_everything(args.seed, verbose=False)
    trainer.fit(module, loader)
    if trainer.global_rank == 0:
        steps = trainer.global_step
        syncs = timing.counter.syncs if timing.counter else 0
        common.write_result(
            args.result,
            {
                "impl": "lightning",
                "world_size": trainer.world_size,
                "per_worker_batch_size": args.batch_size,
                "accum_steps": args.accum_steps,
                "steps": steps,
                "script_start_unix": SCRIPT_START_UNIX,
                "allreduces_per_step": syncs / max(1, steps),
                **timing.timer.figures(args.batch_size * args.accum_steps),
            },
        )


if __name__ == "__main__":
    main()
