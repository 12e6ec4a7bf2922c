"""The epoch order of a streamed split: a two-level shuffle that reads each row group of
an epoch once, yet keeps what ``ray_ddp.data.order.global_order`` promises (the same order at any
world size, every row once per epoch, resumable at any step).

1. The row groups (pieces) are permuted, seeded by ``(seed, epoch)``.
2. Their rows, in that order, are cut into ``lanes`` equal runs, one per micro-batch of
   an optimizer step (``global_batch / batch_size``: a number that does not depend on the
   world size). Micro-batch ``j`` of every step is drawn from lane ``j``, so the rank
   that trains micro-batch ``j`` (``j mod world_size``) reads only lane ``j``'s groups.
3. Each lane is cut into windows of ``buffer`` rows (rounded up to whole micro-batches),
   and each window is permuted: the shuffle buffer, seeded too.
4. Step ``s`` takes rows ``[s * batch_size, (s + 1) * batch_size)`` of every lane, lane by
   lane; the lanes' last rows (fewer than a batch each) end the epoch together, where the
   usual cut of ``global_order`` makes its last step of them.

Two versions of it (``global_order``'s order versions):

- :class:`StreamedOrder` (:data:`STREAMED_VERSION`, today's): every permutation is a
  ``permutation.KeyedPermutation`` of its own keys, the row groups' of ``(seed, epoch)``,
  window ``w`` of lane ``j``'s of ``(seed, epoch, j, w)``; so the row at any position is
  computed from the position, without drawing the windows before it. It holds two numbers
  a row group (16 bytes: 1.6 MB at 1e5 groups) and a few a lane, whatever the rows;
- :func:`streaming_order` (order versions 1 and 2): the same cut, but the permutations are
  drawn one after the other from one NumPy generator, so the order is made whole (about
  77 bytes a row as the list a sampler cuts: 77 GB a rank at a billion rows). An epoch a
  checkpoint of it stopped inside is finished in it; the next epochs take today's.

How random: a micro-batch holds ``batch_size`` rows drawn from one window of ``buffer``
rows, which come from about ``buffer / group_rows + 1`` row groups lying next to each
other in the epoch's group order; which groups lie together changes every epoch. A full
permutation would draw them from the whole split. Data written in label order (an
ImageFolder converted class by class) gives windows of few classes: write it shuffled, or
raise ``--shuffle-buffer``.
"""

from __future__ import annotations

import functools

import numpy as np

from ray_ddp.data.order.permutation import (
    KeyedPermutation,
    PositionOrder,
    permute_each,
    round_keys,
)

STREAMED_VERSION = 3
"""Today's streamed order (:class:`StreamedOrder`); versions 1 and 2 are
:func:`streaming_order`'s. Recorded in a checkpoint's order record."""
_PIECES, _WINDOW = 0, 1
"""The first key word of the row groups' permutation and of a window's (``stream``)."""


class StreamedOrder(PositionOrder):
    """The epoch's order of the split's rows (numbered over ``pieces`` in order, each
    ``pieces[k]`` rows long), as the module docstring describes, computed by position:
    ``order[position]`` is the row trained there."""

    def __init__(
        self, pieces: tuple[int, ...], buffer: int, seed: int, epoch: int, lanes: int,
        batch_size: int,
    ) -> None:  # fmt: skip
        self.seed, self.epoch, self.lanes, self.batch = seed, epoch, lanes, batch_size
        self.window = -(-buffer // batch_size) * batch_size  # whole micro-batches
        self.first_rows, self.run_starts = _group_order(pieces, seed, epoch)
        self.size = total = int(self.run_starts[-1])
        self.bounds = np.asarray([lane * total // lanes for lane in range(lanes + 1)], np.int64)
        self.lengths = np.diff(self.bounds)  # each lane's rows
        self.full = int(self.lengths.min()) // batch_size  # whole batches in every lane
        self.head = self.full * batch_size * lanes
        tails = self.lengths - self.full * batch_size
        self.tail_starts = self.head + np.concatenate([[0], np.cumsum(tails)[:-1]])

    def lane_offsets(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each position's lane and its offset in the lane (step 4 undone)."""
        lane, offset = np.empty_like(positions), np.empty_like(positions)
        head = positions < self.head
        step, within = np.divmod(positions[head], self.lanes * self.batch)
        lane[head] = within // self.batch
        offset[head] = step * self.batch + within % self.batch
        tail = positions[~head]  # the lanes' last rows, lane by lane
        lane[~head] = np.searchsorted(self.tail_starts, tail, side="right") - 1
        offset[~head] = self.full * self.batch + tail - self.tail_starts[lane[~head]]
        return lane, offset

    def at(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        lane, offset = self.lane_offsets(positions)
        window, within = np.divmod(offset, self.window)
        windows, which = np.unique(lane * (self.size + 1) + window, return_inverse=True)
        which = which.reshape(-1)
        # Step 3: every window its own permutation, one pass for the windows of a size.
        lanes, numbers = np.divmod(windows, self.size + 1)
        rows = np.minimum(self.window, self.lengths[lanes] - numbers * self.window)[which]
        keys = np.asarray(
            [round_keys(self.seed, self.epoch, _WINDOW, j, w)
             for j, w in zip(lanes.tolist(), numbers.tolist(), strict=True)],
            dtype=np.uint64,
        ).T[:, which]  # fmt: skip
        shuffled = np.empty_like(within)
        for size in np.unique(rows).tolist():  # a lane's last window may be short
            mine = rows == size
            shuffled[mine] = permute_each(size, keys[:, mine], within[mine])
        run = self.bounds[lane] + window * self.window + shuffled  # in the groups' order
        group = np.searchsorted(self.run_starts, run, side="right") - 1
        return self.first_rows[group] + run - self.run_starts[group]

    def __repr__(self) -> str:
        return f"StreamedOrder(rows={self.size}, lanes={self.lanes}, window={self.window})"


@functools.lru_cache(maxsize=2)
def _group_order(pieces: tuple[int, ...], seed: int, epoch: int) -> tuple[np.ndarray, ...]:
    """Step 1: the first row of each row group in the epoch's group order, and where each
    one's rows begin in the run of all of them (one more: the rows in all). Cached: a new
    position in the same epoch reuses them."""
    sizes = np.asarray(pieces, dtype=np.int64)
    firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    groups = KeyedPermutation(len(pieces), seed, epoch, _PIECES).at(np.arange(len(pieces)))
    run_starts = np.concatenate([[0], np.cumsum(sizes[groups])]).astype(np.int64)
    return firsts[groups], run_starts


def streaming_order(
    pieces: tuple[int, ...], buffer: int, seed: int, epoch: int, lanes: int, batch_size: int
) -> list[int]:
    """Order versions 1 and 2's epoch order of the split's rows (numbered over ``pieces``
    in order, each ``pieces[k]`` rows long), as described above, made whole."""
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
