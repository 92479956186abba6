"""Datasets of shards: the formats, the manifest, ``open_dataset`` and ``stallfree shard``.

- root: ``open.py`` (``open_dataset`` -> ``ShardedDataset``), ``formats.py`` (the format registry:
  a new format is one folder plus one ``register_format`` line), ``writer.py`` (``ShardWriter``),
  ``parallel.py`` (the sharding job), ``scan.py``, ``verify.py``, ``staged_reads.py``.
- ``tar/``: WebDataset tars with DALI ``.idx`` indexes and per-member sums.
- ``arrow/``: Arrow IPC shards (and IPC streams / Parquet read in place).
- ``manifest/``: the manifest, the one commit point of a dataset.
- ``sources/``: the inputs ``stallfree shard`` reads (one module per kind).
- ``inplace/``: MosaicML MDS and LitData datasets read without re-sharding.

Bytes at a URL (remote reads, staging, atomic writes) live a floor below, in ``stallfree.storage``;
this package imports only that and ``stallfree.errors``.
"""

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
