"""On-disk formats: tar (WebDataset + DALI .idx) and Arrow IPC shards, a JSON manifest, and
``open_dataset`` for random access over any fsspec URL. Imports nothing else of stallfree."""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "open_dataset": "stallfree.shards.open",
    "ShardWriter": "stallfree.shards.writer",
    "Manifest": "stallfree.shards.manifest.model",
    "ShardInfo": "stallfree.shards.manifest.model",
    "write_spark": "stallfree.engines.spark",  # the Spark glue; the writing: shards/write_engines.py
    "write_ray": "stallfree.engines.ray_shard",  # the Ray Datasink; the same writing
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stallfree.shards' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
