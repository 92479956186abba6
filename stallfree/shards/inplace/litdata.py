"""LitData ``optimize()`` directories read in place (``open_dataset("s3://bucket/optimized")``):
the format the registry knows as ``litdata``, read-only. The index and samples are parsed by
the sharding source's own functions (``source_litdata``); reading, stamping and the
per-process caches are ``inplace.py``'s."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from stallfree.shards.inplace.base import IndexedFile, OffsetFormat, sample_fields
from stallfree.shards.sources.litdata import decode_litdata_sample, is_litdata_index, litdata_layout


def parse_litdata(
    index: Any, root: str, index_path: str, local: bool, exists: Callable[[str], bool]
) -> tuple[list[IndexedFile], list[str]]:
    """A LitData ``index.json``'s chunk files (one decoder for all) and the samples' fields."""
    layout = litdata_layout(index, root, index_path, local=local)
    decode = functools.partial(decode_litdata_sample, layout)
    config = json.dumps(index["config"], sort_keys=True, separators=(",", ":"), default=str)
    keyed = "__key__" in layout.fields or "key" in layout.fields
    files = []
    for i, file in enumerate(layout.files):
        chunk = json.dumps(index["chunks"][i], sort_keys=True, separators=(",", ":"), default=str)
        files.append(IndexedFile(file, f'{{"chunk":{chunk},"config":{config}}}', decode, keyed))
    return files, sample_fields(layout.fields)


LITDATA = OffsetFormat("litdata", ".bin", "LitData", parse_litdata, is_litdata_index)

__all__ = ["LITDATA", "parse_litdata"]
