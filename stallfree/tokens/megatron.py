"""Megatron-LM / NeMo indexed datasets: ``name.bin`` (tokens) + ``name.idx`` (index).

The ``.idx`` layout (little-endian), as Megatron-LM's ``indexed_dataset.py`` writes it:

====== ======================== ==============================================================
offset size                     field
====== ======================== ==============================================================
0      9                        magic ``b"MMIDIDX\\x00\\x00"``
9      8 (uint64)               version, 1
17     1 (uint8)                dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                6 float64, 7 float32, 8 uint16
18     8 (uint64)               sequence count ``S``
26     8 (uint64)               document-index count ``D`` (documents + 1)
34     4*S (int32)              tokens per sequence
..     8*S (int64)              byte offset of each sequence in ``.bin``
..     8*D (int64)              sequence number where each document starts (0 first, S last)
..     S (int8), optional       per-sequence modes (multimodal datasets only)
====== ======================== ==============================================================

A packed "document" here is one sequence, as Megatron's GPTDataset treats them. Sequences must lie
back to back from byte 0 of the ``.bin`` (what Megatron's builder writes), so the tokens form one
flat run and a window is one slice. Everything is checked at open: a mismatch names the file and
the byte offset.
"""

from __future__ import annotations

import posixpath
import struct
from typing import Any

import fsspec
import numpy as np

from stallfree.errors import (
    CorruptShardError,
    IndexMismatchError,
    MissingShardError,
    ShardError,
    WriteError,
)
from stallfree.storage.atomic import AtomicFile, CommitOnExit
from stallfree.storage.fs import file_size
from stallfree.storage.remote import url_to_fs
from stallfree.tokens.base import TOKEN_FILE_MISSING, FlatFile, fingerprint_of, read_whole, token_dtype

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document-index entries
CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
DTYPE_OFFSET = 17


def prefix_of(path: str) -> str:
    """``x/name`` for ``x/name``, ``x/name.bin`` or ``x/name.idx``."""
    for ext in (".bin", ".idx"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


class MegatronIndex:
    """A parsed ``.idx``: dtype, per-sequence lengths and byte pointers, document starts."""

    def __init__(self, data: bytes, name: str) -> None:
        if len(data) < HEADER.size:
            raise CorruptShardError(
                f"truncated .idx: {len(data)} bytes, the header alone is {HEADER.size}",
                shard=name,
                offset=len(data),
            )
        magic, version, code, seqs, docs = HEADER.unpack_from(data)
        if magic != MAGIC:
            raise CorruptShardError(
                f"not a Megatron .idx: magic is {magic!r}, expected {MAGIC!r}", shard=name, offset=0
            )
        if version != VERSION:
            raise CorruptShardError(
                f"unsupported .idx version {version} (this reads {VERSION})", shard=name, offset=9
            )
        if code not in CODES:
            raise CorruptShardError(f"unknown dtype code {code} in .idx", shard=name, offset=DTYPE_OFFSET)
        if CODES[code].startswith("float"):
            raise CorruptShardError(
                f"dtype code {code} is {CODES[code]}: not token ids", shard=name, offset=DTYPE_OFFSET
            )
        self.dtype = np.dtype(CODES[code])
        need = HEADER.size + 12 * seqs + 8 * docs
        if len(data) < need:
            raise CorruptShardError(
                f"truncated .idx: {seqs} sequences and {docs} document entries need {need} bytes, the file has {len(data)}",
                shard=name,
                offset=len(data),
            )
        extra = len(data) - need
        if extra not in (0, seqs):  # sequence modes (int8 each) are the only thing that may follow
            raise IndexMismatchError(
                f".idx has {extra} bytes after its document index (expected 0, or {seqs} of sequence modes)",
                shard=name,
                offset=need,
            )
        at = HEADER.size
        self.lengths = np.frombuffer(data, "<i4", seqs, at).astype(np.int64)
        self.pointers = np.frombuffer(data, "<i8", seqs, at + 4 * seqs)
        self.doc_index = np.frombuffer(data, "<i8", docs, at + 12 * seqs)
        self.lengths_at, self.pointers_at, self.doc_index_at = at, at + 4 * seqs, at + 12 * seqs
        self.name = name
        self._check()

    def _check(self) -> None:
        name, lengths = self.name, self.lengths
        if len(lengths) and lengths.min() < 0:
            s = int(np.argmin(lengths))
            raise IndexMismatchError(
                f"sequence {s} has negative length {lengths[s]}", shard=name, offset=self.lengths_at + 4 * s
            )
        di = self.doc_index
        if len(di) and (di[0] != 0 or di[-1] != len(lengths) or (np.diff(di) < 0).any()):
            raise IndexMismatchError(
                f"document index must rise from 0 to the sequence count {len(lengths)}",
                shard=name,
                offset=self.doc_index_at,
            )
        expect = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=expect[1:])
        bad = np.flatnonzero(self.pointers != expect)
        if len(bad):
            s = int(bad[0])
            raise IndexMismatchError(
                f"sequence {s} starts at .bin byte {self.pointers[s]}, but sequences lie back to back so it should "
                f"start at {expect[s]} (gaps or reordering are not supported)",
                shard=name,
                offset=self.pointers_at + 8 * s,
            )

    @property
    def bin_bytes(self) -> int:
        return int(self.lengths.sum()) * self.dtype.itemsize


class MegatronSource:
    """Tokens of a Megatron indexed dataset (``prefix`` names ``prefix.bin`` and ``prefix.idx``).

    ``dtype``: optional; if given it must match the ``.idx``'s dtype code (a wrong guess is an
    error naming the ``.idx`` and byte 17, never silently misread tokens)."""

    def __init__(self, prefix: str, *, dtype: Any = None, **storage_options: Any) -> None:
        self.prefix = prefix_of(prefix)
        self.storage_options = storage_options
        self.bin_url, self.idx_url = self.prefix + ".bin", self.prefix + ".idx"
        self.name = posixpath.basename(self.prefix)
        fs, idx_path = url_to_fs(self.idx_url, **storage_options)
        bin_path = url_to_fs(self.bin_url, **storage_options)[1]
        size = file_size(fs, bin_path, shard=self.bin_url, missing=TOKEN_FILE_MISSING)
        try:
            data = read_whole(fs, idx_path, self.idx_url)
        except MissingShardError:
            raise ShardError(
                "no .idx beside the .bin (a Megatron dataset needs both)", shard=self.idx_url
            ) from None
        index = MegatronIndex(data, self.idx_url)
        if dtype is not None and token_dtype(dtype, self.idx_url) != index.dtype:
            raise IndexMismatchError(
                f"dtype={np.dtype(dtype)} was asked for, but the .idx says its tokens are {index.dtype}",
                shard=self.idx_url,
                offset=DTYPE_OFFSET,
            )
        if size < index.bin_bytes:
            raise CorruptShardError(
                f"truncated .bin: the .idx accounts for {index.bin_bytes} bytes ({int(index.lengths.sum())} "
                f"{index.dtype} tokens), the file ends at {size}",
                shard=self.bin_url,
                offset=size,
            )
        if size > index.bin_bytes:
            raise IndexMismatchError(
                f"the .idx accounts for {index.bin_bytes} bytes of tokens but the .bin has {size} (a different "
                f".idx, or a .bin written with another dtype?)",
                shard=self.bin_url,
                offset=index.bin_bytes,
            )
        self.dtype = index.dtype
        self.doc_lengths = index.lengths
        self.documents = np.asarray(index.doc_index)
        self._flat = FlatFile(
            self.bin_url, self.dtype, int(index.lengths.sum()), 0, storage_options, fs, bin_path, size
        )
        self._fingerprint = fingerprint_of("megatron", self.prefix, size, len(data), data[:64], data[-64:])

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def read(self, start: int, stop: int) -> np.ndarray:
        return self._flat.read(start, stop)

    def read_runs(self, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        return self._flat.read_runs(starts, counts)

    def locate(self, token: int) -> tuple[str, int | None]:
        return self._flat.locate(token)

    def __repr__(self) -> str:
        return f"MegatronSource({self.prefix!r}, dtype={self.dtype}, sequences={len(self.doc_lengths)})"


class MegatronWriter(CommitOnExit):
    """Writes ``prefix.bin`` + ``prefix.idx`` (one sequence per document), each under a temp name
    and renamed into place on ``close`` (``.bin`` first, so a present ``.idx`` means both are whole).

    >>> with MegatronWriter("out/train", dtype="uint16") as w:
    ...     w.write(np.array([5, 6, 7]))
    """

    def __init__(self, prefix: str, dtype: Any = "int32", **storage_options: Any) -> None:
        self.dtype = token_dtype(dtype, prefix)
        codes = {v: k for k, v in CODES.items()}
        if self.dtype.name not in codes:
            raise WriteError(
                f"Megatron .idx cannot record dtype {self.dtype}; use one of uint8, int8, int16, uint16, int32, int64"
            )
        self.code = codes[self.dtype.name]
        self.prefix = prefix_of(prefix)
        self.fs, path = fsspec.core.url_to_fs(self.prefix, **storage_options)
        self._bin = AtomicFile(self.fs, path + ".bin")
        self._idx_path = path + ".idx"
        self.lengths: list[int] = []
        self.info: dict[str, Any] | None = None

    def write(self, tokens: Any) -> None:
        """Append one document."""
        arr = np.asarray(tokens)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise WriteError(
                f"a document is a 1-D array of integer token ids, got shape {arr.shape} dtype {arr.dtype}"
            )
        info = np.iinfo(self.dtype)
        if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
            raise WriteError(
                f"token ids {int(arr.min())}..{int(arr.max())} do not fit {self.dtype}", shard=self.prefix
            )
        if arr.size >= 2**31:
            raise WriteError("a Megatron sequence holds at most 2**31-1 tokens", shard=self.prefix)
        self._bin.write(np.ascontiguousarray(arr, self.dtype).tobytes())
        self.lengths.append(int(arr.size))

    def close(self) -> dict[str, Any]:
        if self.info is not None:
            return self.info
        lengths = np.asarray(self.lengths, np.int64)
        pointers = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc_index = np.arange(len(lengths) + 1, dtype=np.int64)
        idx = AtomicFile(self.fs, self._idx_path)
        try:
            idx.write(HEADER.pack(MAGIC, VERSION, self.code, len(lengths), len(doc_index)))
            idx.write(lengths.astype("<i4").tobytes())
            idx.write(pointers.astype("<i8").tobytes())
            idx.write(doc_index.astype("<i8").tobytes())
            self._bin.commit()
            idx.commit()
        except BaseException:
            idx.abort()
            self._bin.abort()
            raise
        self.info = {
            "bin": {
                "path": posixpath.basename(self._bin.path),
                "bytes": self._bin.size,
                "sha256": self._bin.sha256(),
            },
            "idx": {"path": posixpath.basename(self._idx_path), "bytes": idx.size, "sha256": idx.sha256()},
            "documents": len(lengths),
            "tokens": int(lengths.sum()),
            "dtype": self.dtype.name,
        }
        return self.info

    def abort(self) -> None:
        self._bin.abort()
