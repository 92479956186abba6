"""Token ids in a list-of-integer Arrow column: what Hugging Face ``datasets.map(tokenize)``
saves (``save_to_disk``: Arrow IPC stream files; ``to_parquet``: Parquet), our own Arrow shards
(``manifest.json``), or any ``.arrow`` / ``.parquet`` file, directory or glob.

Each record batch's list column is one piece: its child values are the batch's documents back to
back, so the whole dataset is a short list of flat arrays. Local Arrow files (IPC file or
stream format) are memory-mapped only while they are opened, to find where each batch's token ids
lie; reads are then ``pread`` of those bytes (``tokens/base.py`` ``FlatFile``: a file cut short
under a job is an error naming it, where a mapping was a SIGBUS). Parquet (compressed), remote
Arrow files and compressed Arrow buffers are read into memory once per process, the column only,
remote ones through ``storage/remote.py`` (every read's length checked, short or failed reads
retried).
"""

from __future__ import annotations

import os
import posixpath
from bisect import bisect_right
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa

from stallfree.errors import CorruptShardError, MissingShardError, ShardError
from stallfree.shards.arrow.check import check_schema_names, validate_batch
from stallfree.shards.arrow.reader import open_batches
from stallfree.shards.dataset_paths import refuse_link_out
from stallfree.shards.manifest.model import MANIFEST_NAME, Manifest, join
from stallfree.shards.manifest.paths import path_problem
from stallfree.storage import remote
from stallfree.storage.fs import file_size, is_local
from stallfree.storage.jsonfile import parse_json
from stallfree.tokens.base import TOKEN_FILE_MISSING, FlatFile, fingerprint_of, read_whole

_SUFFIXES = (".arrow", ".parquet")


def resolve_files(url: str, **storage_options: Any) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """The data files of ``url`` in dataset order: a file, a glob, or a directory holding our
    ``manifest.json``, a Hugging Face ``save_to_disk`` ``state.json``, or ``.arrow``/``.parquet`` files."""
    fs, path = remote.url_to_fs(url, **storage_options)
    if any(c in path for c in "*?["):
        files = sorted(p for p in fs.glob(path) if p.endswith(_SUFFIXES))
    elif path.endswith(_SUFFIXES):
        files = [path]
    elif fs.isdir(path):
        files = _dir_files(fs, path.rstrip("/"), url)
    else:
        raise MissingShardError(
            "no such token dataset (a .arrow/.parquet file, a directory or a glob)", shard=url
        )
    if not files:
        raise MissingShardError("no .arrow or .parquet files found", shard=url)
    return fs, files


def _dir_files(fs: fsspec.AbstractFileSystem, root: str, url: str) -> list[str]:
    if remote.exists(fs, join(root, MANIFEST_NAME), shard=url):
        manifest = Manifest.load(join(root, MANIFEST_NAME), fs=fs)
        if manifest.format != "arrow":
            raise ShardError(
                f"token datasets need Arrow shards; this manifest's format is {manifest.format}", shard=url
            )
        return [join(root, s.path) for s in manifest.shards]
    state = join(root, "state.json")
    if remote.exists(fs, state, shard=url):
        try:  # parse_json: bounded, a JSONFileError (a ValueError) naming the file, no RecursionError
            names = [f["filename"] for f in parse_json(read_whole(fs, state, state), state)["_data_files"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ShardError(f"unreadable Hugging Face state.json: {exc}", shard=state) from None
        for name in names:  # data from elsewhere: never a file outside the dataset directory
            problem = path_problem(name) if isinstance(name, str) and name else "is not a file name"
            if problem is not None:
                raise ShardError(f"state.json lists {name!r}, which {problem}", shard=state)
        files = [join(root, name) for name in names]
        if is_local(fs):  # nor through a symbolic link that leads out of it
            for path in files:
                refuse_link_out(root, path, state)
        return files
    names = sorted(p for p in fs.ls(root, detail=False) if p.endswith(_SUFFIXES))
    arrows = [p for p in names if p.endswith(".arrow")]
    return arrows or names


def _parquet_file(fs: fsspec.AbstractFileSystem, path: str, name: str) -> Any:
    """A Parquet file to read: the local file, or ranged reads through ``storage/remote.py``
    (lengths checked, retried) for a remote one."""
    if is_local(fs):
        return fs.open(path, "rb")
    return pa.PythonFile(
        remote.RangeFile(fs, path, file_size(fs, path, shard=name, missing=TOKEN_FILE_MISSING), shard=name),
        mode="r",
    )


def _open_batches(
    fs: fsspec.AbstractFileSystem, path: str, name: str, field: str
) -> tuple[list[pa.Array], tuple[int, int] | None, Any]:
    """The ``field`` column of every record batch (or Parquet row group) of one file, in order,
    opened by the shards' one table opener (``arrow.reader.open_batches``: the layout read off
    the file), and for a local Arrow file the (address, size) of the memory map its columns are
    views of and the map itself (for the caller to close once no view is left; else None)."""
    mapped = None
    source = None
    try:
        if path.endswith(".parquet"):
            source = _parquet_file(fs, path, name)
        elif is_local(fs):
            source = pa.memory_map(path, "r")
            whole = source.read_buffer()  # zero-copy: where the map lies, to find buffers in it
            mapped = (whole.address, whole.size)
            del whole
            source.seek(0)
        else:
            source = pa.BufferReader(read_whole(fs, path, name))
        tables = open_batches(source, path, name, True, None, columns=[field])
        names = tables.schema.names
        if field not in names:
            raise ShardError(f"no column {field!r}; the columns are {names} (pass field=)", shard=name)
        batches = [tables.get_batch(b) for b in range(tables.num_record_batches)]
        offsets = [tables.offset_of(b) for b in range(len(batches))]
        # pyarrow trusts a batch's offsets: _piece slices the values by them (unchecked, a
        # damaged file read outside its buffers, or asked for a negative length)
        check_schema_names(tables.schema, name)
        for b, batch in enumerate(batches):
            validate_batch(batch, shard=name, batch_no=b, offset=offsets[b])
    except FileNotFoundError:
        _close(source)
        raise MissingShardError(TOKEN_FILE_MISSING, shard=name) from None
    except (pa.ArrowException, OSError) as exc:  # ArrowInvalid, ArrowNotImplementedError, ...
        _close(source)
        raise CorruptShardError(f"not a readable Arrow/Parquet file: {exc}", shard=name) from None
    except UnicodeDecodeError:  # pyarrow decodes a schema's names only when asked
        _close(source)
        raise CorruptShardError("the schema's column names are not UTF-8", shard=name) from None
    except BaseException:
        _close(source)
        raise
    columns = [b.column(field) for b in batches]
    if mapped is None:
        _close(source)
        return columns, None, None
    return columns, mapped, source


def _close(source: Any) -> None:
    if source is not None:
        source.close()


def _piece(col: pa.Array, name: str, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(flat token ids, document lengths) of one list column, zero-copy."""
    t = col.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_integer(t.value_type):
        raise ShardError(f"column type is {t}, expected a list of integer token ids", shard=name)
    if col.null_count:
        row = int(np.flatnonzero(~np.asarray(col.is_valid()))[0])
        raise CorruptShardError(f"record batch {batch} row {row}: the token list is null", shard=name)
    offsets = np.asarray(col.offsets).astype(np.int64)
    values = col.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    if values.null_count:
        raise CorruptShardError(f"record batch {batch}: a token id is null", shard=name)
    return values.to_numpy(zero_copy_only=True), np.diff(offsets)


class ArrowTokenSource:
    """Token ids in column ``field`` of an Arrow/Parquet dataset (see the module docstring)."""

    def __init__(self, url: str, *, field: str = "input_ids", **storage_options: Any) -> None:
        self.url, self.field, self.storage_options = url, field, storage_options
        self.name = posixpath.basename(url.rstrip("/"))
        fs, self.files = resolve_files(url, **storage_options)
        self._sizes = [file_size(fs, f, shard=f, missing=TOKEN_FILE_MISSING) for f in self.files]
        values: list[np.ndarray | None] = []
        lengths, counts, dtypes, owner, at = [], [], [], [], []
        self._flats: list[FlatFile | None] = []  # each local Arrow file's pread reader
        for f, path in enumerate(self.files):
            flat = None
            pieces, mapping = self._file_pieces(fs, path)
            for vals, lens, offset in pieces:
                lengths.append(lens)
                counts.append(len(vals))
                dtypes.append(vals.dtype)
                owner.append(f)
                item = vals.dtype.itemsize
                if offset is not None and offset % item == 0 and (flat is None or flat.dtype == vals.dtype):
                    if flat is None:
                        size = self._sizes[f]
                        flat = FlatFile(path, vals.dtype, size // item, 0, {}, fs, path, size=size)
                    values.append(None)
                    at.append(offset // item)
                else:
                    values.append(vals if offset is None else vals.copy())  # never a view of the map
                    at.append(-1)
            self._flats.append(flat)
            pieces = vals = None  # the last views of the map: then it is closed, not left to the GC
            if mapping is not None:
                mapping.close()
        # nothing kept above is a view of a map: the files are mapped no longer
        self.dtype = np.result_type(*dtypes) if dtypes else np.dtype(np.int64)
        self.doc_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self._starts = np.concatenate([[0], np.cumsum(np.asarray(counts, np.int64))]).astype(np.int64)
        self._owner = np.asarray(owner, np.int64)  # file number of each piece
        self._at = np.asarray(at, np.int64)  # a piece's first token in its file's FlatFile, or -1
        self._first = np.searchsorted(self._owner, np.arange(len(self.files)))  # each file's first piece
        self._fingerprint = fingerprint_of(
            "arrow", url, field, self.files, self._sizes, int(self._starts[-1])
        )
        self._fs: fsspec.AbstractFileSystem | None = fs
        self._values = values  # in-memory pieces (Parquet, remote, compressed); None: read from the file
        self._pid = os.getpid()

    def _file_pieces(
        self, fs: fsspec.AbstractFileSystem, path: str
    ) -> tuple[list[tuple[np.ndarray, np.ndarray, int | None]], Any]:
        """(token ids, document lengths, byte offset in the file or None) of each non-empty piece,
        and the memory map of a local Arrow file (else None). The map is only for finding the
        pieces' offsets (buffers that are not plain bytes of the file, compressed ones, are copied
        out): the caller keeps no view of it and closes it, so no page of the file stays mapped
        and a file cut short later cannot SIGBUS a reader."""
        columns, mapped, source = _open_batches(fs, path, path, self.field)
        out = []
        for b, col in enumerate(columns):
            if not len(col):
                continue
            vals, lens = _piece(col, path, b)
            offset = None
            if mapped is not None:
                addr, (base, size) = vals.__array_interface__["data"][0], mapped
                if len(vals) and base <= addr and addr + vals.nbytes <= base + size:
                    offset = addr - base
                else:
                    vals = vals.copy()  # no view of the map is kept
            out.append((vals, lens, offset))
        return out, source

    def _piece(self, p: int) -> np.ndarray:
        """In-memory piece ``p``'s tokens; in a new process each file is opened when first needed
        (a worker reading a few windows of a 1,000-file dataset opens a few files, not all)."""
        if self._pid != os.getpid() or self._values is None:
            self._values = [None] * len(self._owner)
            self._fs, self._pid = None, os.getpid()
        v = self._values[p]
        if v is None:
            if self._fs is None:
                self._fs = remote.url_to_fs(self.url, **self.storage_options)[0]
            f = int(self._owner[p])
            path = self.files[f]
            got, mapping = self._file_pieces(self._fs, path)
            try:
                first = int(self._first[f])
                expect = (
                    self._starts[first + 1 : first + len(got) + 1] - self._starts[first : first + len(got)]
                )
                if len(got) != int((self._owner == f).sum()) or [len(g[0]) for g in got] != expect.tolist():
                    raise CorruptShardError("the file changed since the dataset was opened", shard=path)
                for k, (values, _, offset) in enumerate(got):
                    if self._at[first + k] < 0:  # never a view of the map
                        self._values[first + k] = values if offset is None else values.copy()
            finally:
                got = values = None
                if mapping is not None:
                    mapping.close()
            v = self._values[p]
        return v  # type: ignore[return-value]

    def _read_piece(self, p: int, lo: int, hi: int) -> np.ndarray:
        """Tokens ``[lo, hi)`` of piece ``p``: a ``pread`` of a local file's bytes, or a slice."""
        at = int(self._at[p])
        if at >= 0:
            return self._flats[int(self._owner[p])].read(at + lo, at + hi)  # type: ignore[union-attr]
        return self._piece(p)[lo:hi]

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def read_runs(self, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Tokens ``[starts[i], starts[i] + counts[i])`` for every ``i``, back to back in one new
        array: each run's part in a file-backed piece is one ``pread`` straight into it, the rest
        copied from in-memory pieces (``TokenDataset`` calls this once per batch)."""
        runs = list(zip(np.asarray(starts).tolist(), np.asarray(counts).tolist(), strict=True))
        first, at, owner = self._lists()
        total, end = 0, first[-1]
        for s, c in runs:
            if s < 0 or c < 0 or s + c > end:
                raise IndexError(f"token range [{s}, {s + c}) outside [0, {end}) of {self.url}")
            total += c
        out = np.empty(total, self.dtype)
        item, buf, files = self.dtype.itemsize, memoryview(out).cast("B"), {}
        i = 0
        for s, c in runs:
            while c > 0:  # the hot loop (a batch's 16 windows): plain ints, one pread each
                p = bisect_right(first, s) - 1
                n = min(s + c, first[p + 1]) - s
                f = owner[p]
                flat = self._flats[f] if at[p] >= 0 else None
                if flat is not None and flat.dtype == self.dtype:
                    handle = files.get(f)
                    if handle is None:  # held (not just its fd) while this call reads through it
                        handle = files[f] = flat.handle()
                    token = at[p] + s - first[p]
                    if os.preadv(handle.fileno(), [buf[i * item : (i + n) * item]], token * item) != n * item:
                        flat.read_into(token, out[i : i + n])  # the rest, or the error saying why not
                else:
                    out[i : i + n] = self._read_piece(p, s - first[p], s - first[p] + n)
                i, s, c = i + n, s + n, c - n
        return out

    def _lists(self) -> tuple[list[int], list[int], list[int]]:
        """Piece starts, file offsets and owners as plain lists: per-window lookups in Python ints."""
        lists = getattr(self, "_index_lists", None)
        if lists is None:
            lists = self._index_lists = (self._starts.tolist(), self._at.tolist(), self._owner.tolist())
        return lists

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)``: read (or a view of an in-memory piece) when inside one piece,
        else the pieces joined."""
        starts, pieces = self._starts, len(self._owner)
        if not 0 <= start <= stop <= starts[-1]:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {starts[-1]}) of {self.url}")
        if not pieces or start == stop:
            return np.zeros(0, self.dtype)
        p = min(int(np.searchsorted(starts, start, "right")) - 1, pieces - 1)
        if stop <= starts[p + 1]:
            return self._read_piece(p, start - starts[p], stop - starts[p])
        parts = []
        while start < stop:
            lo, hi = start - starts[p], min(stop, starts[p + 1]) - starts[p]
            parts.append(self._read_piece(p, lo, hi))
            start, p = starts[p] + hi, p + 1
        return np.concatenate(parts)

    def locate(self, token: int) -> tuple[str, int | None]:
        """(file, None) of token ``token`` (Arrow keeps no simple byte offset), for error messages."""
        p = min(int(np.searchsorted(self._starts, token, "right")) - 1, len(self._owner) - 1)
        return self.files[int(self._owner[p])], None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_values"], state["_fs"] = None, None  # each file reopened where it is read
        return state

    def __repr__(self) -> str:
        return f"ArrowTokenSource({self.url!r}, field={self.field!r}, files={len(self.files)})"
