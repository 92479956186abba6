"""``mix(datasets, weights)``: one map-style dataset over several, whose positions ``0..N-1`` are
already interleaved in the weights' shares, so a loader must read them in order (``ordered``).

Position ``i`` of epoch ``e`` maps to (source, index) in O(1): the schedule (``schedule.py``,
independent of seed and epoch; laid out for short epochs, a function of position in O(sources)
memory for long ones) gives the source and the occurrence number ``j`` of that source so far;
``j // len(source)`` is the cycle through the source, and a fresh seeded permutation per
(seed, epoch, source, cycle) (``permute.py``) picks the sample. Each sample of a source appears
``floor`` or ``ceil`` of ``quota / len`` times per epoch. Everything is a pure function of
(seed, epoch, position): world size and worker count play no part.

With a weight schedule (weights.py) the source of a position comes from ``staged.py`` instead,
keyed on the global position ``epoch * samples_per_epoch + position``, and occurrence numbers
count from the start of training: a source's cycles (and their permutations, keyed by seed,
source and cycle) run across epochs, so changing weights never re-reads a source early.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from stallfree.mix import collate as collate_mod
from stallfree.mix import permute as perm_mod
from stallfree.mix import schedule as sched_mod
from stallfree.mix.collate import collate_by_source
from stallfree.mix.staged import Staged
from stallfree.mix.weights import Schedule

__all__ = ["Mixture", "MixtureMismatch", "Ordered", "collate_by_source", "mix"]

STATE_FORMAT = "stallfree.mix.state"
STATE_VERSION = 1
_ACROSS_EPOCHS = -1  # the epoch slot of a scheduled mixture's permutation keys (cycles span epochs)


@runtime_checkable
class Ordered(Protocol):
    """A dataset that defines its own epoch order: read positions ``0..len-1`` in sequence (split
    over ranks by position), after ``set_epoch(epoch)``. Shuffling it would undo its order."""

    ordered: bool

    def set_epoch(self, epoch: int) -> None: ...

    def __len__(self) -> int: ...


class MixtureMismatch(ValueError):
    """A saved mixture state does not describe this mixture (weights, lengths, seed or size)."""


class Mixture:
    """See the module docstring; build with ``mix``."""

    ordered = True

    def __init__(
        self,
        datasets: Mapping[str, Any],
        weights: Mapping[str, float] | Schedule,
        *,
        samples_per_epoch: int | None = None,
        seed: int = 0,
        decode: Mapping[str, Any] | None = None,
    ) -> None:
        if not datasets:
            raise ValueError("mix() needs at least one dataset")
        self.schedule: Schedule | None = weights if isinstance(weights, Schedule) else None
        if self.schedule is not None:
            weights = self.schedule.layout(sorted(datasets)).shares_at(0)
        if set(datasets) != set(weights):
            raise ValueError(
                f"datasets and weights must name the same sources: datasets {sorted(datasets)}, "
                f"weights {sorted(weights)}"
            )
        self.names = sorted(datasets)  # source numbers follow sorted names, not dict order
        self.datasets = {n: datasets[n] for n in self.names}
        self.weights = {n: float(weights[n]) for n in self.names}
        for n, w in self.weights.items():
            if not math.isfinite(w) or w < 0:
                raise ValueError(f"weight of {n!r} must be a finite number >= 0, got {weights[n]!r}")
        self.decode = dict(decode or {})
        unknown = sorted(set(self.decode) - set(self.names))
        if unknown:
            raise ValueError(f"decode= names sources {unknown} that are not in the mixture {self.names}")
        for n, dec in self.decode.items():
            if not (hasattr(dec, "decode_batch") or callable(dec)):
                raise TypeError(
                    f"decode[{n!r}] must have decode_batch or be callable, got {type(dec).__name__}"
                )
            if hasattr(dec, "bind_dataset"):  # e.g. ImageDecode: labels from this source's manifest
                dec.bind_dataset(self.datasets[n])
            if hasattr(dec, "runs_in_workers") and not dec.runs_in_workers:
                raise ValueError(
                    f"decode[{n!r}] cannot run in the loader's worker processes, where a mixture's "
                    "per-source decode runs (e.g. ImageDecode on DALI): give it backend='cpu', or "
                    "decode whole batches with DataLoader(decode=...)"
                )
        self.lengths = {n: len(ds) for n, ds in self.datasets.items()}
        self._staged: Staged | None = None
        if self.schedule is not None:
            self._staged = Staged(self.schedule.layout(self.names))
            ever = self._staged.segments.weights.max(axis=0)  # any weight > 0 anywhere in the schedule
            self.weights = {n: float(w) for n, w in zip(self.names, ever, strict=True)}
        empty = [n for n in self.names if self.weights[n] > 0 and self.lengths[n] == 0]
        if empty:
            raise ValueError(f"sources {empty} have weight > 0 but no samples")
        total = sum(self.lengths.values()) if samples_per_epoch is None else samples_per_epoch
        if not isinstance(total, int) or isinstance(total, bool) or total < 0:
            raise ValueError(f"samples_per_epoch must be a non-negative integer, got {samples_per_epoch!r}")
        self.samples_per_epoch = total
        self.seed = int(seed)
        self.epoch = 0
        if self._staged is None:
            counts = sched_mod.quotas(total, [self.weights[n] for n in self.names])
            self.quotas = {n: int(c) for n, c in zip(self.names, counts, strict=True)}
            self._schedule = sched_mod.make(counts)  # laid out when short, a function of position when long
        else:
            self.quotas = self._epoch_counts(0)
        self._lens = np.array([self.lengths[n] for n in self.names], np.int64)
        self._salt = [zlib.crc32(n.encode()) for n in self.names]  # adding a source keeps the others' order
        self._keys: dict[tuple[int, int, int], np.ndarray] = {}

    # -- order ----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Positions map to this epoch's samples from now on (call in every process that reads)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.samples_per_epoch

    def _positions(self, indices: Any) -> np.ndarray:
        idx = np.asarray(indices, np.int64).reshape(-1)
        n = self.samples_per_epoch
        idx = np.where(idx < 0, idx + n, idx)
        if len(idx) and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"position out of range for a mixture of {n} samples per epoch")
        return idx

    def _round_keys(self, epoch: int, s: int, cycle: int) -> np.ndarray:
        key = (epoch, s, cycle)
        k = self._keys.get(key)
        if k is None:
            if len(self._keys) > 4096:
                self._keys.clear()
            k = self._keys[key] = perm_mod.keys(self.seed, epoch, self._salt[s], cycle)
        return k

    def locate_many(self, indices: Any, epoch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(source numbers into ``names``, sample indices in those sources) for positions."""
        e = self.epoch if epoch is None else int(epoch)
        pos = self._positions(indices)
        if self._staged is None:
            src, occ = self._schedule.locate(pos)
        else:  # global occurrences: cycles run across epochs, so the permutation key has no epoch
            src, occ = self._staged.locate(pos + e * self.samples_per_epoch)
            e = _ACROSS_EPOCHS
        lens = self._lens[src]
        cycle, off = occ // lens, occ % lens
        out = np.empty(len(pos), np.int64)
        for s, c in set(zip(src.tolist(), cycle.tolist(), strict=True)):
            sel = (src == s) & (cycle == c)
            out[sel] = perm_mod.permute(off[sel], int(self._lens[s]), self._round_keys(e, s, c))
        return src, out

    def locate(self, index: int, epoch: int | None = None) -> tuple[str, int]:
        """Position -> (source name, index in that source)."""
        src, j = self.locate_many([index], epoch)
        return self.names[int(src[0])], int(j[0])

    def key_of(self, index: int) -> str | None:
        """The key of the sample at position ``index`` in the current epoch (its source's
        ``key_of``; None where the source cannot tell without reading). The cache checks a cached
        raw sample against it, so an entry an earlier epoch left at this position (another
        sample: positions map to new samples every epoch) is refused, not served again."""
        name, j = self.locate(index)
        key_of = getattr(self.datasets[name], "key_of", None)
        return key_of(j) if key_of is not None else None

    def source_of(self, index: int) -> str:
        """The source filling ``index`` (the same in every epoch with constant weights; the
        current epoch's under a schedule)."""
        pos = self._positions([index])
        if self._staged is not None:
            return self.names[int(self._staged.locate(pos + self.epoch * self.samples_per_epoch)[0][0])]
        return self.names[int(self._schedule.locate(pos)[0][0])]

    def counts(self, start: int, stop: int, epoch: int | None = None) -> dict[str, int]:
        """Samples of each source among positions ``[start, stop)`` of ``epoch`` (default: the
        current one; for ``stats()["mix"]``)."""
        lo = min(max(0, start), self.samples_per_epoch)
        hi = min(max(lo, stop), self.samples_per_epoch)
        a, b = self._prefix(lo, epoch), self._prefix(hi, epoch)
        return {n: int(b[s] - a[s]) for s, n in enumerate(self.names)}

    def _prefix(self, position: int, epoch: int | None) -> list[int]:
        if self._staged is None:
            return self._schedule.prefix(position)
        e = self.epoch if epoch is None else int(epoch)
        return self._staged.prefix(e * self.samples_per_epoch + position)

    def _epoch_counts(self, epoch: int) -> dict[str, int]:
        return self.counts(0, self.samples_per_epoch, epoch)

    def target_shares(self, position: int, epoch: int | None = None) -> dict[str, float]:
        """The weights (normalised to sum to 1) in force at ``position`` of ``epoch``: constant,
        or the schedule's at that global position."""
        if self._staged is None:
            total = sum(self.weights.values())
            return {n: w / total for n, w in self.weights.items()}
        e = self.epoch if epoch is None else int(epoch)
        return self._staged.segments.shares_at(e * self.samples_per_epoch + int(position))

    def fractions(self, start: int, stop: int, window: int) -> dict[str, Any]:
        """What ``stats()["mix"]["fractions"]`` reports once positions ``[start, stop)`` of the
        current epoch are consumed: ``target`` (the weights in force at the last one, as
        shares), ``window`` (each source's fraction of the last ``window`` positions: a global
        batch) and ``cumulative`` (of all positions since training began), so a schedule's
        drift from its targets shows beside them."""
        e, n = self.epoch, self.samples_per_epoch
        hi = min(max(0, stop), n)
        lo = max(min(max(0, start), hi), hi - max(1, int(window)))
        recent = self.counts(lo, hi)
        if self._staged is not None:
            total = self._staged.prefix(e * n + hi)
        else:
            here = self._schedule.prefix(hi)
            total = [e * self.quotas[name] + int(here[s]) for s, name in enumerate(self.names)]
        seen = sum(total)
        return {
            "target": self.target_shares(max(hi - 1, 0)),
            "window": {name: (c / (hi - lo) if hi > lo else 0.0) for name, c in recent.items()},
            "cumulative": {name: (total[s] / seen if seen else 0.0) for s, name in enumerate(self.names)},
        }

    def window_bound(self, name: str) -> float:
        """The most ``name``'s count in any window of ``B`` positions may differ from ``B`` times
        its share (schedule.py: below 2 for epochs laid out by Tijdeman's algorithm; split.py for
        longer ones; exactly 1 with two sources either way). Under a schedule: in any window
        inside one segment of constant weights (staged.py), the largest over the segments."""
        bounds = self._schedule.window_bounds() if self._staged is None else self._staged.window_bounds()
        return bounds[self.names.index(name)]

    # -- samples --------------------------------------------------------------------------
    def __getitem__(self, index: int) -> Any:
        return self.get_many([index])[0]

    def get_many(self, indices: Sequence[int], epoch: int | None = None) -> list[Any]:
        """Samples for positions, read per source (batched where the source has ``get_many``);
        dict samples gain ``"__source__": name``."""
        src, local = self.locate_many(indices, epoch)
        out: list[Any] = [None] * len(src)
        for s in np.unique(src).tolist():
            where = np.flatnonzero(src == s)
            name, ds = self.names[s], self.datasets[self.names[s]]
            rows = local[where].tolist()
            get_many = getattr(ds, "get_many", None)
            samples = list(get_many(rows)) if get_many is not None else [ds[j] for j in rows]
            for p, sample in zip(where.tolist(), samples, strict=True):
                out[p] = {**sample, "__source__": name} if isinstance(sample, Mapping) else sample
        return out

    def collate(self, batch: Sequence[Any]) -> Any:
        """The loader's collate for this mixture when none is given (collate.py): by source, with
        the per-source decoders, when ``decode=`` was given; otherwise ``default_collate``, with a
        clear error when the batch's sources differ in their fields."""
        if self.decode:
            return collate_by_source(batch, self.decode, seed=self._decode_seed)
        return collate_mod.collate_mixed(batch)

    def collate_by_source(self, batch: Sequence[Any]) -> dict[str, Any]:
        """``stallfree.mix.collate_by_source`` with this mixture's per-source decoders."""
        return collate_by_source(batch, self.decode, seed=self._decode_seed)

    def _decode_seed(self, name: str) -> int:
        return collate_mod.source_seed(self.seed, self.epoch, name)

    # -- resume ---------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """Hex id of what fixes the order: names, weights, lengths, samples per epoch, seed."""
        body = json.dumps(self._identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:32]

    def _identity(self) -> dict[str, Any]:
        if self.schedule is not None:
            return {
                "schedule": self.schedule.describe(),
                "lengths": self.lengths,
                "samples_per_epoch": self.samples_per_epoch,
                "seed": self.seed,
            }
        return {
            "weights": self.weights,
            "lengths": self.lengths,
            "samples_per_epoch": self.samples_per_epoch,
            "seed": self.seed,
        }

    def state(self) -> dict[str, Any]:
        """Plain JSON-safe description for a checkpoint (the loader saves the position)."""
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            **self._identity(),
            "quotas": dict(self.quotas),
            "epoch": self.epoch,
            "fingerprint": self.fingerprint,
        }

    def check_state(self, state: Mapping[str, Any], *, allow_reweight: bool = False) -> None:
        """Refuse to resume from ``state`` saved for a different mixture. ``allow_reweight=True``
        accepts other weights or samples per epoch (same sources, lengths and seed): the explicit
        choice to continue at the saved position of the *new* order, whose earlier positions hold
        other samples than the ones actually consumed."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise MixtureMismatch("not a stallfree mixture state")
        if state.get("version") != STATE_VERSION:
            raise MixtureMismatch(f"unsupported mixture state version {state.get('version')!r}")
        if state.get("fingerprint") == self.fingerprint:
            return
        mine = self._identity()
        diff = [k for k in mine if _plain(state.get(k)) != _plain(mine[k])]
        fixed = [k for k in diff if k in ("lengths", "seed")]
        if allow_reweight and not fixed:
            return
        detail = "; ".join(f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in diff) or "fingerprint"
        hint = "" if fixed else " (pass allow_reweight=True to resume with the new weights on purpose)"
        raise MixtureMismatch(f"the saved state is for a different mixture: {detail}{hint}")

    def __repr__(self) -> str:
        if self.schedule is not None:
            names = ", ".join(f"{n}: {self.lengths[n]}" for n in self.names)
            return (
                f"Mixture({names}; {self.schedule!r}; {self.samples_per_epoch} per epoch, seed={self.seed})"
            )
        parts = ", ".join(f"{n}: {self.quotas[n]}/{self.lengths[n]}" for n in self.names)
        return f"Mixture({parts}; {self.samples_per_epoch} per epoch, seed={self.seed})"


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True))


def mix(
    datasets: Mapping[str, Any],
    weights: Mapping[str, float] | Schedule,
    *,
    samples_per_epoch: int | None = None,
    seed: int = 0,
    decode: Mapping[str, Any] | None = None,
) -> Mixture:
    """A map-style dataset mixing ``datasets`` (name -> any map-style dataset) in ``weights``'
    shares (relative; ``samples_per_epoch`` defaults to the sources' total length). Read its
    positions in order (``shuffle=False``); dict samples gain ``"__source__": name``.

    ``weights`` may be a schedule keyed on the global sample position (``epoch *
    samples_per_epoch + position``): ``stallfree.mix.stages``, ``linear``, ``cosine`` or
    ``from_function`` (weights.py); the same on any world size, resumed exactly anywhere.

    ``decode``: name -> decoder for that source only (``ImageDecode(..., backend="cpu")`` or a
    per-sample callable); the loader then batches by source (collate.py):
    ``batch["images"]["image"]``, ``batch["tokens"]["input_ids"]``, ``batch["__source__"]``.

    >>> ds = stallfree.mix({"web": web, "code": code}, {"web": 0.7, "code": 0.3}, seed=1)
    >>> loader = stallfree.DataLoader(ds, batch_size=16, shuffle=False)
    """
    return Mixture(datasets, weights, samples_per_epoch=samples_per_epoch, seed=seed, decode=decode)
