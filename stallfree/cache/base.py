"""The one protocol every cache tier speaks, its keys, and the shared bookkeeping.

Tiers store *encoded* bytes (``codec.py``) so that sizes are exact, values are immutable once
cached, and a tier can hand bytes to another tier without decoding them (``TieredCache``).
``BaseCache`` turns the two raw primitives a tier implements into the public protocol: it encodes
and decodes, counts hits, misses, bytes and latency, deletes entries that fail to decode, and makes
sure that no failure of a tier ever reaches the caller as an exception: a broken tier is a miss.

Every entry carries its identity (``codec.Identity``: fingerprint, index, stage, sample key) and a
lookup serves it only under that same key: without a signing secret, a genuine entry copied under
another sample's key was served (one epoch delivered key ``00000`` 20 times and lost 19 samples).
Entries are bounded by ``max_entry_bytes`` (``MAX_ENTRY_BYTES`` by default) on the way in and,
before any decoding, on the way out: a 120 MB value planted in a shared store had been decoded and
handed on (worker RSS 498 -> 1,579 MB).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from stallfree.cache import codec
from stallfree.cache.policy import Policy, get_policy

log = logging.getLogger(__name__)

Value = dict[str, Any] | bytes | np.ndarray
Check = Callable[["CacheKey", Any], None]  # raises codec.CodecError when a decoded entry is unfit

_MAX_KEY_BYTES = 400  # LMDB's key limit is 511; longer keys are hashed
# The default bound on one encoded entry: 64 MiB is ~400 ImageNet JPEGs (~110 KB) or a 4096x4096
# RGB uint8 image; video clips or large float tensors need a larger max_entry_bytes.
MAX_ENTRY_BYTES = 64 << 20
_LOGGED_MISMATCHES = 5  # per cache object; the rest are counted under ``mismatched``


class CacheKey(NamedTuple):
    """(dataset fingerprint, global sample index, stage) - ``stage`` is ``raw`` or a decoded form."""

    fingerprint: str
    index: int
    stage: str

    def to_bytes(self) -> bytes:
        """Stable byte form used as the key in every store (same on every process and node)."""
        raw = f"sf/{self.fingerprint}/{self.stage}/{int(self.index)}".encode()
        if len(raw) <= _MAX_KEY_BYTES:
            return raw
        return b"sf/h/" + hashlib.blake2b(raw, digest_size=20).hexdigest().encode()

    def identity(self, value: Any) -> codec.Identity:
        """What an entry for this key holding ``value`` says it is (``value``'s ``__key__``, if any)."""
        return codec.Identity(self.fingerprint, int(self.index), self.stage, sample_key(value))


def sample_key(value: Any) -> str | None:
    """A sample dict's ``__key__`` when it is a str; None for anything else."""
    key = value.get("__key__") if isinstance(value, dict) else None
    return key if isinstance(key, str) else None


def check_identity(key: CacheKey, entry: codec.Entry) -> None:
    """``codec.UnexpectedEntry`` unless ``entry`` says it is ``key``'s and its value agrees."""
    ident = entry.identity
    if ident is None:
        raise codec.UnexpectedEntry("the entry says nothing of what it holds (no identity)")
    if (ident.fingerprint, ident.index, ident.stage) != (key.fingerprint, int(key.index), key.stage):
        raise codec.UnexpectedEntry(
            f"the entry holds sample {ident.index} ({ident.stage}) of dataset {ident.fingerprint}, "
            f"not sample {key.index} ({key.stage}) of {key.fingerprint}"
        )
    if ident.key != sample_key(entry.value):
        raise codec.UnexpectedEntry(
            f"the entry says it holds sample {ident.key!r}, its value is {sample_key(entry.value)!r}"
        )


@runtime_checkable
class Cache(Protocol):
    """A sample cache tier. Lookups and stores never raise: a dead or slow tier answers misses.

    ``check(key, value)``, when given, vets every decoded entry; one it rejects (by raising
    ``codec.CodecError``) is a miss and is deleted, as a corrupt entry is."""

    def get_many(self, keys: Sequence[CacheKey], check: Check | None = None) -> list[Value | None]: ...

    def put_many(self, items: Sequence[tuple[CacheKey, Value]]) -> None: ...

    def contains(self, key: CacheKey) -> bool: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class PutResult(NamedTuple):
    """What a tier did with one ``put`` batch: stored ``admitted`` entries (``nbytes`` in all) and
    turned ``rejected`` away for lack of room (entries already present count as neither)."""

    admitted: int = 0
    nbytes: int = 0
    rejected: int = 0


class CacheStats:
    """Thread-safe counters of one cache object in one process (stats are per process)."""

    FIELDS = (
        "hits",
        "misses",
        "puts",
        "admitted",
        "rejected",
        "bytes_in",
        "bytes_out",
        "evictions",
        "errors",
        "corrupt",  # entries dropped on lookup: damaged, or not the sample asked for
        "mismatched",  # of those, intact entries of another sample, dataset or stage (or shape)
        "oversized",  # entries over max_entry_bytes, refused on put or dropped on lookup
        "get_calls",
        "put_calls",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c = dict.fromkeys(self.FIELDS, 0)
        self._get_s = 0.0
        self._put_s = 0.0

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._c[name] += n

    def add_time(self, *, get_s: float = 0.0, put_s: float = 0.0) -> None:
        with self._lock:
            self._get_s += get_s
            self._put_s += put_s

    def __getitem__(self, name: str) -> int:
        return self._c[name]

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._c)
            get_s, put_s = self._get_s, self._put_s
        lookups = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / lookups if lookups else 0.0
        out["get_seconds"] = get_s
        out["put_seconds"] = put_s
        out["get_latency_ms"] = 1000.0 * get_s / out["get_calls"] if out["get_calls"] else 0.0
        out["put_latency_ms"] = 1000.0 * put_s / out["put_calls"] if out["put_calls"] else 0.0
        return out


class BaseCache:
    """Shared plumbing: subclasses implement the raw byte primitives below.

    ``_get_raw(keys) -> list[bytes | None]``, ``_put_raw(items) -> PutResult``,
    ``_delete_raw(keys)``, ``_contains_raw(key)``, ``_close()``, and ``_tier_stats() -> dict``.
    Any exception from a primitive is logged, counted under ``errors`` and turned into misses.
    Pickling keeps only the configuration returned by ``_config()``; connections reopen lazily.
    """

    name = "cache"
    max_entry_bytes = MAX_ENTRY_BYTES

    def __init__(self) -> None:
        self._stats = CacheStats()
        self._mismatches_logged = 0

    def _set_budget(
        self, capacity_bytes: int | None, policy: str | Policy, max_entry_bytes: int = MAX_ENTRY_BYTES
    ) -> None:
        """Check and keep what a bounded tier holds (encoded bytes; ``None``: no bound), what it
        does when full, and the most one encoded entry may take."""
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if not isinstance(max_entry_bytes, int) or isinstance(max_entry_bytes, bool) or max_entry_bytes <= 0:
            raise ValueError(f"max_entry_bytes must be a positive integer, got {max_entry_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.policy = get_policy(policy)
        self.max_entry_bytes = max_entry_bytes

    @property
    def limits(self) -> codec.Limits:
        """What the codec may accept from this tier: nothing over ``max_entry_bytes``."""
        return codec.Limits(max_entry_bytes=self.max_entry_bytes - codec.HEADER_SIZE)

    # -- the raw primitives a tier implements -------------------------------------------------
    def _get_raw(self, keys: Sequence[bytes]) -> list[bytes | None]:
        raise NotImplementedError

    def _put_raw(self, items: Sequence[tuple[bytes, bytes]]) -> PutResult:
        raise NotImplementedError

    def _delete_raw(self, keys: Sequence[bytes]) -> None:
        raise NotImplementedError

    def _contains_raw(self, key: bytes) -> bool:
        return self._get_raw([key])[0] is not None

    def _close(self) -> None:
        return None

    def _tier_stats(self) -> dict[str, Any]:
        return {}

    def _config(self) -> dict[str, Any]:
        raise NotImplementedError

    # -- the public protocol -----------------------------------------------------------------
    def get_many(self, keys: Sequence[CacheKey], check: Check | None = None) -> list[Value | None]:
        kbytes = [k.to_bytes() for k in keys]
        raw = self.get_encoded_many(kbytes)
        out: list[Value | None] = []
        bad: list[bytes] = []
        mismatched = 0
        limits = self.limits
        for key, kb, blob in zip(keys, kbytes, raw, strict=True):
            if blob is None:
                out.append(None)
                continue
            try:
                entry = codec.decode_entry(blob, limits)
                if check is not None:
                    check(key, entry.value)
                check_identity(key, entry)
                out.append(entry.value)
            except codec.UnexpectedEntry as exc:
                mismatched += 1
                self._log_mismatch(key, exc)
                bad.append(kb)
                out.append(None)
            except codec.CodecError as exc:
                log.warning("%s: dropping corrupt entry %s: %s", self.name, key, exc)
                bad.append(kb)
                out.append(None)
        if bad:
            # they were counted as hits by get_encoded_many; they are misses
            self._stats.add(corrupt=len(bad), mismatched=mismatched, hits=-len(bad), misses=len(bad))
            self.delete_encoded_many(bad)
        return out

    def _log_mismatch(self, key: CacheKey, exc: codec.CodecError) -> None:
        """The first few entries that are not the sample asked for are logged, the rest counted:
        a stale shared store (a dataset changed in place, another program's entries) can hold
        millions of them."""
        if self._mismatches_logged >= _LOGGED_MISMATCHES:
            return
        self._mismatches_logged += 1
        last = self._mismatches_logged == _LOGGED_MISMATCHES
        more = " (further ones only counted in stats()['mismatched'])" if last else ""
        log.warning(
            "%s: dropping an entry that is not the one asked for, %s: %s%s", self.name, key, exc, more
        )

    def put_many(self, items: Sequence[tuple[CacheKey, Value]]) -> None:
        encoded: list[tuple[bytes, bytes]] = []
        limits = self.limits
        for key, value in items:
            try:
                encoded.append((key.to_bytes(), codec.encode(value, limits, key.identity(value))))
            except codec.EntryTooLarge as exc:
                if not self._stats["oversized"]:
                    log.warning(
                        "%s: not caching %s, over max_entry_bytes=%d (further ones only counted): %s",
                        self.name,
                        key,
                        self.max_entry_bytes,
                        exc,
                    )
                self._stats.add(oversized=1)
            except codec.CodecError as exc:
                if not self._stats["errors"]:  # once per cache object; the rest are counted
                    log.warning("%s: cannot cache %s (further ones only counted): %s", self.name, key, exc)
                self._stats.add(errors=1)
        self.put_encoded_many(encoded)

    def contains(self, key: CacheKey) -> bool:
        try:
            return bool(self._contains_raw(key.to_bytes()))
        except Exception as exc:  # a broken tier is a miss, never a crash
            self._failed("contains", exc)
            return False

    def stats(self) -> dict[str, Any]:
        out = self._stats.as_dict()
        out["tier"] = self.name
        try:
            extra = self._tier_stats()
        except Exception as exc:
            self._failed("stats", exc)
            extra = {}
        for k, v in extra.items():
            if k in CacheStats.FIELDS and isinstance(v, int) and not isinstance(v, bool):
                out[k] += v
            else:
                out[k] = v
        return out

    def close(self) -> None:
        try:
            self._close()
        except Exception as exc:
            self._failed("close", exc)

    # -- encoded access, used by TieredCache to move bytes between tiers ----------------------
    def get_encoded_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Stored blobs for ``keys`` (None: a miss); one over ``max_entry_bytes`` is a miss and is
        deleted, before anything decodes it."""
        t0 = time.perf_counter()
        try:
            raw = list(self._get_raw(keys))
            if len(raw) != len(keys):
                raise RuntimeError(f"tier answered {len(raw)} values for {len(keys)} keys")
        except Exception as exc:
            self._failed("get", exc)
            raw = [None] * len(keys)
        cap = self.max_entry_bytes
        big = [p for p, b in enumerate(raw) if b is not None and len(b) > cap]
        if big:
            if not self._stats["oversized"]:
                log.warning(
                    "%s: dropping %d entries over max_entry_bytes=%d (the largest %d bytes; further ones "
                    "only counted)",
                    self.name,
                    len(big),
                    cap,
                    max(len(raw[p]) for p in big),  # type: ignore[arg-type]
                )
            self._stats.add(oversized=len(big))
            for p in big:
                raw[p] = None
            self.delete_encoded_many([keys[p] for p in big])
        hits = sum(b is not None for b in raw)
        self._stats.add(
            hits=hits,
            misses=len(keys) - hits,
            bytes_out=sum(len(b) for b in raw if b is not None),
            get_calls=1,
        )
        self._stats.add_time(get_s=time.perf_counter() - t0)
        return raw

    def put_encoded_many(self, items: Sequence[tuple[bytes, bytes]]) -> PutResult:
        """Store encoded entries; those over ``max_entry_bytes`` are refused (counted ``oversized``)."""
        cap = self.max_entry_bytes
        if any(len(blob) > cap for _, blob in items):
            kept = [(k, b) for k, b in items if len(b) <= cap]
            self._stats.add(oversized=len(items) - len(kept))
            items = kept
        if not items:
            return PutResult()
        t0 = time.perf_counter()
        try:
            result = PutResult(*self._put_raw(items))
        except Exception as exc:
            self._failed("put", exc)
            result = PutResult()
        self._stats.add(
            puts=len(items),
            put_calls=1,
            admitted=result.admitted,
            bytes_in=result.nbytes,
            rejected=result.rejected,
        )
        self._stats.add_time(put_s=time.perf_counter() - t0)
        return result

    def delete_encoded_many(self, keys: Sequence[bytes]) -> None:
        try:
            self._delete_raw(keys)
        except Exception as exc:
            self._failed("delete", exc)

    def _failed(self, op: str, exc: BaseException) -> None:
        self._stats.add(errors=1)
        log.warning("%s: %s failed, treating as miss: %s: %s", self.name, op, type(exc).__name__, exc)

    # -- pickling: configuration only ----------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return self._config()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
