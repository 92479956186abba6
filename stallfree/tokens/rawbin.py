"""nanoGPT-style raw token files: a ``.bin`` that is nothing but tokens of one integer dtype
(``np.memmap(path, dtype=np.uint16)``), documents already joined by their end-of-text token.

The file has no header, so ``dtype`` must be given and the file's size must be a whole number of
tokens. Document boundaries: with ``eos`` given, a document ends after each ``eos`` token already
in the stream (found with one vectorised pass over the file at open); without it the file is one
document.
"""

from __future__ import annotations

import posixpath
from typing import Any

import numpy as np

from stallfree.errors import CorruptShardError
from stallfree.storage.fs import file_size
from stallfree.storage.remote import url_to_fs
from stallfree.tokens.base import TOKEN_FILE_MISSING, FlatFile, fingerprint_of, token_dtype

_SCAN_TOKENS = 1 << 24  # tokens per chunk of the boundary scan


class RawBinSource:
    """Tokens of one raw ``.bin`` (see the module docstring)."""

    def __init__(self, url: str, dtype: Any, *, eos: int | None = None, **storage_options: Any) -> None:
        if dtype is None:
            raise ValueError(f"{url}: a raw .bin has no header: pass dtype= (nanoGPT writes uint16)")
        self.url = url
        self.name = posixpath.basename(url)
        self.dtype = token_dtype(dtype, url)
        fs, path = url_to_fs(url, **storage_options)
        size = file_size(fs, path, shard=url, missing=TOKEN_FILE_MISSING)
        item = self.dtype.itemsize
        if size % item:
            whole = size - size % item
            raise CorruptShardError(
                f"{size} bytes is not a whole number of {self.dtype} tokens ({item} bytes each): the last token "
                f"is cut off (truncated file, or the wrong dtype?)",
                shard=url,
                offset=whole,
            )
        count = size // item
        self._flat = FlatFile(url, self.dtype, count, 0, storage_options, fs, path, size)
        self.eos = eos
        self.doc_lengths = self._boundaries(count, eos)
        self._fingerprint = fingerprint_of("rawbin", url, size, self.dtype.name, eos)

    def _boundaries(self, count: int, eos: int | None) -> np.ndarray:
        if eos is None or count == 0:
            return np.array([count], np.int64)
        ends = []
        for lo in range(0, count, _SCAN_TOKENS):
            chunk = self._flat.read(lo, min(count, lo + _SCAN_TOKENS))
            ends.append(np.flatnonzero(chunk == eos) + (lo + 1))
        cuts = np.concatenate([[0], *ends]).astype(np.int64)
        if cuts[-1] != count:
            cuts = np.append(cuts, count)  # the tail after the last eos is a document too
        return np.diff(cuts)

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
        return f"RawBinSource({self.url!r}, dtype={self.dtype}, tokens={self._flat.count})"
