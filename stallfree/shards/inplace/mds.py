"""MosaicML Streaming (MDS) directories read in place (``open_dataset("s3://bucket/mds")``): the
format the registry knows as ``mds``, read-only. The index and samples are parsed by the
sharding source's own functions (``source_mds``); reading, stamping and the per-process caches
are ``inplace.py``'s."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from stallfree.shards.inplace.base import IndexedFile, OffsetFormat, sample_fields
from stallfree.shards.sources.mds import decode_mds_sample, is_mds_index, mds_shards


def parse_mds(
    index: Any, root: str, index_path: str, local: bool, exists: Callable[[str], bool]
) -> tuple[list[IndexedFile], list[str]]:
    """An MDS ``index.json``'s files (each with its columns' decoder) and the samples' fields."""
    shards = mds_shards(index, root, index_path, exists=exists, local=local)
    files, names = [], {}
    for i, shard in enumerate(shards):
        entry = json.dumps(index["shards"][i], sort_keys=True, separators=(",", ":"), default=str)
        columns = [c[0] for c in shard.columns]
        names.update(dict.fromkeys(columns))
        keyed = "__key__" in columns or "key" in columns
        decode = functools.partial(decode_mds_sample, shard.columns)
        files.append(IndexedFile(shard.file, entry, decode, keyed, shard.other))
    return files, sample_fields(list(names))


MDS = OffsetFormat("mds", ".mds", "MDS", parse_mds, is_mds_index)

__all__ = ["MDS", "parse_mds"]
