"""A small GAN trained by a loop of its own, run by ray_ddp (``docs/own-loop.md``).

A generator and a discriminator (MLPs) on the built-in dataset's 3x16x16 images, each with
its own Adam, updated in turn every optimizer step: the discriminator over the step's
micro-batches (real images against detached fakes), then the generator over the same
micro-batches. The noise comes from ``run.draws``, seeded by each sample's place in the
global order, so a fake depends on its sample, not on the split; an EMA of the
generator's weights is registered beside the models and optimizers, so a resume, on any
number of workers, continues all five exactly.

    python examples/own_loop/gan.py --num-workers 2 --epochs 2 --name gan
    python examples/own_loop/gan.py --help        # jobs/train.py's flags
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import ray_ddp  # noqa: E402
from ray_ddp.image_classification.synthetic import make_synthetic  # noqa: E402

LATENT = 16
PIXELS = 3 * 16 * 16


def generator() -> nn.Module:
    return nn.Sequential(nn.Linear(LATENT, 128), nn.LeakyReLU(0.2), nn.Linear(128, PIXELS))


def discriminator() -> nn.Module:
    return nn.Sequential(nn.Linear(PIXELS, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1))


class EMA(nn.Module):
    """An exponential moving average of a model's weights (a copy that does not train)."""

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        super().__init__()
        self.decay = decay
        self.average = copy.deepcopy(model).requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for kept, now in zip(self.average.parameters(), model.parameters(), strict=True):
            kept.lerp_(now, 1 - self.decay)


def images(micro) -> torch.Tensor:
    pictures, _labels = micro.data
    return pictures.flatten(1) / 3  # the built-in images have a std of about 1.5-3


def critic_scores(disc: nn.Module, gen: nn.Module, batch) -> dict[str, ray_ddp.Sum]:
    """Validation: how often the discriminator tells real images from the generator's
    fakes (the same noise for every batch)."""
    real = batch[0].flatten(1) / 3
    noise = torch.randn(len(real), LATENT, generator=torch.Generator().manual_seed(0))
    fake = gen(noise.to(real.device))
    right = (disc(real) > 0).sum() + (disc(fake) <= 0).sum()
    return {"acc": ray_ddp.Sum(right, 2 * len(real))}


def train(run: ray_ddp.Run) -> None:
    cfg = run.config
    train_set, val_set = make_synthetic(
        cfg.optim.seed, cfg.data.train_samples, cfg.data.val_samples
    )
    gen, disc = run.setup(generator(), discriminator())
    g_opt = torch.optim.Adam(gen.parameters(), lr=cfg.optim.lr, betas=(0.5, 0.999))
    d_opt = torch.optim.Adam(disc.parameters(), lr=cfg.optim.lr, betas=(0.5, 0.999))
    ema = EMA(unwrapped(gen))
    run.register(generator=gen, discriminator=disc, g_opt=g_opt, d_opt=d_opt, ema=ema)
    for _epoch in run.epochs():
        for step in run.steps(train_set):
            d_opt.zero_grad(set_to_none=True)  # the generator's pass left gradients on it
            for micro in step:  # the discriminator: real against detached fakes
                with torch.no_grad():  # no backward through the generator here
                    fake = gen(run.draws(micro, LATENT, stream=0))
                scores = disc(torch.cat([images(micro), fake]))
                labels = torch.cat([torch.ones(len(fake), 1), torch.zeros(len(fake), 1)])
                run.backward(F.binary_cross_entropy_with_logits(scores, labels.to(scores)), micro)
            run.step(d_opt)
            for micro in step:  # the generator: fool the discriminator just stepped
                scores = disc(gen(run.draws(micro, LATENT, stream=1)))
                run.backward(F.binary_cross_entropy_with_logits(scores, torch.ones_like(scores)),
                             micro)  # fmt: skip
            run.step(g_opt)
            ema.update(unwrapped(gen))
        plain = unwrapped(gen)  # no DDP in evaluation: ranks may run different batch counts
        scores = run.evaluate(disc, val_set, lambda d, batch, g=plain: critic_scores(d, g, batch))
        run.report({"val_acc": scores["acc"]})


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DDP's wrapper (DDP wraps it with more than one worker)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def main(argv: list[str] | None = None) -> int:
    return ray_ddp.main(train, argv, best_metric="acc", best_mode="max", lr=2e-3,
                        batch_size=16, epochs=2, train_samples=512, val_samples=128)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
