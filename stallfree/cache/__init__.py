"""Tiered sample cache: process memory -> node (LMDB) -> cluster (Redis), one protocol.

``from stallfree.cache import MemoryCache, NodeCache, ClusterCache, TieredCache, CacheKey``;
names load lazily so importing the package stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Cache": "stallfree.cache.base",
    "CacheKey": "stallfree.cache.base",
    "MemoryCache": "stallfree.cache.memory",
    "NodeCache": "stallfree.cache.node",
    "ClusterCache": "stallfree.cache.cluster",
    "ClusterCacheError": "stallfree.cache.cluster",
    "TieredCache": "stallfree.cache.tiered",
    "read_through": "stallfree.cache.readthrough",
    "ReadStats": "stallfree.cache.readthrough",
    "RedisServer": "stallfree.cache.server",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stallfree.cache' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
