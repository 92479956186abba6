"""Seeded permutations of ``range(n)`` in O(1) memory: a 4-round Feistel network on the smallest
even-bit domain holding ``n``, cycle-walked back into range. Why not ``rng.permutation(n)``: a
mixture draws a fresh permutation of every source per cycle, and a source of 10^9 samples would
need 8 GB for one; here any position's image is computed on its own (vectorised over arrays)."""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def keys(seed: int, *salt: int) -> np.ndarray:
    """Four 64-bit round keys from (seed, salt...)."""
    return np.random.SeedSequence([int(seed) & (2**63 - 1), *(int(s) for s in salt)]).generate_state(
        4, np.uint64
    )


def _round(x: np.ndarray, key: np.uint64, mask: np.uint64) -> np.ndarray:
    z = x + key  # splitmix64's finaliser: a good 64-bit mix, wrapping arithmetic on arrays
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return (z ^ (z >> np.uint64(31))) & mask


def _feistel(x: np.ndarray, k: np.ndarray, half: int) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    h = np.uint64(half)
    left, right = x >> h, x & mask
    for key in k:
        left, right = right, left ^ _round(right, key, mask)
    return (left << h) | right


def permute(index: np.ndarray, n: int, k: np.ndarray) -> np.ndarray:
    """``perm[index]`` for the permutation of ``range(n)`` keyed by ``k`` (int64 in, int64 out)."""
    if n <= 1:
        return np.zeros(len(index), np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    x = np.asarray(index, np.int64).astype(np.uint64)
    x = _feistel(x, k, half)
    limit = np.uint64(n)
    out = x >= limit
    while out.any():  # cycle walking: at most a few rounds (the domain is < 4n)
        x[out] = _feistel(x[out], k, half)
        out = x >= limit
    return x.astype(np.int64)
