"""Node tier: one LMDB store shared by every rank and worker process of a machine.

LMDB gives what this tier needs without a server: many concurrent readers with no locking,
serialized writers across processes, and atomic transactions, so a writer killed mid-batch leaves
no entry behind at all (and the codec's checksum catches anything torn below LMDB). The store is a
directory on local disk or ``/dev/shm``; it outlives worker processes, so restarted workers and the
next epoch find it warm.

Capacity is counted in encoded bytes in a small ``meta`` table updated inside the same write
transaction as the data, so all processes share one exact budget. ``lru`` keeps an access-order
index; a process records its hits and applies them to that index at its next write (reads stay
lock-free), so recency is approximate across processes.

A full filesystem (``/dev/shm`` fills up) or a read-only directory makes every operation of an
epoch fail the same way: each failure is a miss counted under ``errors``, and only the first of
each cause is logged. A read-only store still serves its entries (``lmdbenv`` opens it read-only).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections.abc import Sequence
from typing import Any

import lmdb

from stallfree.cache import lmdbenv
from stallfree.cache.base import MAX_ENTRY_BYTES, BaseCache, PutResult
from stallfree.cache.policy import Policy

log = logging.getLogger(__name__)

_U64 = struct.Struct("<Q")
_SEQ = struct.Struct(">Q")  # big-endian so LMDB's byte order is numeric order
_MAX_TOUCHED = 65536
_MAX_CAUSES = 16  # distinct failure causes logged per cache object; the rest are only counted
_DEFAULT_MAP = 1 << 36  # 64 GiB of address space when unbounded (sparse; costs nothing unused)


class NodeCache(BaseCache):
    """A cache shared by all processes of a machine, in an LMDB directory at ``path``.

    ``capacity_bytes`` bounds the encoded bytes stored (``None``: bounded only by the disk);
    ``max_entry_bytes`` the size of one entry (``base.MAX_ENTRY_BYTES``, 64 MiB, by default).
    """

    name = "node"

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int | None = None,
        policy: str | Policy = "minio",
        *,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
    ) -> None:
        super().__init__()
        self._set_budget(capacity_bytes, policy, max_entry_bytes)
        self.path = os.path.abspath(os.fspath(path))
        # B-tree pages and per-value page rounding cost space beyond the payload bytes
        self.map_size = _DEFAULT_MAP if capacity_bytes is None else int(capacity_bytes * 2) + (64 << 20)
        self._handle: lmdbenv.Handle | None = None
        self._pid = -1
        self._lock = threading.Lock()
        self._touched: dict[bytes, None] = {}
        self._warned: set[str] = set()  # causes of failures already logged by this object

    def _config(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "capacity_bytes": self.capacity_bytes,
            "policy": self.policy.name,
            "max_entry_bytes": self.max_entry_bytes,
        }

    # -- LMDB plumbing ---------------------------------------------------------------------------
    def _open_handle(self) -> lmdbenv.Handle:
        """This process's shared environment for ``path``; call inside ``lmdbenv.using()``."""
        with self._lock:
            handle = self._handle
            if handle is None or self._pid != os.getpid() or handle.generation != lmdbenv.generation():
                self._handle = handle = lmdbenv.acquire(self.path, self.map_size)
                self._pid = os.getpid()
            return handle

    def _open(self) -> tuple[lmdb.Environment, Any, Any, Any, Any]:
        """This process's environment and tables; call inside ``lmdbenv.using()``."""
        handle = self._open_handle()
        return (handle.env, *handle.dbs)

    def _close(self) -> None:
        with self._lock:
            if self._handle is not None and self._pid == os.getpid():
                lmdbenv.release(self.path, self._handle)
            self._handle = None

    @staticmethod
    def _meta(txn: Any, meta: Any, name: bytes) -> int:
        raw = txn.get(name, db=meta)
        return _U64.unpack(raw)[0] if raw is not None else 0

    # -- primitives: each holds lmdbenv.using() so a fork or map grow in another thread waits for it ----
    def _run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` inside ``lmdbenv.using()``; once more when another process had grown the store
        beyond this process's map (the failed attempt's end adopts the new size)."""
        try:
            with lmdbenv.using():
                return fn(*args)
        except lmdb.MapResizedError:
            log.info("node cache %s: the store grew in another process; adopting its map size", self.path)
            with lmdbenv.using():
                return fn(*args)

    def _failed(self, op: str, exc: BaseException) -> None:
        """Count every failure, but log only the first of each cause: a full or read-only store fails
        every operation of an epoch the same way, and one line says it all."""
        self._stats.add(errors=1)
        self._warn_once(
            f"{type(exc).__name__}: {exc}", "%s failed, treating as miss: %s: %s", op, type(exc).__name__, exc
        )

    def _warn_once(self, cause: str, msg: str, *args: Any) -> None:
        with self._lock:
            if cause in self._warned or len(self._warned) >= _MAX_CAUSES:
                return
            self._warned.add(cause)
        log.warning(
            "node cache %s: " + msg + " (further failures like this are only counted in stats())",
            self.path,
            *args,
        )

    def _get_raw(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self._run(self._get, keys)

    def _put_raw(self, items: Sequence[tuple[bytes, bytes]]) -> PutResult:
        return self._run(self._put, items)

    def _delete_raw(self, keys: Sequence[bytes]) -> None:
        self._run(self._delete, keys)

    def _contains_raw(self, key: bytes) -> bool:
        return self._run(self._contains, key)

    def _tier_stats(self) -> dict[str, Any]:
        return self._run(self._stats_inner)

    def _get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        env, data, _, _, _ = self._open()
        with env.begin(db=data) as txn:
            out = [txn.get(k) for k in keys]
        if self.policy.evicts:
            with self._lock:
                for k, v in zip(keys, out, strict=True):
                    if v is not None:
                        self._touched[k] = None
                overflow = len(self._touched) > _MAX_TOUCHED
            if overflow:
                try:
                    self._put([])
                except Exception as exc:  # the reads succeeded; only the recency update failed (and is kept)
                    self._failed("recency update", exc)
        return out

    def _put(self, items: Sequence[tuple[bytes, bytes]]) -> PutResult:
        handle = self._open_handle()
        self._check_writable(handle)
        env, (data, meta, atime, order) = handle.env, handle.dbs
        handle.check_readers()
        with self._lock:
            touched, self._touched = list(self._touched), {}
        cap = self.capacity_bytes
        admitted = nbytes = rejected = evicted = 0
        try:
            with env.begin(write=True) as txn:
                used = self._meta(txn, meta, b"used")
                seq = self._meta(txn, meta, b"seq")
                if self.policy.evicts:
                    for k in touched:
                        seq = self._stamp(txn, atime, order, k, seq, must_exist=data)
                cursor = txn.cursor(db=data)
                for key, blob in items:
                    if cursor.set_key(key):
                        continue
                    size = len(blob)
                    need = self.policy.room_needed(used, size, cap)
                    if need:
                        freed, n = self._evict(txn, data, atime, order, need)
                        used -= freed
                        evicted += n
                    if not self.policy.admits(used, size, cap):
                        rejected += 1
                        continue
                    txn.put(key, blob, db=data)
                    if self.policy.evicts:
                        seq = self._stamp(txn, atime, order, key, seq)
                    used += size
                    admitted += 1
                    nbytes += size
                txn.put(b"used", _U64.pack(used), db=meta)
                txn.put(b"seq", _U64.pack(seq), db=meta)
                if evicted:
                    txn.put(b"evictions", _U64.pack(self._meta(txn, meta, b"evictions") + evicted), db=meta)
        except lmdb.MapFullError:
            self._warn_once("map full", "LMDB map full; not admitting this batch")
            self._keep_touched(touched)
            return PutResult(0, 0, self._count_absent(env, data, items))
        except BaseException:
            self._keep_touched(touched)  # the transaction was aborted: these hits are still unrecorded
            raise
        self._stats.add(evictions=evicted)
        return PutResult(admitted, nbytes, rejected)

    def _keep_touched(self, touched: list[bytes]) -> None:
        """Put hits a failed write could not record back in front of those recorded since (they are
        older), so a failure does not make recently read entries the first to be evicted."""
        if not touched:
            return
        with self._lock:
            kept = dict.fromkeys(k for k in touched if k not in self._touched)
            kept.update(self._touched)
            if len(kept) > _MAX_TOUCHED:  # keep the most recent ones
                kept = dict.fromkeys(list(kept)[-_MAX_TOUCHED:])
            self._touched = kept

    @staticmethod
    def _count_absent(env: lmdb.Environment, data: Any, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Distinct keys of ``items`` not stored: what a batch that could not be written turned away
        (entries already present count as neither admitted nor rejected)."""
        with env.begin(db=data) as txn:
            return len({key for key, _ in items if txn.get(key) is None})

    @staticmethod
    def _stamp(txn: Any, atime: Any, order: Any, key: bytes, seq: int, must_exist: Any = None) -> int:
        """Mark ``key`` most recently used (LRU bookkeeping)."""
        if must_exist is not None and txn.get(key, db=must_exist) is None:
            return seq
        old = txn.get(key, db=atime)
        if old is not None:
            txn.delete(old, db=order)
        seq += 1
        stamp = _SEQ.pack(seq)
        txn.put(key, stamp, db=atime)
        txn.put(stamp, key, db=order)
        return seq

    @staticmethod
    def _evict(txn: Any, data: Any, atime: Any, order: Any, need: int) -> tuple[int, int]:
        """Delete least recently used entries until ``need`` bytes are free."""
        freed = n = 0
        cursor = txn.cursor(db=order)
        while freed < need and cursor.first():
            stamp, key = cursor.item()
            cursor.delete()
            txn.delete(key, db=atime)
            blob = txn.pop(key, db=data)
            if blob is not None:
                freed += len(blob)
                n += 1
        return freed, n

    def _check_writable(self, handle: lmdbenv.Handle) -> None:
        if handle.readonly:
            raise lmdbenv.ReadOnlyStore(f"the directory of {self.path} is not writable: opened read-only")

    def _delete(self, keys: Sequence[bytes]) -> None:
        handle = self._open_handle()
        self._check_writable(handle)
        env, (data, meta, atime, order) = handle.env, handle.dbs
        with env.begin(write=True) as txn:
            used = self._meta(txn, meta, b"used")
            for key in keys:
                blob = txn.pop(key, db=data)
                if blob is not None:
                    used -= len(blob)
                stamp = txn.pop(key, db=atime)
                if stamp is not None:
                    txn.delete(stamp, db=order)
            txn.put(b"used", _U64.pack(max(used, 0)), db=meta)

    def _contains(self, key: bytes) -> bool:
        env, data, _, _, _ = self._open()
        with env.begin(db=data) as txn:
            return txn.cursor().set_key(key)

    def _stats_inner(self) -> dict[str, Any]:
        env, data, meta, _, _ = self._open()
        with env.begin() as txn:
            used = self._meta(txn, meta, b"used")
            node_evictions = self._meta(txn, meta, b"evictions")
            entries = txn.stat(data)["entries"]
        map_size = env.info()["map_size"]
        return {
            "entries": entries,
            "used_bytes": used,
            "capacity_bytes": self.capacity_bytes,
            "policy": self.policy.name,
            "path": self.path,
            "node_evictions": node_evictions,
            "map_size": map_size,  # this process's LMDB map (the most the store can grow to here)
        }
