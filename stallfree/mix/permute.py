"""Seeded permutations of ``range(n)`` in O(1) memory: a 6-round (unbalanced) Feistel network on
the smallest power-of-two domain holding ``n`` (< 2n), cycle-walked back into range. Why not ``rng.permutation(n)``: an
epoch of 10^9 samples would need 8 GB for one array (and a mixture draws a fresh permutation of
every source per cycle); here any position's image is computed on its own, vectorised over
arrays, so an order costs its keys and nothing per sample.

Every function here is a bijection of ``range(n)`` for each key (a Feistel network is invertible
for any round function, and cycle walking restricts a bijection of the larger domain to one of
``range(n)``), so "every index exactly once" holds by construction, not by luck of the keys.

``permute`` takes one key set for a whole array; ``permute_each`` varies it per element with a
tweak (a block order permutes every window of shards with its own, and one batch may span many).
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
ROUNDS = 6
_ONE = np.uint64(1)
_SIXTY_FOUR = np.uint64(64)


def keys(seed: int, *salt: int) -> np.ndarray:
    """Round keys from (seed, salt...): per round an xor key and an odd multiplier."""
    ss = np.random.SeedSequence([int(seed) & (2**63 - 1), *(int(s) & (2**63 - 1) for s in salt)])
    k = ss.generate_state(2 * ROUNDS, np.uint64)
    k[1::2] |= _ONE
    return k


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a good 64-bit mix, wrapping arithmetic on uint64 arrays."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def tweaks(base: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """One 64-bit tweak per sub-permutation ``ids[i]``, xored into every round key: many keyed
    permutations from one key set (a block order permutes each window of shards with its own).
    A hash, not a SeedSequence per id: 200,000 shards need as many, and one SeedSequence costs
    ~10 us."""
    ids = np.asarray(ids, np.int64).astype(np.uint64)
    return mix64(base[0] ^ mix64((ids + _ONE) * _GOLDEN))


def _width(n: int) -> tuple[np.uint64, np.uint64]:
    """Bits of the two halves: the smallest domain ``2**(a+b) >= n`` (so < 2n), split a <= b."""
    bits = max(2, (int(n) - 1).bit_length())
    return np.uint64(bits // 2), np.uint64(bits - bits // 2)


def widths_of(n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``_width`` for an array of sizes."""
    n = np.maximum(np.asarray(n, np.int64), 4)
    bits = np.ceil(np.log2(n.astype(np.float64))).astype(np.int64)
    bits = np.where((np.int64(1) << bits) < n, bits + 1, bits)  # float log2 may round down
    a = bits // 2
    return a.astype(np.uint64), (bits - a).astype(np.uint64)


def _feistel(
    x: np.ndarray, k: np.ndarray, a: np.ndarray, b: np.ndarray, tweak: np.ndarray | None = None
) -> np.ndarray:
    """The network on ``a + b``-bit values: rounds alternately xor into the high ``a`` bits a hash of
    the low ``b`` and into the low ``b`` a hash of the high ``a`` (each round invertible: xor the
    same hash again). The hash is multiply-shift: the top bits of ``(v ^ key) * odd``.
    ``k`` is one key set ``(2*ROUNDS,)``; ``tweak`` (one per element) varies it per element."""
    hi, lo = x >> b, x & ((_ONE << b) - _ONE)
    shift_hi, shift_lo = _SIXTY_FOUR - a, _SIXTY_FOUR - b
    t = np.empty_like(x)
    for r in range(ROUNDS):
        key, mul = k[2 * r], k[2 * r + 1]
        src, dst, shift = (lo, hi, shift_hi) if r % 2 == 0 else (hi, lo, shift_lo)
        np.bitwise_xor(src, key, out=t)
        if tweak is not None:
            np.bitwise_xor(t, tweak, out=t)
        np.multiply(t, mul, out=t)
        np.right_shift(t, shift, out=t)
        np.bitwise_xor(dst, t, out=dst)
    return (hi << b) | lo


def permute(index: np.ndarray, n: int, k: np.ndarray) -> np.ndarray:
    """``perm[index]`` for the permutation of ``range(n)`` keyed by ``k`` (int64 in, int64 out)."""
    index = np.asarray(index, np.int64)
    if n <= 1:
        return np.zeros(len(index), np.int64)
    a, b = _width(n)
    x = _feistel(index.astype(np.uint64), k, a, b)
    limit = np.uint64(n)
    out = np.flatnonzero(x >= limit)
    while len(out):  # cycle walking: ends because x's cycle under the network holds index < n
        x[out] = _feistel(x[out], k, a, b)
        out = out[x[out] >= limit]
    return x.astype(np.int64)


def permute_each(
    index: np.ndarray,
    n: np.ndarray,
    k: np.ndarray,
    tweak: np.ndarray,
    widths: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """``perm_i[index[i]]`` where ``perm_i`` permutes ``range(n[i])``, keyed by ``k`` tweaked by
    ``tweak[i]``; ``widths`` (``widths_of(n)``) when the caller keeps them per sub-permutation."""
    index = np.asarray(index, np.int64)
    n = np.asarray(n, np.int64)
    a, b = widths if widths is not None else widths_of(n)
    x = _feistel(index.astype(np.uint64), k, a, b, tweak)
    limit = n.astype(np.uint64)
    out = np.flatnonzero(x >= limit)
    while len(out):
        x[out] = _feistel(x[out], k, a[out], b[out], tweak[out])
        out = out[x[out] >= limit[out]]
    return np.where(n <= 1, 0, x.astype(np.int64))
