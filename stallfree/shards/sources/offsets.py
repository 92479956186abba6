"""Shard files laid out as one offset table then the samples: a little-endian ``uint32`` count N,
``uint32`` offsets ``[N + 1]`` (absolute byte positions; sample ``i`` is ``[off[i], off[i+1])``),
then the sample bytes. MosaicML MDS shards (``shard.00000.mds``, a JSON config between table and
data) and LitData chunks (``chunk-0-0.bin``) both use it; ``source_mds`` and ``source_litdata``
say how a sample's bytes split into fields.

Listing reads only each file's table (4 * (N + 2) bytes), so planning a big dataset is cheap;
reading a shard's samples opens its file once and reads each sample's span. A compressed file
(MDS ``zip_data``) is decompressed whole, once per file, when its first sample is read.
"""

from __future__ import annotations

import bz2
import logging
import os
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from stallfree.shards.dataset_paths import inside, refuse_link_out
from stallfree.shards.sources.base import Item, Source, SourceError, SourceReadError
from stallfree.shards.sources.tables import row_sample
from stallfree.storage.jsonfile import read_json

log = logging.getLogger(__name__)

# A file's offsets are uint32, so no raw file is larger than this: the most a compressed one may
# decompress to when its index does not record its raw size.
MAX_RAW_BYTES = 1 << 32


def _gzip() -> Any:
    return zlib.decompressobj(wbits=31)  # gzip header and trailer (CRC32, length) checked


# Compression names both formats use, by what Python can undo without extra packages.
DECOMPRESSORS: dict[str, Callable[[], Any]] = {"gz": _gzip, "bz2": bz2.BZ2Decompressor}
_MAGIC = {"gz": b"\x1f\x8b", "bz2": b"BZh"}  # how a further stream in the same file starts


@dataclass(frozen=True)
class ShardFile:
    """One file of the dataset: its path, the sample count its index promises, the
    compression of the file on disk (None: stored raw) and, for a compressed one, the raw size
    its index records (None: not recorded), which bounds what it may decompress to."""

    path: str
    samples: int
    compression: str | None = None
    raw_bytes: int | None = None


def decompressor(name: str | None, where: str) -> Callable[[], Any] | None:
    """What makes a decompressor for ``name`` (``gz``, ``bz2``, ``gz:9``...), or None for none;
    SourceError naming the codec for one we cannot undo (zstd, brotli, snappy)."""
    if not name:
        return None
    base = str(name).split(":", 1)[0]
    fn = DECOMPRESSORS.get(base)
    if fn is None:
        raise SourceError(
            f"{where}: compression {name!r} is not supported (supported: {', '.join(DECOMPRESSORS)}); "
            "re-export the dataset uncompressed"
        )
    return fn


def decompress(data: bytes, shard: ShardFile) -> bytes:
    """A compressed file's bytes undone, bounded by its recorded raw size (else ``MAX_RAW_BYTES``):
    SourceReadError naming the file, and the compressed byte offset where the codec tells it, for
    damaged data (zlib's and bz2's own errors name no file), a stream cut short, trailing bytes,
    or more output than the bound (a decompression bomb is not decompressed whole)."""
    make = decompressor(shard.compression, shard.path)
    if make is None:
        return data
    limit = shard.raw_bytes if shard.raw_bytes is not None else MAX_RAW_BYTES
    codec = shard.compression
    out: list[bytes] = []
    total, rest = 0, data
    try:
        while True:  # gzip files may hold several members, one after another
            undo = make()
            chunk = undo.decompress(rest, limit + 1 - total)
            total += len(chunk)
            out.append(chunk)
            if total > limit:
                raise SourceReadError(
                    f"{codec} data decompresses to more than the {limit} bytes its index allows",
                    path=shard.path,
                )
            if not undo.eof:
                raise SourceReadError(
                    f"{codec} data cut short: the compressed stream ends before its end marker",
                    path=shard.path,
                    offset=len(data),
                )
            rest = undo.unused_data
            if not rest:
                break
            if not rest.startswith(_MAGIC[str(codec).split(":", 1)[0]]):
                raise SourceReadError(
                    f"{len(rest)} bytes after the end of the {codec} stream", path=shard.path,
                    offset=len(data) - len(rest),
                )  # fmt: skip
    except (zlib.error, OSError, EOFError, ValueError) as exc:
        raise SourceReadError(f"cannot decompress ({codec}): {exc}", path=shard.path) from None
    return b"".join(out)


def shard_path(root: str, name: Any, where: str, *, local: bool = True) -> str:
    """``inside`` (the name stays in ``root`` as spelled), and for a local dataset no symbolic
    link on the way leads out of it."""
    path = inside(root, name, where)
    if local:
        refuse_link_out(root, path, where)
    return path


def parse_table(head: bytes, path: str, file_size: int, expected: int | None) -> list[int]:
    """The offsets of a file whose first bytes are ``head``; SourceReadError (with the byte offset)
    when the table is cut short, not increasing, past the end, or disagrees with the index."""
    if len(head) < 4:
        raise SourceReadError("shorter than its 4-byte sample count", path=path, offset=0)
    (n,) = struct.unpack_from("<I", head, 0)
    if expected is not None and n != expected:
        raise SourceReadError(f"holds {n} samples, its index.json says {expected}", path=path, offset=0)
    need = 4 * (n + 2)
    if len(head) < need:
        raise SourceReadError(f"offset table cut short ({len(head)} of {need} bytes)", path=path, offset=4)
    offsets = list(struct.unpack_from(f"<{n + 1}I", head, 4))
    for i in range(n):
        if offsets[i + 1] < offsets[i]:
            raise SourceReadError(f"sample {i}: offsets decrease", path=path, offset=4 + 4 * i)
    if offsets and (offsets[0] < need or offsets[-1] > file_size):
        raise SourceReadError(
            f"sample offsets [{offsets[0]}, {offsets[-1]}) fall outside the file ({file_size} bytes)",
            path=path,
            offset=4,
        )
    return offsets


class OffsetTableSource(Source):
    """Base for datasets of offset-table files. Subclasses set ``files`` (a ``ShardFile`` list in
        dataset order) and implement ``decode(fi, data, where) -> dict`` for one sample's bytes
    (``fi``: the number of its file in ``files``)."""

    files: list[ShardFile]

    def __init__(self, root: str, *, on_error: str = "raise") -> None:
        super().__init__()
        self.root = str(root)
        self.on_error = on_error
        self._blob: tuple[int, bytes] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_blob"] = None
        return state

    def decode(self, fi: int, data: bytes, where: str) -> dict[str, Any]:
        raise NotImplementedError

    def _read_index(self, name: str, what: str) -> tuple[str, Any]:
        """``(path, parsed JSON)`` of the index file ``name`` under the root; ``SourceError``
        naming ``what`` (the format) when it is missing or not JSON."""
        path = os.path.join(self.root, name)
        refuse_link_out(self.root, path, f"the {what} index")
        try:
            return path, read_json(path)
        except OSError as exc:
            raise SourceError(f"cannot read the {what} index {path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise SourceError(f"cannot read the {what} index {path}: {exc}") from None

    def _list(self) -> list[Item]:
        items: list[Item] = []
        for fi, shard in enumerate(self.files):
            try:
                offsets = self._offsets(fi)
            except SourceReadError as exc:
                self._skip_or_raise(self.on_error, shard.path, exc)
                continue
            base = len(items)
            items.extend(
                Item(
                    f"{shard.path} sample {r}",
                    (offsets[r + 1] - offsets[r],),
                    (fi, r, offsets[r], offsets[r + 1], base + r),
                )
                for r in range(len(offsets) - 1)
            )
        return items

    def _offsets(self, fi: int) -> list[int]:
        shard = self.files[fi]
        try:
            if shard.compression:
                blob = self._file_bytes(fi)
                return parse_table(blob, shard.path, len(blob), shard.samples)
            size = os.path.getsize(shard.path)
            with open(shard.path, "rb") as f:
                head = f.read(4)
                n = struct.unpack("<I", head)[0] if len(head) == 4 else 0
                head += f.read(4 * (n + 1))
            return parse_table(head, shard.path, size, shard.samples)
        except OSError as exc:
            raise SourceReadError(f"{type(exc).__name__}: {exc.strerror or exc}", path=shard.path) from None

    def _file_bytes(self, fi: int) -> bytes:
        """The whole (decompressed) file ``fi``, the last one kept."""
        if self._blob is not None and self._blob[0] == fi:
            return self._blob[1]
        shard = self.files[fi]
        with open(shard.path, "rb") as f:
            data = f.read()
        data = decompress(data, shard)
        self._blob = (fi, data)
        return data

    def read(self, item: Item) -> dict[str, Any]:
        got = next(iter(self.read_many([item])))
        if isinstance(got, SourceReadError):
            raise got
        return got

    def _compressed_cells(self, items: Sequence[Item]) -> dict[int, bytes | SourceReadError]:
        """The bytes of every item in a compressed file, gathered file by file (each file is
        decompressed whole, so items in shuffled order would otherwise decompress it per item)."""
        by_file: dict[int, list[int]] = {}
        for pos, item in enumerate(items):
            if self.files[item.ref[0]].compression:
                by_file.setdefault(item.ref[0], []).append(pos)
        cells: dict[int, bytes | SourceReadError] = {}
        for fi, positions in sorted(by_file.items()):
            try:
                blob = self._file_bytes(fi)
            except (OSError, SourceReadError) as exc:
                err = (
                    exc
                    if isinstance(exc, SourceReadError)
                    else SourceReadError(str(exc), path=self.files[fi].path)
                )
                cells.update(dict.fromkeys(positions, err))
                continue
            for pos in positions:
                begin, end = items[pos].ref[2:4]
                cells[pos] = blob[begin:end]
        return cells

    def read_many(self, items: Sequence[Item]) -> Iterator[dict[str, Any] | SourceReadError]:
        handles: dict[int, Any] = {}
        cells = self._compressed_cells(items)
        try:
            for pos, item in enumerate(items):
                fi, row, begin, end, number = item.ref
                shard = self.files[fi]
                where = f"{shard.path} sample {row}"
                try:
                    if shard.compression:
                        data = cells.pop(pos)
                        if isinstance(data, SourceReadError):
                            raise data
                    else:
                        f = handles.get(fi)
                        if f is None:
                            f = handles[fi] = open(shard.path, "rb")  # noqa: SIM115 - closed below
                        data = os.pread(f.fileno(), end - begin, begin)
                    if len(data) != end - begin:
                        raise SourceReadError(
                            f"sample {row} cut short ({len(data)} of {end - begin} bytes)",
                            path=shard.path,
                            offset=begin,
                        )
                    try:
                        fields = self.decode(fi, data, where)
                    except (ValueError, struct.error, IndexError, KeyError, TypeError, OverflowError) as exc:
                        raise SourceReadError(f"sample {row}: {exc}", path=shard.path, offset=begin) from None
                    yield row_sample(fields, number, shard.path)
                except OSError as exc:
                    yield SourceReadError(
                        f"{type(exc).__name__}: {exc.strerror or exc}", path=shard.path, offset=begin
                    )
                except SourceReadError as exc:
                    yield exc
        finally:
            for f in handles.values():
                f.close()


def image_array(data: bytes, where: str):
    """A PIL-raw cell (``[width u32][height u32][mode length u32][mode][pixels]``, what MDS's
    ``pil`` and LitData's PIL serializer store) as a uint8 array, HxW or HxWxC."""
    import numpy as np

    if len(data) < 12:
        raise ValueError(f"{where}: raw image cell shorter than its header")
    width, height, mode_len = struct.unpack_from("<III", data, 0)
    mode = data[12 : 12 + mode_len].decode("ascii", "replace")
    channels = {"L": 1, "RGB": 3, "RGBA": 4, "CMYK": 4, "YCbCr": 3, "LA": 2}.get(mode)
    if channels is None:
        raise ValueError(f"{where}: raw image mode {mode!r} is not supported")
    pixels = np.frombuffer(data, np.uint8, offset=12 + mode_len)
    if pixels.size != width * height * channels:
        raise ValueError(f"{where}: raw {mode} image {width}x{height} holds {pixels.size} bytes")
    shape = (height, width) if channels == 1 else (height, width, channels)
    return pixels.reshape(shape).copy()


__all__ = [
    "DECOMPRESSORS",
    "MAX_RAW_BYTES",
    "OffsetTableSource",
    "ShardFile",
    "decompress",
    "decompressor",
    "image_array",
    "inside",
    "parse_table",
    "shard_path",
]
