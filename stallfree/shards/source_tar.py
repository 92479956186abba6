"""Existing tar shards (WebDataset layout) as a source: members listed from the tar headers,
read back by offset, so re-sharding keeps every field byte-identical."""

from __future__ import annotations

import logging
import os
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from stallfree.shards.source_base import Item, Source, SourceError, SourceReadError, split_key_field

log = logging.getLogger(__name__)


class TarSource(Source):
    """Existing tar shards (WebDataset layout), re-sharded with byte-identical fields: members are
    listed from the tar headers, and read by offset."""

    kind = "tar"

    def __init__(self, paths: Sequence[str | Path], *, on_error: str = "raise") -> None:
        super().__init__()
        self.paths = [str(p) for p in paths]
        self.on_error = on_error

    def _list(self) -> list[Item]:
        items: list[Item] = []
        for ti, path in enumerate(self.paths):
            try:
                items.extend(self._list_tar(ti, path))
            except (OSError, tarfile.TarError, SourceError) as exc:
                self._skip_or_raise(self.on_error, path, exc)
        return items

    def _list_tar(self, ti: int, path: str) -> list[Item]:
        groups: dict[str, list[tuple[str, int, int]]] = {}
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                key, ext = split_key_field(m.name)
                if not key:
                    log.debug("%s: ignoring member %s (no key.field name)", path, m.name)
                    continue
                fields = groups.setdefault(key, [])
                if any(f == ext for f, _, _ in fields):
                    raise SourceReadError(f"duplicate member {m.name}", path=path, key=key, offset=m.offset)
                fields.append((ext, m.offset_data, m.size))
        end = os.path.getsize(path)
        items = []
        for key, fields in groups.items():
            last = max(off + size for _, off, size in fields)
            if last > end:
                raise SourceReadError(
                    f"truncated: member data ends at {last}, file has {end} bytes", path=path, key=key
                )
            items.append(Item(f"{path}:{key}", tuple(s for _, _, s in fields), (ti, key, tuple(fields))))
        return items

    def read_many(self, items: Sequence[Item]) -> Iterator[dict[str, Any] | SourceReadError]:
        handles: dict[int, Any] = {}
        try:
            for item in items:
                ti, key, fields = item.ref
                path = self.paths[ti]
                try:
                    f = handles.get(ti)
                    if f is None:
                        f = handles[ti] = open(path, "rb")
                    sample: dict[str, Any] = {"__key__": key}
                    for ext, off, size in fields:
                        f.seek(off)
                        data = f.read(size)
                        if len(data) != size:
                            raise SourceReadError(
                                f"short read of {size} bytes", path=path, key=key, offset=off
                            )
                        sample[ext] = data
                    yield sample
                except OSError as exc:
                    yield SourceReadError(f"{type(exc).__name__}: {exc}", path=path, key=key)
                except SourceReadError as exc:
                    yield exc
        finally:
            for f in handles.values():
                f.close()

    def read(self, item: Item) -> dict[str, Any]:
        result = next(self.read_many([item]))
        if isinstance(result, SourceReadError):
            raise result
        return result
