"""``ShardWriter``: write a dataset as numbered shards plus ``manifest.json``.

Settings are validated before anything is written (bad sizes, unknown format, a destination that
cannot be written all raise WriteError up front). Each shard is written under a temp name and
renamed into place when complete; the manifest is written last, on a clean ``close``. Writing over
a dataset replaces it whole: new shards take names it does not use (``generation_stem``), and its
files are removed only once the new manifest is committed (``Manifest.commit``).
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

import fsspec

from stallfree.errors import WriteError
from stallfree.shards import formats
from stallfree.shards.formats import ShardFileWriter
from stallfree.shards.manifest.model import FORMAT_VERSION, Manifest, ShardInfo, files_in_use, generation_stem
from stallfree.storage.atomic import CommitOnExit, check_writable, remove_stale_temps

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_size(text: str | int) -> int:
    """``"256MB"`` -> 256_000_000, ``"1GiB"`` -> 2**30; ints pass through. ValueError if malformed."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 256MB, 1GiB, 500000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class ShardWriter(CommitOnExit):
    """Write samples into shards of at most ``max_bytes`` / ``max_samples`` each.

    >>> with ShardWriter("s3://bucket/train", format="tar", max_bytes=256_000_000) as w:
    ...     for sample in samples:
    ...         w.write(sample)

    A single sample larger than ``max_bytes`` gets a shard of its own. ``name`` is a
    ``str.format`` pattern for the shard's stem (``index`` counts from ``start_index``).
    ``classes`` (label names) and ``skipped`` (source items left out) go into the manifest;
    ``schema`` fixes Arrow column types; ``write_manifest=False`` leaves the manifest to the caller
    (parallel writers merge their ``.shards``).
    """

    def __init__(
        self,
        dst: str,
        format: str = "tar",
        max_bytes: int = 256_000_000,
        max_samples: int | None = None,
        name: str = "shard-{index:06d}",
        start_index: int = 0,
        *,
        classes: list[str] | None = None,
        skipped: list[dict[str, Any]] | None = None,
        schema: Any = None,
        write_manifest: bool = True,
        **storage_options: Any,
    ) -> None:
        if format not in formats.format_names():
            raise WriteError(f"unknown shard format {format!r}; choose one of {formats.choices()}")
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
            raise WriteError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        if max_samples is not None and (
            not isinstance(max_samples, int) or isinstance(max_samples, bool) or max_samples <= 0
        ):
            raise WriteError(f"max_samples must be a positive integer or None, got {max_samples!r}")
        if not isinstance(start_index, int) or start_index < 0:
            raise WriteError(f"start_index must be a non-negative integer, got {start_index!r}")
        try:
            first, second = name.format(index=start_index), name.format(index=start_index + 1)
        except (KeyError, IndexError, ValueError) as exc:
            raise WriteError(f"bad shard name pattern {name!r}: {exc}") from None
        if first == second or not first or first.startswith("/"):
            raise WriteError(f"shard name pattern {name!r} must be relative and contain '{{index}}'")
        if classes is not None and not all(isinstance(c, str) for c in classes):
            raise WriteError("classes must be a list of strings")
        self.fs, self.root = fsspec.core.url_to_fs(dst, **storage_options)
        self.root = self.root.rstrip("/") or "/"
        check_writable(self.fs, self.root)
        remove_stale_temps(self.fs, self.root)
        self._replacing, self._in_use = files_in_use(self.fs, self.root)
        self._generation = 0
        self.dst = dst
        self.format = format
        self._format = formats.get_format(format)
        self.max_bytes = max_bytes
        self.max_samples = max_samples
        self.name = name
        self.index = start_index
        self.classes = list(classes) if classes is not None else None
        self.skipped = list(skipped or [])
        self.schema = schema
        self.write_manifest = write_manifest
        self.shards: list[ShardInfo] = []
        self.manifest: Manifest | None = None
        self._fields: dict[str, None] = {}
        self._field_types: dict[str, str] | None = None
        self._current: ShardFileWriter | None = None
        self._closed = False

    @property
    def samples(self) -> int:
        """Samples written so far (all shards)."""
        return sum(s.samples for s in self.shards) + (self._current.samples if self._current else 0)

    def _open_next(self) -> ShardFileWriter:
        fmt = self._format
        while True:  # the first generation whose names the dataset being replaced does not use
            rel = generation_stem(self.name.format(index=self.index), self._generation) + fmt.suffix
            path = posixpath.join(self.root, rel)
            shard = posixpath.normpath(path)
            if self._in_use.isdisjoint([shard, *fmt.sidecars(shard)]):
                break
            self._generation += 1
        self.index += 1
        writer = fmt.writer(path, self.fs, schema=self.schema)
        writer.rel = rel  # type: ignore[attr-defined]
        return writer

    def _finish_current(self) -> None:
        cur, self._current = self._current, None
        if cur is None:
            return
        info = cur.close()
        for f in cur.fields:
            self._fields.setdefault(f, None)
        if cur.schema is not None:
            self.schema = cur.schema  # later shards keep the first shard's column types
            self._field_types = cur.field_types
        self.shards.append(ShardInfo(cur.rel, info.samples, info.bytes, info.sha256, xxh3_128=info.xxh3_128))  # type: ignore[attr-defined]

    def write(self, sample: dict[str, Any]) -> None:
        """Append one sample, starting a new shard first if this one would pass the limits."""
        if self._closed:
            raise WriteError("ShardWriter is closed")
        prepared = self._format.prepare(sample)  # checked and encoded once, before the roll-over
        size = prepared.nbytes
        cur = self._current
        if (
            cur is not None
            and cur.samples
            and (
                cur.bytes + size + 1024 > self.max_bytes
                or (self.max_samples is not None and cur.samples >= self.max_samples)
            )
        ):
            self._finish_current()
            cur = None
        if cur is None:
            cur = self._current = self._open_next()
        cur.write_prepared(prepared)

    def close(self) -> Manifest:
        """Finish the last shard and write ``manifest.json``; returns the manifest."""
        if self._closed and self.manifest is not None:
            return self.manifest
        self._finish_current()
        self._closed = True
        self.manifest = Manifest(
            version=FORMAT_VERSION,
            format=self.format,
            fields=list(self._fields),
            shards=list(self.shards),
            classes=self.classes,
            skipped=self.skipped,
            field_types=self._field_types,
            checksums=self._format.checksums,  # every tar writes its .sums
        )
        if self.write_manifest:
            self.manifest.commit(self.fs, self.root, replacing=self._replacing)
        return self.manifest

    def abort(self) -> None:
        """Drop the shard in progress (finished shards stay; no manifest is written, so a dataset
        that was there is untouched)."""
        self._closed = True
        cur, self._current = self._current, None
        if cur is not None:
            cur.abort()
