"""Epoch order as a pure function of (seed, epoch, dataset length), and each rank's slice of it.

An order is a function, never an array: ``order.at(positions)`` gives the sample indices at
those positions of the epoch (a keyed bijection of ``range(n)``, mix/permute.py), so an epoch of
10^9 samples costs its keys (O(1) memory; O(shards) for block order) and each batch's indices
are computed when the batch is dispatched. The arrays the functions below return are the same
orders materialised, for tests and small datasets.

The global order never depends on the world size: rank ``r`` of ``W`` takes positions
``r, r+W, r+2W, ...`` of what is left of the epoch. After every rank has received ``k`` samples
(ranks run in lockstep), exactly the first ``k*W`` remaining positions are consumed, so a job can
stop anywhere and resume on any number of ranks with nothing lost or repeated.

Uneven tails follow ``DistributedSampler``: ``"pad"`` repeats the epoch's first positions (cycled
when the epoch is shorter than the padding) so all ranks get the same count (a few samples are
seen twice in that epoch) — the epoch's, not the resume point's, so a resume on the same world
size receives exactly the padding an uninterrupted run would, ``"drop"`` leaves out the
last ``len % W`` positions (a few samples are skipped in that epoch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from stallfree.mix import permute as perm

UNEVEN = ("pad", "drop")
CHUNK = 1 << 15  # positions computed per call when walking a share: numpy's per-call cost amortised


@runtime_checkable
class Order(Protocol):
    """An epoch order: ``at(positions)`` -> sample indices, a bijection of ``range(n)``."""

    n: int

    def at(self, positions: np.ndarray) -> np.ndarray: ...


def _positions(positions: np.ndarray | Sequence[int], n: int) -> np.ndarray:
    pos = np.asarray(positions, np.int64).reshape(-1)
    if len(pos) and (pos.min() < 0 or pos.max() >= n):
        raise IndexError(f"order position out of range for an epoch of {n} samples")
    return pos


@dataclass(frozen=True)
class Sequential:
    """Positions are the indices."""

    n: int

    def at(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        return _positions(positions, self.n).copy()


@dataclass(frozen=True)
class Shuffled:
    """A keyed pseudo-random permutation of ``range(n)`` (Feistel network, cycle walking),
    keyed by (seed, epoch): position ``p`` maps to its index on its own."""

    seed: int
    epoch: int
    n: int
    _keys: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_keys", perm.keys(self.seed, self.epoch, 0))

    def at(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        return perm.permute(_positions(positions, self.n), self.n, self._keys)


@dataclass(frozen=True)
class Blocked:
    """Shards in a keyed order; inside each run of consecutive shards of that order (a window),
    the run's samples in a keyed order of their own. Readers of a remote object store then touch
    only a window of shards at a time (whole-shard reads, a warm cache) while the order stays
    random enough for SGD. Memory: a few int64 per shard.

    Windows hold ``window`` shards, except the epoch's first, which holds ``first`` (None: a
    full window). The loader asks for ``ramp_of(window)`` (a quarter) where its workers stage
    windows whole: a reader that fetches windows whole waits for the first one before its first
    batch, so a quarter of the bytes there is a quarter of the wait (measured: RESULTS.md,
    Object storage), while every later window is full. Elsewhere a short first window only
    costs (its batches mix fewer shards; ranks reading ranges coalesce over each other's samples:
    1.26x the bytes from storage in tests/netlab's 4-node job, 1.04x without). After a short
    first window, a last window shorter than it is merged into the one before, so no window
    mixes fewer shards than the first. ``order_identity`` names the layout: a resume state
    records it, and a loader refuses a state saved under another."""

    seed: int
    epoch: int
    shard_sizes: tuple[int, ...]
    window: int = 8
    first: int | None = None
    n: int = field(init=False)
    _perm: np.ndarray = field(init=False, repr=False, compare=False)  # k-th shard of the order
    _starts: np.ndarray = field(init=False, repr=False, compare=False)  # first index of each shard
    _pstarts: np.ndarray = field(init=False, repr=False, compare=False)  # k-th shard's first position
    _wshards: np.ndarray = field(init=False, repr=False, compare=False)  # window w's first k (and the end)
    _wstarts: np.ndarray = field(init=False, repr=False, compare=False)  # window w's first position
    _keys: np.ndarray = field(init=False, repr=False, compare=False)  # the windows' round keys
    _tweak: np.ndarray = field(init=False, repr=False, compare=False)  # window w's tweak of them
    _wsize: np.ndarray = field(init=False, repr=False, compare=False)  # window w's samples
    _wbits: tuple[np.ndarray, np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.window < 1 or (self.first is not None and self.first < 1):
            raise ValueError(f"window and first must be >= 1, got {self.window}, {self.first}")
        sizes = np.asarray(self.shard_sizes, np.int64).reshape(-1)
        if len(sizes) and sizes.min() < 0:
            raise ValueError("shard sizes must be >= 0")
        s = len(sizes)
        shard_perm = perm.permute(np.arange(s), s, perm.keys(self.seed, self.epoch, 1)) if s else sizes[:0]
        pstarts = np.concatenate([[0], np.cumsum(sizes[shard_perm])])
        put = object.__setattr__
        put(self, "n", int(pstarts[-1]))
        put(self, "_perm", shard_perm)
        put(self, "_starts", np.concatenate([[0], np.cumsum(sizes)[:-1]]) if s else sizes[:0])
        put(self, "_pstarts", pstarts)
        wshards = window_bounds(s, self.window, self.first)
        wstarts = pstarts[wshards[:-1]] if s else pstarts
        wsize = np.diff(pstarts[wshards]) if s else sizes[:0]
        put(self, "_wshards", wshards)
        put(self, "_wstarts", wstarts)
        put(self, "_wsize", wsize)
        put(self, "_wbits", perm.widths_of(wsize))
        put(self, "_keys", perm.keys(self.seed, self.epoch, 2))
        put(self, "_tweak", perm.tweaks(self._keys, np.arange(len(wsize))))

    def at(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        pos = _positions(positions, self.n)
        w = np.searchsorted(self._wstarts, pos, side="right") - 1
        first = self._wstarts[w]
        bits = (self._wbits[0][w], self._wbits[1][w])
        g = first + perm.permute_each(pos - first, self._wsize[w], self._keys, self._tweak[w], bits)
        k = np.searchsorted(self._pstarts, g, side="right") - 1  # 'right': skips empty shards
        return self._starts[self._perm[k]] + (g - self._pstarts[k])

    @property
    def windows(self) -> int:
        """How many windows the epoch has."""
        return len(self._wsize)

    def window_of(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """The window each epoch position lies in (windows are runs of positions)."""
        return np.searchsorted(self._wstarts, _positions(positions, self.n), side="right") - 1

    def window_shards(self, w: int) -> np.ndarray:
        """The shards (dataset numbering) window ``w`` reads, in the order's order: what a
        reader of an object store fetches whole, and stages ahead while window ``w - 1`` is read."""
        if not 0 <= w < self.windows:
            raise IndexError(f"window {w} outside the epoch's {self.windows}")
        return self._perm[self._wshards[w] : self._wshards[w + 1]].copy()


# an order's layout revision, in its identity: bump its entry when the same request maps to
# other positions (a state saved under the old layout is then refused mid-epoch, not misread)
REVISION: dict[str, int] = {}


def ramp_of(window: int) -> int:
    """Shards in an epoch's first window: a quarter of a window (at least one)."""
    return max(1, window // 4)


def window_bounds(shards: int, window: int, first: int | None = None) -> np.ndarray:
    """Where each window starts in the shard order, and the end: ``[0, first, first + window,
    ..., shards]``; with a short ``first``, a last window shorter than it is merged into the one
    before. ``first`` None: full windows, the last one what is left."""
    if shards <= 0:
        return np.zeros(1, np.int64)
    lead = min(window if first is None else first, shards)
    bounds = [0, *range(lead, shards, window), shards]
    if first is not None and len(bounds) > 2 and bounds[-1] - bounds[-2] < lead:
        del bounds[-2]
    return np.asarray(bounds, np.int64)


def order_identity(mode: str, window: int, first_window: int | None = None) -> str:
    """What names an order's layout for a given seed: the name, its revision, and the window
    (and a short first one) for orders that use them. A resume state records it, so a state is
    never continued on another layout (other positions hold other samples: some would be
    skipped, others repeated)."""
    rev = REVISION.get(mode, 1)
    if mode in ("global", "sequential"):
        return f"{mode}/r{rev}"
    short = f"/first={first_window}" if first_window is not None and first_window != window else ""
    return f"{mode}/r{rev}/window={window}{short}"


@dataclass(frozen=True)
class Explicit:
    """An order given as an array (a caller's own, or a materialised one)."""

    array: np.ndarray

    @property
    def n(self) -> int:
        return len(self.array)

    def at(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        return np.asarray(self.array, np.int64)[_positions(positions, self.n)]


def materialise(order: Order) -> np.ndarray:
    return order.at(np.arange(order.n, dtype=np.int64)).astype(np.int64)


@dataclass(frozen=True)
class OrderRequest:
    """What an order factory is given: the epoch's key and the dataset's shape."""

    seed: int
    epoch: int
    n: int
    shard_sizes: tuple[int, ...] | None = None  # the dataset's shard sizes, when it has shards
    window: int = 8  # shards per window (the ``window=`` loader option)
    first_window: int | None = None  # shards in the epoch's first window (None: ``window``)


OrderFactory = Callable[[OrderRequest], Order]

# name -> factory: ``order=`` is checked against (LoaderOptions) and built from (make_order) this
# one table, so a new order is one file with one ``register_order`` line; the built-ins are below.
_ORDERS: dict[str, OrderFactory] = {}


def register_order(name: str, factory: OrderFactory, *, replace: bool = False) -> None:
    """Make ``order=name`` build its epoch order with ``factory(OrderRequest) -> Order``.

    The factory must be a pure function of the request (the same request, the same bijection of
    ``range(n)``): exact resume on any world size rests on that. Orders are built in the main
    process only, so a factory need not be importable by the workers."""
    if not name or name == "auto":
        raise ValueError(f"an order needs a name other than 'auto', got {name!r}")
    if name in _ORDERS and not replace:
        raise ValueError(f"order {name!r} is already registered (pass replace=True to redefine it)")
    _ORDERS[name] = factory


def unregister_order(name: str) -> None:
    """Forget a registered order (tests that register a toy one)."""
    _ORDERS.pop(name, None)


def order_names() -> tuple[str, ...]:
    """The registered order names, in registration order."""
    return tuple(_ORDERS)


def _block(req: OrderRequest) -> Order:
    if req.shard_sizes is None:
        raise ValueError("block order needs the dataset's shard_sizes")
    if sum(req.shard_sizes) != req.n:
        raise ValueError(f"shard_sizes sum to {sum(req.shard_sizes)} but the dataset has {req.n} samples")
    return Blocked(req.seed, req.epoch, req.shard_sizes, req.window, req.first_window)


register_order("global", lambda req: Shuffled(req.seed, req.epoch, req.n))
register_order("block", _block)
register_order("sequential", lambda req: Sequential(req.n))


def make_order(
    seed: int,
    epoch: int,
    n: int,
    *,
    mode: str = "global",
    shard_sizes: Sequence[int] | None = None,
    window: int = 8,
    first_window: int | None = None,
) -> Order:
    """The epoch's order as a function; ``mode`` names a registered order (``order_names()``)."""
    factory = _ORDERS.get(mode)
    if factory is None:
        raise ValueError(f"order must be one of {order_names()}, got {mode!r}")
    # a list or tuple is taken as it is (ints: a dataset's shard_sizes): a per-element int() over
    # 200,000 shards cost 60 ms a call, more than the rest of a samples_at lookup
    if shard_sizes is None:
        sizes = None
    elif isinstance(shard_sizes, (list, tuple)):
        sizes = tuple(shard_sizes)
    else:
        sizes = tuple(np.asarray(shard_sizes, np.int64).reshape(-1).tolist())
    order = factory(OrderRequest(int(seed), int(epoch), int(n), sizes, int(window), first_window))
    if order.n != n:
        raise ValueError(f"order {mode!r} covers {order.n} positions, the dataset has {n} samples")
    return order


def global_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """A full permutation of ``range(n)`` (``Shuffled`` materialised)."""
    return materialise(Shuffled(int(seed), int(epoch), int(n)))


def block_order(seed: int, epoch: int, shard_sizes: Sequence[int], window: int = 8) -> np.ndarray:
    """``Blocked`` materialised: shards shuffled, samples shuffled inside runs of ``window`` shards."""
    return materialise(Blocked(int(seed), int(epoch), tuple(int(s) for s in shard_sizes), window))


def epoch_order(
    seed: int,
    epoch: int,
    n: int,
    *,
    mode: str = "global",
    shard_sizes: Sequence[int] | None = None,
    window: int = 8,
) -> np.ndarray:
    """The epoch's global order of sample indices, materialised (see ``make_order``)."""
    return materialise(make_order(seed, epoch, n, mode=mode, shard_sizes=shard_sizes, window=window))


@dataclass(frozen=True)
class Kept:
    """The positions of an epoch of ``n`` left after skipping ``skipped`` (sorted, disjoint
    ``(lo, hi)`` ranges: known-bad steps a resume jumps over), numbered ``0..len-1`` in order:
    ``pos(k)`` is the ``k``-th kept position, ``index(p)`` how many kept positions lie before
    ``p``. With nothing skipped both are the identity, so a share without skips is unchanged."""

    n: int
    skipped: tuple[tuple[int, int], ...] = ()
    _kstarts: np.ndarray = field(init=False, repr=False, compare=False)  # kept index where range i starts
    _before: np.ndarray = field(init=False, repr=False, compare=False)  # skipped positions before range i
    _los: np.ndarray = field(init=False, repr=False, compare=False)
    _his: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ranges = merge_ranges(self.skipped, self.n)
        object.__setattr__(self, "skipped", ranges)
        lo = np.array([a for a, _ in ranges], np.int64)
        hi = np.array([b for _, b in ranges], np.int64)
        lengths = hi - lo
        before = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        object.__setattr__(self, "_los", lo)
        object.__setattr__(self, "_his", hi)
        object.__setattr__(self, "_before", before)
        object.__setattr__(self, "_kstarts", lo - before[:-1])

    def __len__(self) -> int:
        return self.n - int(self._before[-1])

    def pos(self, k: np.ndarray) -> np.ndarray:
        """The ``k``-th kept positions (vectorised)."""
        k = np.asarray(k, np.int64)
        if not self.skipped:
            return k
        return k + self._before[np.searchsorted(self._kstarts, k, side="right")]

    def index(self, position: int) -> int:
        """Kept positions before ``position`` (a skipped position counts as its range's end)."""
        p = int(position)
        if not self.skipped:
            return p
        i = int(np.searchsorted(self._los, p, side="right"))  # ranges starting at or before p
        if i and p < int(self._his[i - 1]):
            p = int(self._his[i - 1])
        return p - int(self._before[i])

    def position_after(self, k: int) -> int:
        """The position a consumer who has the first ``k`` kept positions resumes from (``n``
        once all are had): skipped ranges right after them count as consumed too."""
        return self.n if k >= len(self) else int(self.pos(np.array([k]))[0])


def merge_ranges(ranges: Sequence[tuple[int, int]], n: int) -> tuple[tuple[int, int], ...]:
    """``ranges`` clipped to ``[0, n)``, sorted, overlapping or touching ones merged, empty dropped."""
    out: list[list[int]] = []
    for lo, hi in sorted((max(0, int(a)), min(n, int(b))) for a, b in ranges):
        if hi <= lo:
            continue
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((a, b) for a, b in out)


@dataclass(frozen=True)
class RankShare:
    """What rank ``rank`` of ``world_size`` reads of ``order`` from global position ``start``,
    computed from positions, never stored.

    The remaining positions ``start..n-1``, padded (``pad``: with the epoch's positions ``0, 1, ...``
    cycled) or cut (``drop``) to a multiple of ``world_size``, form one sequence ``q``; the rank
    takes ``q[rank], q[rank + W], ...``. That sequence is one fixed function of (order, start,
    world_size), so a resume on the same world size continues it exactly, and on another world
    size starts a new split of exactly what is left."""

    order: Order
    start: int
    rank: int
    world_size: int
    uneven: str = "pad"
    skipped: tuple[tuple[int, int], ...] = ()  # position ranges left out (known-bad steps): ``Kept``
    kept: Kept = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.uneven not in UNEVEN:
            raise ValueError(f"uneven must be one of {UNEVEN}, got {self.uneven!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of size {self.world_size}")
        object.__setattr__(self, "kept", Kept(self.order.n, self.skipped))

    @property
    def begin(self) -> int:
        """Kept positions before ``start`` (``start`` itself when nothing is skipped)."""
        return self.kept.index(min(max(self.start, 0), self.order.n))

    @property
    def rest(self) -> int:
        """Positions left of the epoch from ``start`` (kept ones: skipped ranges left out)."""
        return len(self.kept) - self.begin

    def __len__(self) -> int:
        rest, w = self.rest, self.world_size
        return -(-rest // w) if self.uneven == "pad" else rest // w

    def at(self, k: np.ndarray | Sequence[int]) -> np.ndarray:
        """Sample indices of this rank's ``k``-th reads (vectorised)."""
        k = np.asarray(k, np.int64).reshape(-1)
        if len(k) and (k.min() < 0 or k.max() >= len(self)):
            raise IndexError(f"read {int(k.max())} outside this rank's share of {len(self)}")
        return self.order.at(self.positions(k))

    def positions(self, k: np.ndarray | Sequence[int]) -> np.ndarray:
        """The epoch positions of this rank's ``k``-th reads (what ``at`` maps to samples)."""
        k = np.asarray(k, np.int64).reshape(-1)
        q = self.rank + k * self.world_size
        begin = self.begin
        kept = len(self.kept)
        rest = kept - begin
        # Pad from the epoch's first positions, not the resume point's: the padded sequence is then
        # one fixed function of (order, world_size), and a resume continues it exactly.
        return self.kept.pos(np.where(q < rest, begin + q, (q - rest) % max(kept, 1)))

    def padded(self, k: np.ndarray | Sequence[int]) -> np.ndarray:
        """Whether this rank's ``k``-th reads are padding (repeats that even out the ranks)."""
        k = np.asarray(k, np.int64).reshape(-1)
        return self.rank + k * self.world_size >= self.rest

    def slice(self, lo: int, hi: int) -> np.ndarray:
        return self.at(np.arange(max(lo, 0), min(hi, len(self)), dtype=np.int64))


def remaining_for_world(
    order: np.ndarray | Order, start: int, world_size: int, uneven: str = "pad"
) -> np.ndarray:
    """Positions ``start:`` of ``order``, padded (from the epoch's start) or cut so ``world_size``
    ranks get equal counts, materialised in position order."""
    o = _as_order(order)
    shares = [RankShare(o, start, r, world_size, uneven) for r in range(world_size)]
    per = len(shares[0])
    out = np.empty(per * world_size, np.int64)
    for r, share in enumerate(shares):
        out[r::world_size] = share.slice(0, per)
    return out


def _as_order(order: np.ndarray | Order | Sequence[int]) -> Order:
    return order if isinstance(order, Order) else Explicit(np.asarray(order, np.int64))


def rank_share(
    order: np.ndarray | Order, start: int, rank: int, world_size: int, uneven: str = "pad"
) -> np.ndarray:
    """The sample indices rank ``rank`` reads this epoch, continuing from global position ``start``
    (materialised; the loader walks a ``RankShare`` batch by batch instead)."""
    share = RankShare(_as_order(order), start, rank, world_size, uneven)
    return share.slice(0, len(share))


def consumed_after(
    start: int, received_on_rank: int, world_size: int, n: int, skipped: tuple[tuple[int, int], ...] = ()
) -> int:
    """Global position reached once every rank has received ``received_on_rank`` samples
    (skipped ranges, when given, are stepped over: ``Kept``)."""
    if not skipped:
        return min(start + received_on_rank * world_size, n)
    kept = Kept(n, skipped)
    return kept.position_after(kept.index(start) + received_on_rank * world_size)


class Batches(Sequence[np.ndarray]):
    """A rank's share cut into batches (the last one short unless ``drop_last``), each computed
    when asked; iterating computes ``CHUNK`` positions at a time and slices them."""

    def __init__(self, share: RankShare | np.ndarray, batch_size: int, drop_last: bool) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.share = share if isinstance(share, RankShare) else RankShare(_as_order(share), 0, 0, 1)
        self.batch_size = batch_size
        total = len(self.share)
        self._n = total // batch_size if drop_last else -(-total // batch_size)
        self.samples = min(total, self._n * batch_size)  # what the batches hold together

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, b):  # type: ignore[override]
        if isinstance(b, slice):
            return [self[i] for i in range(*b.indices(self._n))]
        if b < 0:
            b += self._n
        if not 0 <= b < self._n:
            raise IndexError(f"batch {b} out of range ({self._n} batches)")
        return self.share.slice(b * self.batch_size, (b + 1) * self.batch_size)

    def window_shards_at(self, b: int) -> tuple[int, ...]:
        """In block order, the shards of the window batch ``b`` starts in (empty for other
        orders): what the main process stages while a fresh pool of workers starts."""
        order = self.share.order
        if not isinstance(order, Blocked) or not 0 <= b < self._n:
            return ()
        w = int(order.window_of(self.share.positions([b * self.batch_size]))[0])
        return tuple(int(s) for s in order.window_shards(w))

    def shards_after(self, b: int) -> tuple[int, ...]:
        """In block order, the shards of the window after the one batch ``b`` starts in (empty
        for the last window, and for other orders): what a worker stages while it reads ``b``."""
        order = self.share.order
        if not isinstance(order, Blocked) or not 0 <= b < self._n:
            return ()
        w = int(order.window_of(self.share.positions([b * self.batch_size]))[0]) + 1
        return tuple(int(s) for s in order.window_shards(w)) if w < order.windows else ()

    def __iter__(self) -> Iterator[np.ndarray]:
        bs = self.batch_size
        per_chunk = max(1, CHUNK // bs) * bs
        for lo in range(0, self.samples, per_chunk):
            hi = min(lo + per_chunk, self.samples)
            chunk = self.share.slice(lo, hi)
            for i in range(0, hi - lo, bs):
                yield chunk[i : i + bs]


def batches(share: RankShare | np.ndarray, batch_size: int, drop_last: bool) -> Batches:
    """Cut a rank's share into batches (the last one short unless ``drop_last``), lazily."""
    return Batches(share, batch_size, drop_last)
