"""A keyed bijection of ``[0, size)``: an epoch's order, computed one position at a time.

``torch.randperm(size)`` holds the whole order (8 bytes a sample as a tensor, about 36 as
the Python list a sampler cuts: ~80 GB per rank at a billion samples) and is remade at
every resume. Here the sample at any position is computed directly from the position, so
the order costs a few words of memory and a resume costs nothing:

- a Feistel network on ``[0, 2**bits)``, ``2**bits`` the next power of two at or above
  ``size`` (at least 4): a position's bits are split in two halves (one bit longer where
  ``bits`` is odd), and each of :data:`ROUNDS` rounds replaces one half by the other, and
  the other by ``half XOR F(other half)``. Each round is a bijection whatever ``F`` is;
  ``F`` is SplitMix64's finaliser of the half XOR a round key, and the round keys are drawn
  from ``(seed, epoch)``, so every epoch of every seed is its own permutation;
- cycle-walking: a value that lands at or past ``size`` is put through the network again
  until it lands inside. That is a bijection of ``[0, size)`` (it follows the network's
  cycles, each value to the next one inside), and since ``2**bits < 2 * size`` (at
  ``size`` > 2) a walk takes under two turns on average.

Four rounds of a random function make a pseudo-random permutation (Luby and Rackoff); the
round function is a good 64-bit mixer, not a cryptographic one: a shuffle, not a secret.
Everything is vectorised over NumPy ``uint64`` arrays (about 0.1 µs a position in bulk).

A permutation may also be keyed by further words after ``(seed, epoch)`` (``stream``): the
streamed Parquet order (``streaming``) draws its row-group order and each shuffle window's
order so, every one its own permutation, none drawn from another. With no words the keys
are those of order version 2 (``global_order.ORDER_VERSION``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

ROUNDS = 4
_MASK = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15
_CHUNK = 1 << 16
"""Positions computed at once when the whole order is iterated (bounds the temporaries)."""


def mix_key(value: int) -> int:
    """SplitMix64's finaliser on a Python int: keys drawn from seeds."""
    z = value & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def mix64(values: np.ndarray, key: np.uint64) -> np.ndarray:
    """SplitMix64's finaliser of ``values XOR key``, element-wise on ``uint64`` (wraps mod
    2**64): the round function here, and the built-in dataset's counter-based draws."""
    z = values ^ key
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class PositionOrder(Sequence[int]):
    """An epoch's order whose sample at a position is computed from the position
    (:meth:`at`, vectorised): ``order[position]`` is one sample, a slice a list computed at
    once, and iterating computes it a chunk at a time. Equal to a list of the same samples."""

    size: int

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The samples at ``positions`` (each in ``[0, size)``), as int64."""
        raise NotImplementedError

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, key: int) -> int: ...
    @overload
    def __getitem__(self, key: slice) -> list[int]: ...
    def __getitem__(self, key: int | slice) -> int | list[int]:
        if isinstance(key, slice):
            span = range(self.size)[key]
            positions = np.arange(span.start, span.stop, span.step, dtype=np.int64)
            return self.at(positions).tolist() if len(span) else []
        position = range(self.size)[key]  # negative positions and IndexError as a list's
        return int(self.at(np.asarray([position]))[0])

    def __iter__(self) -> Iterator[int]:
        for begin in range(0, self.size, _CHUNK):
            yield from self[begin : begin + _CHUNK]

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, Sequence):
            return len(other) == self.size and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, as a list is


class KeyedPermutation(PositionOrder):
    """Epoch ``epoch``'s permutation of ``[0, size)`` for ``seed`` (and the words of
    ``stream``, if any): ``perm[position]`` is the sample trained at ``position``."""

    def __init__(self, size: int, seed: int, epoch: int, *stream: int) -> None:
        self.size = size
        self.keys = tuple(np.uint64(key) for key in round_keys(seed, epoch, *stream))

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The samples at ``positions`` (each in ``[0, size)``), as int64."""
        return _walk(np.asarray(positions), self.size, self.keys, _network)

    def position_of(self, samples: np.ndarray) -> np.ndarray:
        """The positions of ``samples``: the inverse permutation."""
        return _walk(np.asarray(samples), self.size, self.keys, _inverse_network)

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, KeyedPermutation):
            return (self.size, self.keys) == (other.size, other.keys)
        return super().__eq__(other)

    __hash__ = None  # as PositionOrder: equal by value, so unhashable

    def __repr__(self) -> str:
        return f"KeyedPermutation(size={self.size}, keys={[int(k) for k in self.keys]})"


def round_keys(seed: int, epoch: int, *stream: int) -> list[int]:
    """The :data:`ROUNDS` round keys of the permutation of ``(seed, epoch, *stream)``."""
    base = mix_key(mix_key(seed) ^ (epoch * _GOLDEN))
    for word in stream:  # a sub-order of the epoch's: its own keys
        base = mix_key(base ^ mix_key(word + _GOLDEN))
    return [mix_key(base + i * _GOLDEN) for i in range(ROUNDS)]


def permute_each(size: int, keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Each of ``positions`` through its own permutation of ``[0, size)``: position ``i``
    through the one of round keys ``keys[:, i]`` (:func:`round_keys`, as ``uint64``), so
    many permutations of one size cost one pass of the network, not one each (a pass
    costs some 100 us however few its positions)."""
    return _walk(np.asarray(positions), size, tuple(keys), _network)


Keys = tuple[Any, ...]
"""The round keys a walk uses: each a ``uint64`` scalar, or an array of one per value."""


def _widths(size: int) -> tuple[int, int]:
    """The high and the low half's bits of the network on ``[0, 2**bits)``."""
    bits = max(2, (size - 1).bit_length())
    return bits // 2, bits - bits // 2


def _network(x: np.ndarray, size: int, keys: Keys) -> np.ndarray:
    high, low = _widths(size)
    for key in keys:
        top, bottom = x >> np.uint64(low), x & np.uint64((1 << low) - 1)
        x = (bottom << np.uint64(high)) | (top ^ (mix64(bottom, key) & np.uint64((1 << high) - 1)))
        high, low = low, high  # the halves swap: the new high half was the low one
    return x


def _inverse_network(x: np.ndarray, size: int, keys: Keys) -> np.ndarray:
    high, low = _widths(size) if ROUNDS % 2 == 0 else _widths(size)[::-1]
    for key in reversed(keys):
        top, bottom = x >> np.uint64(low), x & np.uint64((1 << low) - 1)
        x = ((bottom ^ (mix64(top, key) & np.uint64((1 << low) - 1))) << np.uint64(high)) | top
        high, low = low, high
    return x


def _walk(positions: np.ndarray, size: int, keys: Keys, network) -> np.ndarray:
    out = network(positions.astype(np.uint64), size, keys)
    outside = np.flatnonzero(out >= size)
    while outside.size:  # cycle-walking: through the network again until inside
        their = tuple(k if np.ndim(k) == 0 else k[outside] for k in keys)
        out[outside] = network(out[outside], size, their)
        outside = outside[out[outside] >= size]
    return out.astype(np.int64)
