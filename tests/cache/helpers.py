"""Plain helpers shared by the cache tests (fixtures live in conftest.py)."""

from __future__ import annotations

from typing import Any

from stallfree.cache import codec
from stallfree.cache.base import CacheKey


def stored(key: CacheKey, value: Any) -> bytes:
    """The blob a tier stores for ``value`` under ``key``: its encoding, with the key's identity."""
    return codec.encode(value, identity=key.identity(value))
