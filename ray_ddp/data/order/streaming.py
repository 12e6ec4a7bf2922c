"""The epoch order of a streamed split: a two-level shuffle that reads each row group of
an epoch once, yet keeps what ``ray_ddp.data.order.global_order`` promises (the same order at any
world size, every row once per epoch, resumable at any step).

1. The row groups (pieces) are permuted, seeded by ``seed + epoch``.
2. Their rows, in that order, are cut into ``lanes`` equal runs, one per micro-batch of
   an optimizer step (``global_batch / batch_size``: a number that does not depend on the
   world size). Micro-batch ``j`` of every step is drawn from lane ``j``, so the rank
   that trains micro-batch ``j`` (``j mod world_size``) reads only lane ``j``'s groups.
3. Each lane is cut into windows of ``buffer`` rows (rounded up to whole micro-batches),
   and each window is permuted: the shuffle buffer, seeded too.
4. Step ``s`` takes rows ``[s * batch_size, (s + 1) * batch_size)`` of every lane, lane by
   lane; the lanes' last rows (fewer than a batch each) end the epoch together, where the
   usual cut of ``global_order`` makes its last step of them.

How random: a micro-batch holds ``batch_size`` rows drawn from one window of ``buffer``
rows, which come from about ``buffer / group_rows + 1`` row groups lying next to each
other in the epoch's group order; which groups lie together changes every epoch. A full
permutation would draw them from the whole split. Data written in label order (an
ImageFolder converted class by class) gives windows of few classes: write it shuffled, or
raise ``--shuffle-buffer``.
"""

from __future__ import annotations

import numpy as np


def streaming_order(
    pieces: tuple[int, ...], buffer: int, seed: int, epoch: int, lanes: int, batch_size: int
) -> list[int]:
    """The epoch's order of the split's rows (numbered over ``pieces`` in order, each
    ``pieces[k]`` rows long), as described above."""
    buffer = -(-buffer // batch_size) * batch_size  # whole micro-batches: none spans two
    rng = np.random.default_rng([seed, epoch])
    starts = np.concatenate([[0], np.cumsum(pieces, dtype=np.int64)[:-1]]).astype(np.int64)
    sizes = np.asarray(pieces, dtype=np.int64)
    groups = rng.permutation(len(pieces))
    rows = np.concatenate([np.arange(starts[g], starts[g] + sizes[g]) for g in groups])
    total = len(rows)
    bounds = [lane * total // lanes for lane in range(lanes + 1)]
    shuffled = []
    for lane in range(lanes):
        run = rows[bounds[lane] : bounds[lane + 1]].copy()
        for begin in range(0, len(run), buffer):
            window = run[begin : begin + buffer]
            run[begin : begin + buffer] = window[rng.permutation(len(window))]
        shuffled.append(run)
    full = min(len(run) for run in shuffled) // batch_size  # whole batches in every lane
    head = np.stack([run[: full * batch_size] for run in shuffled])  # lanes x rows
    steps = head.reshape(lanes, full, batch_size).transpose(1, 0, 2).reshape(-1)
    tails = [run[full * batch_size :] for run in shuffled]
    return np.concatenate([steps, *tails]).tolist()
