"""Keyed pseudorandom permutations of [0, n) evaluated pointwise (a Feistel network).

Why: a rank needs only its own positions of each bucket's shuffled order (1/dp_size of
them). A keyed bijection gives ``perm(i)`` for just those i, so planning costs
O(samples / dp_size) instead of shuffling every bucket in full.

Construction: a balanced Feistel network of ``ROUNDS`` rounds over 2h bits
(2h = the bit length of n - 1 rounded up to an even number, at least 2), with a
splitmix64-style round function keyed by a 64-bit key, and cycle-walking to stay
inside [0, n): it is a bijection on [0, n) for every key. Everything is uint64
arithmetic that numpy and Python compute identically on every machine.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ROUNDS", "keyed_round_keys", "permute", "permute_one", "round_keys"]

ROUNDS = 6
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB


def _mix_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


def round_keys(key: int) -> list[int]:
    """The ROUNDS round keys of a 64-bit permutation key."""
    return [_mix_int((key + (i + 1) * _GOLDEN) & _M64) for i in range(ROUNDS)]


def _half_bits(n: int) -> int:
    bits = max(2, (n - 1).bit_length())
    return (bits + 1) // 2


def permute_one(x: int, n: int, key: int) -> int:
    """``perm(x)`` for one x in [0, n): the pure-Python reference of :func:`permute`."""
    if not 0 <= x < n:
        raise ValueError(f"{x} is outside [0, {n})")
    half = _half_bits(n)
    mask = (1 << half) - 1
    keys = round_keys(key)
    y = x
    while True:
        left, right = y >> half, y & mask
        for k in keys:
            left, right = right, left ^ (_mix_int(right ^ k) & mask)
        y = (left << half) | right
        if y < n:
            return y


def mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_C1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_C2)
    return z ^ (z >> np.uint64(31))


def keyed_round_keys(base: int, idx: np.ndarray) -> np.ndarray:
    """Round keys (ROUNDS, len(idx)) of the permutations ``idx`` derived from ``base``: the
    numpy image of ``round_keys(mix(base + (idx + 1) * golden))``, bitwise on every machine."""
    g = np.uint64(_GOLDEN)
    with np.errstate(over="ignore"):
        key = mix64(np.uint64(base) + (np.asarray(idx).astype(np.uint64) + np.uint64(1)) * g)
        return np.stack([mix64(key + np.uint64(i + 1) * g) for i in range(ROUNDS)])


def permute(x: np.ndarray, n: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``perm_e(x[e])`` for every element e, each with its own domain size and key.

    Args:
        x: int64 positions, ``0 <= x < n``.
        n: int64 domain size per element (>= 1).
        keys: uint64 array of shape (ROUNDS, len(x)): the round keys per element
            (``round_keys(key)`` repeated over a bucket's elements).

    Returns:
        int64 permuted positions, bitwise equal to :func:`permute_one`.
    """
    x = np.asarray(x, dtype=np.uint64)
    n64 = np.asarray(n, dtype=np.uint64)
    bits = np.maximum(2, _bit_length(np.asarray(n, dtype=np.int64) - 1))
    half = ((bits + 1) // 2).astype(np.uint64)
    mask = (np.uint64(1) << half) - np.uint64(1)
    out = x.copy()
    todo = np.arange(x.size)
    with np.errstate(over="ignore"):
        while todo.size:
            y = out[todo]
            h, m = half[todo], mask[todo]
            left, right = y >> h, y & m
            for r in range(ROUNDS):
                left, right = right, left ^ (mix64(right ^ keys[r, todo]) & m)
            y = (left << h) | right
            out[todo] = y
            todo = todo[y >= n64[todo]]
    return out.astype(np.int64)


def _bit_length(v: np.ndarray) -> np.ndarray:
    """Bit length of non-negative int64 values (exact, no float rounding)."""
    out = np.zeros(v.shape, dtype=np.int64)
    v = v.copy()
    for shift in (32, 16, 8, 4, 2, 1):
        big = v >= (1 << shift)
        out[big] += shift
        v[big] >>= shift
    out[v > 0] += 1
    return out
