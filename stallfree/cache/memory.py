"""In-process tier: encoded entries in an ordered dict, bounded by encoded bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from stallfree.cache.base import MAX_ENTRY_BYTES, BaseCache, PutResult
from stallfree.cache.policy import Policy


class MemoryCache(BaseCache):
    """A cache private to one process (each worker has its own; pickling gives an empty one).

    ``capacity_bytes`` bounds the encoded bytes held (``None``: unbounded); ``max_entry_bytes``
    the size of one entry (``base.MAX_ENTRY_BYTES``, 64 MiB, by default). Thread-safe.
    """

    name = "memory"

    def __init__(
        self,
        capacity_bytes: int | None = None,
        policy: str | Policy = "minio",
        *,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
    ) -> None:
        super().__init__()
        self._set_budget(capacity_bytes, policy, max_entry_bytes)
        self._data: OrderedDict[bytes, bytes] = OrderedDict()
        self._used = 0
        self._evictions = 0
        self._lock = threading.Lock()

    def _config(self) -> dict[str, Any]:
        return {
            "capacity_bytes": self.capacity_bytes,
            "policy": self.policy.name,
            "max_entry_bytes": self.max_entry_bytes,
        }

    def _get_raw(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            out = [self._data.get(k) for k in keys]
            if self.policy.evicts:
                for k, v in zip(keys, out, strict=True):
                    if v is not None:
                        self._data.move_to_end(k)
        return out

    def _put_raw(self, items: Sequence[tuple[bytes, bytes]]) -> PutResult:
        admitted = nbytes = rejected = 0
        cap = self.capacity_bytes
        with self._lock:
            for key, blob in items:
                if key in self._data:
                    if self.policy.evicts:
                        self._data.move_to_end(key)
                    continue
                size = len(blob)
                need = self.policy.room_needed(self._used, size, cap)
                while need > 0 and self._data:
                    _, old = self._data.popitem(last=False)
                    self._used -= len(old)
                    need -= len(old)
                    self._evictions += 1
                if not self.policy.admits(self._used, size, cap):
                    rejected += 1
                    continue
                self._data[key] = blob
                self._used += size
                admitted += 1
                nbytes += size
        return PutResult(admitted, nbytes, rejected)

    def _delete_raw(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                blob = self._data.pop(k, None)
                if blob is not None:
                    self._used -= len(blob)

    def _contains_raw(self, key: bytes) -> bool:
        with self._lock:
            return key in self._data

    def _close(self) -> None:
        with self._lock:
            self._data.clear()
            self._used = 0

    def _tier_stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "evictions": self._evictions,
                "entries": len(self._data),
                "used_bytes": self._used,
                "capacity_bytes": self.capacity_bytes,
                "policy": self.policy.name,
            }
