"""Chain tiers (fastest first): look up tier by tier, promote lower-tier hits upward, write through.

Entries move between tiers as encoded bytes, so a promotion costs no decode/encode; each tier's
policy decides what it admits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stallfree.cache.base import BaseCache, PutResult


class TieredCache(BaseCache):
    """``TieredCache([MemoryCache(...), NodeCache(...), ClusterCache(...)])``.

    A lookup asks each tier only for what the faster tiers missed; a hit in tier *k* is offered to
    tiers 0..k-1 (``promote=True``). A store goes to every tier (write-through), so the cluster
    learns a sample as soon as any node has read it from storage.
    """

    name = "tiered"

    def __init__(self, tiers: Sequence[BaseCache], promote: bool = True) -> None:
        super().__init__()
        tiers = list(tiers)
        if not tiers:
            raise ValueError("TieredCache needs at least one tier")
        for tier in tiers:
            if not isinstance(tier, BaseCache):
                raise TypeError(f"TieredCache tiers must be stallfree caches, got {type(tier).__name__}")
        self.tiers = tiers
        self.promote = promote
        # each tier refuses what is over its own bound; encoding stops at the largest of them
        self.max_entry_bytes = max(tier.max_entry_bytes for tier in tiers)

    def _config(self) -> dict[str, Any]:
        return {"tiers": self.tiers, "promote": self.promote}

    def _get_raw(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for level, tier in enumerate(self.tiers):
            if not pending:
                break
            found = tier.get_encoded_many([keys[p] for p in pending])
            hits = [(p, blob) for p, blob in zip(pending, found, strict=True) if blob is not None]
            for p, blob in hits:
                out[p] = blob
            if hits and level and self.promote:
                promoted = [(keys[p], blob) for p, blob in hits]
                for upper in self.tiers[:level]:
                    upper.put_encoded_many(promoted)
            pending = [p for p, blob in zip(pending, found, strict=True) if blob is None]
        return out

    def _put_raw(self, items: Sequence[tuple[bytes, bytes]]) -> PutResult:
        results = [tier.put_encoded_many(items) for tier in self.tiers]
        # report what the outermost (largest) tier kept: that is what later lookups will find
        return results[-1]

    def _delete_raw(self, keys: Sequence[bytes]) -> None:
        for tier in self.tiers:
            tier.delete_encoded_many(keys)

    def _contains_raw(self, key: bytes) -> bool:
        for tier in self.tiers:  # one broken tier must not hide the key held by another
            try:
                if tier._contains_raw(key):
                    return True
            except Exception as exc:
                tier._failed("contains", exc)
        return False

    def _close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def _tier_stats(self) -> dict[str, Any]:
        tiers = [tier.stats() for tier in self.tiers]
        return {
            "tiers": tiers,
            "evictions": sum(int(t.get("evictions", 0)) for t in tiers),
            "errors": sum(int(t.get("errors", 0)) for t in tiers),
            "oversized": sum(int(t.get("oversized", 0)) for t in tiers),  # each tier checks its own bound
        }
