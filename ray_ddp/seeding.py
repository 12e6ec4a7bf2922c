"""Every seed a run sets, in one place, each with the reason it is what it is.

One ``--seed`` drives everything; what differs is which streams must agree across ranks
and which must differ:

- initial weights: the same on every rank (``seed``), so all replicas start equal before
  DDP's broadcast makes sure of it;
- the training step's own randomness (dropout, stochastic depth, and anything the step
  draws from Python's ``random`` or NumPy): different per rank, or every replica would
  drop the same units on different data (see ``seed_step_randomness``);
- the data order: the sampler's (``seed + epoch``, as DistributedSampler does it), the
  same on every rank, each rank taking its own slice;
- augmentation: per sample, from (seed, epoch, index), so it does not depend on which
  loader process or which rank draws the sample (see ``sample_seed``);
- the built-in dataset and ``--train-samples`` subsets: their own generators.

Seeds are whole numbers from 0 to 2**63 - 1 (the config refuses others): torch takes
seeds below 2**64, which leaves ``seed + epoch`` room. Seeds derived from several numbers
come from NumPy's ``SeedSequence``, which mixes any number of them of any size into
well-spread words of the width each generator takes, instead of arithmetic that can
overflow or make two streams collide.
"""

from __future__ import annotations

import random

import numpy as np
import torch

# SeedSequence spawn keys: one family of streams per use, so the step stream of (epoch,
# rank) and the augmentation of sample (epoch, index) differ even where rank == index.
_STEP, _SAMPLE = 1, 2


def _words(seed: int, *key: int, count: int) -> list[int]:
    """``count`` 32-bit words derived from ``seed`` and ``key`` (any sizes, not negative)."""
    if seed < 0:
        raise ValueError(f"seeds are whole numbers from 0 to 2**63 - 1, got {seed}")
    sequence = np.random.SeedSequence(seed, spawn_key=key)
    return [int(word) for word in sequence.generate_state(count, np.uint32)]


def seed_initial_weights(seed: int) -> None:
    """Before the model is built: identical initial weights on every rank."""
    torch.manual_seed(seed)


def seed_step_randomness(seed: int, rank: int, epoch: int = 0) -> None:
    """The streams the training step draws from: torch's (CPU and every GPU: dropout runs
    on the device), Python's ``random`` and NumPy's global one; one set per rank.

    A fresh run keys them by (seed, rank). A resume with the same world size restores each
    rank's saved RNG states instead; with another world size there are no states to give
    the new ranks, so they start fresh streams keyed by the epoch they resume at too."""
    words = _words(seed, _STEP, epoch, rank, count=5)
    # Each generator gets its own words: torch's CPU generator and NumPy's legacy one are
    # both MT19937 seeded the same way from 32 bits, and the same seed would make them
    # produce the same numbers.
    torch.manual_seed(words[0] | words[1] << 32)
    random.seed(words[2] | words[3] << 32)
    np.random.seed(words[4])  # the legacy global seed must be below 2**32


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index``'s augmentation in ``epoch`` (below 2**64, as torch
    takes it): a new draw every epoch, the same on every re-run, whichever process loads
    it."""
    low, high = _words(seed, _SAMPLE, epoch, index, count=2)
    return low | high << 32
