"""Every seed a run sets, in one place, each with the reason it is what it is.

One ``--seed`` drives everything; what differs is which streams must agree across ranks
and which must differ:

- initial weights: the same on every rank (``seed``), so all replicas start equal before
  DDP's broadcast makes sure of it;
- the training step's own randomness (dropout, stochastic depth): different per rank
  (``seed + rank``), or every replica would drop the same units on different data;
- the data order: the sampler's (``seed + epoch``, as DistributedSampler does it), the
  same on every rank, each rank taking its own slice;
- augmentation: per sample, from (seed, epoch, index), so it does not depend on which
  loader process or which rank draws the sample (see ``sample_seed``);
- the built-in dataset and ``--train-samples`` subsets: their own generators.
"""

from __future__ import annotations

import torch

# A prime stride between epochs: (epoch, rank) pairs map to distinct seeds for any world
# size below it, so a resume with another world size never repeats an earlier stream.
_EPOCH_STRIDE = 7919


def seed_initial_weights(seed: int) -> None:
    """Before the model is built: identical initial weights on every rank."""
    torch.manual_seed(seed)


def seed_step_randomness(seed: int, rank: int, epoch: int = 0) -> None:
    """The stream the training step draws from (dropout): one per rank.

    A fresh run uses ``seed + rank``. A resume with the same world size restores each
    rank's saved RNG state instead; with another world size there is no state to give the
    new ranks, so they start fresh streams keyed by the epoch they resume at."""
    torch.manual_seed(seed + _EPOCH_STRIDE * epoch + rank)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index``'s augmentation in ``epoch``: a new draw every epoch,
    the same on every re-run, whichever process loads it."""
    return (seed * 1_000_003 + epoch) * 10_000_019 + index
