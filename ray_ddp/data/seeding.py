"""Every seed a run sets, in one place, each with the reason it is what it is.

One ``--seed`` drives everything; what differs is which streams must agree across ranks
and which must differ:

- initial weights: the same on every rank (``seed``), so all replicas start equal before
  DDP's broadcast makes sure of it;
- the training step's own randomness (dropout, stochastic depth, and anything the step
  draws from Python's ``random`` or NumPy): seeded before every micro-batch from (seed,
  optimizer step, micro-batch number in the step), so it differs between micro-batches
  (or every replica would drop the same units on different data) and does not depend on
  which rank trains the micro-batch, how many ranks there are, or where a run resumed
  (see ``seed_micro_batch``);
- the data order: one permutation per epoch (``seed + epoch``, as DistributedSampler
  does it), the same on every rank and at every world size (``ray_ddp.data.order.global_order``);
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

# SeedSequence spawn keys: one family of streams per use, so the stream of micro-batch
# (step, micro) and the augmentation of sample (epoch, index) differ even where they meet.
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


def seed_micro_batch(seed: int, step: int, micro: int, device: torch.device | None = None) -> None:
    """Before micro-batch ``micro`` of optimizer step ``step`` (counted over the run): the
    streams the training step draws from, torch's CPU generator and ``device``'s if it is
    a GPU (dropout runs on the device), Python's ``random`` and NumPy's global one.

    Keyed by the step and the micro-batch, not the rank, so a micro-batch gets the same
    dropout at any world size and after any resume: no RNG state needs saving. Each
    generator is seeded directly (~15 us in all here): ``torch.manual_seed`` would visit
    every device kind and cost ~70 us per micro-batch."""
    words = _words(seed, _STEP, step, micro, count=5)
    # Each generator gets its own words: torch's CPU generator and NumPy's legacy one are
    # both MT19937 seeded the same way from 32 bits, and the same seed would make them
    # produce the same numbers.
    value = words[0] | words[1] << 32
    torch.default_generator.manual_seed(value)
    if device is not None and device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(value)  # this GPU's generator only
    random.seed(words[2] | words[3] << 32)
    np.random.seed(words[4])  # the legacy global seed must be below 2**32


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index``'s augmentation in ``epoch`` (below 2**64, as torch
    takes it): a new draw every epoch, the same on every re-run, whichever process loads
    it."""
    low, high = _words(seed, _SAMPLE, epoch, index, count=2)
    return low | high << 32


_DRAW = 3  # the spawn key of an own loop's seeded draws (``draw_seed``)


def draw_seed(seed: int, epoch: int, index: int, stream: int = 0) -> int:
    """The seed of what an own loop draws for sample ``index`` in ``epoch`` (a GAN's
    noise, an augmentation drawn on the device), in its ``stream`` (one per use, so two
    draws for the same sample differ): keyed by the sample, not by the rank or the
    micro-batch, so the draw is the same at any world size and after any resume."""
    low, high = _words(seed, _DRAW, epoch, index, stream, count=2)
    return low | high << 32
