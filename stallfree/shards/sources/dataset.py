"""Anything ``open_dataset`` reads, as a sharding source: tar or Arrow / Parquet shards, a Hugging
Face ``save_to_disk`` directory or Parquet export, local or behind any fsspec URL (``s3://``,
``gs://``, ``https://``...). The other sources read local files; this one lets ``stallfree shard
s3://bucket/hf-dataset ./shards`` work without copying the data down first.

Rows come out as ``open_dataset`` gives them (``Image()`` cells already as bytes, keys as the
dataset names them); reads are batched per shard (``get_many``: neighbours coalesced into one
ranged read), and a batch that fails is retried sample by sample so the error policy applies to
the one sample that is bad.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from stallfree.errors import ShardError
from stallfree.shards.sources.base import Item, Source, SourceError, SourceReadError

_BATCH = 64


class DatasetSource(Source):
    """The samples of ``open_dataset(url, **storage_options)``, in dataset order. Item sizes are
    each shard's average sample size (exact per-sample sizes would need a read per sample)."""

    kind = "dataset"

    def __init__(self, url: str, *, on_error: str = "raise", **storage_options: Any) -> None:
        from stallfree.shards.open import open_dataset

        super().__init__()
        self.url = url
        self.on_error = on_error
        try:
            self.dataset = open_dataset(url, **storage_options)
        except ShardError as exc:
            raise SourceError(f"cannot open {url} as a source: {exc}") from None
        manifest = self.dataset.manifest
        self.classes = manifest.classes
        self.class_field = manifest.extra.get("class_field")

    def _list(self) -> list[Item]:
        items: list[Item] = []
        for shard in self.dataset.manifest.shards:
            size = shard.bytes // max(shard.samples, 1)
            start = len(items)
            items.extend(
                Item(f"{self.url} {shard.path} sample {r}", (size,), start + r) for r in range(shard.samples)
            )
        return items

    def read(self, item: Item) -> dict[str, Any]:
        try:
            return self.dataset[item.ref]
        except ShardError as exc:
            raise SourceReadError(exc.reason, path=item.name, key=exc.key, offset=exc.offset) from None

    def read_many(self, items: Sequence[Item]) -> Iterator[dict[str, Any] | SourceReadError]:
        for start in range(0, len(items), _BATCH):
            chunk = items[start : start + _BATCH]
            try:
                samples = self.dataset.get_many([it.ref for it in chunk])
            except ShardError:
                yield from super().read_many(chunk)  # one at a time: only the bad sample fails
                continue
            yield from samples


__all__ = ["DatasetSource"]
