"""The output directory of ``tokenize_files`` (``stallfree shard --tokenizer``), opened by its
``tokens.json``.

``tokens.json`` is written last, so its presence means the token files are whole, and it says
the layout: ``megatron`` (``NAME.bin`` + ``NAME.idx``, the CLI's default) or ``arrow`` (Arrow shards
+ ``manifest.json``). ``TokenDataset(out_dir)`` reads it, opens the files it names, and checks
that they hold the documents and tokens it records (files replaced or cut since are an error
naming ``tokens.json``, never other data read silently). A directory holding Megatron files
but no ``tokens.json`` is refused with the prefix to name instead: the run that wrote it may not
have finished.
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Any

import fsspec
import numpy as np

from stallfree.errors import CorruptShardError, ShardError
from stallfree.storage import remote
from stallfree.storage.jsonfile import parse_json
from stallfree.tokens.base import TokenSource, read_whole

TOKENS_MANIFEST = "tokens.json"
TOKENS_FORMAT = "stallfree.tokens"
LAYOUTS = ("megatron", "arrow")


@dataclasses.dataclass(frozen=True)
class TokenDir:
    """What a ``tokens.json`` records: where it is (``url``), the ``layout``, the token ``dtype``
    name, the ``documents`` and ``tokens`` written, and ``files`` (the data files' names, relative
    to the directory)."""

    url: str
    layout: str
    dtype: str
    documents: int
    tokens: int
    files: tuple[str, ...]

    @property
    def manifest_url(self) -> str:
        return _join(self.url, TOKENS_MANIFEST)

    def open(self, *, dtype: Any = None, field: str = "input_ids", **storage_options: Any) -> TokenSource:
        """The token source of this directory, checked against what ``tokens.json`` records."""
        if self.layout == "megatron":
            from stallfree.tokens.megatron import MegatronSource, prefix_of

            source: TokenSource = MegatronSource(
                _join(self.url, prefix_of(self.files[0])), dtype=dtype, **storage_options
            )
        else:
            from stallfree.tokens.arrow_tokens import ArrowTokenSource

            source = ArrowTokenSource(self.url, field=field, **storage_options)
        self.check(source)
        return source

    def check(self, source: TokenSource) -> None:
        """CorruptShardError naming ``tokens.json`` when ``source`` is not what it records."""
        lengths = np.asarray(source.doc_lengths, np.int64)
        got = (len(lengths), int(lengths.sum()), np.dtype(source.dtype).name)
        want = (self.documents, self.tokens, self.dtype)
        if got != want:
            raise CorruptShardError(
                f"records {want[0]} documents, {want[1]} {want[2]} tokens, but its files hold {got[0]} "
                f"documents, {got[1]} {got[2]} tokens (replaced or cut short since it was written?)",
                shard=self.manifest_url,
            )


def read_token_dir(fs: fsspec.AbstractFileSystem, path: str, url: str) -> TokenDir | None:
    """The ``tokens.json`` of directory ``path`` (``url`` as the user spelled it), or None when
    there is none. ShardError naming the file when it is not one ``tokenize_files`` wrote."""
    manifest = _join(path, TOKENS_MANIFEST)
    name = _join(url, TOKENS_MANIFEST)
    if not remote.exists(fs, manifest, shard=name):
        return None
    doc = parse_json(read_whole(fs, manifest, name), name)  # typed, naming it; bounded depth
    if not isinstance(doc, dict) or doc.get("format") != TOKENS_FORMAT:
        raise ShardError(f"not a {TOKENS_FORMAT} manifest (its format is not {TOKENS_FORMAT!r})", shard=name)
    if doc.get("version") != 1:
        raise ShardError(f"version {doc.get('version')!r} is not one this stallfree reads (1)", shard=name)
    try:
        layout = doc["layout"]
        files = tuple(f["path"] if isinstance(f, dict) else f for f in doc["files"])
        info = TokenDir(
            url=url.rstrip("/"),
            layout=layout,
            dtype=str(np.dtype(doc["dtype"]).name),
            documents=_count(doc["documents"]),
            tokens=_count(doc["tokens"]),
            files=files,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ShardError(f"incomplete {TOKENS_MANIFEST}: {type(exc).__name__}: {exc}", shard=name) from None
    if layout not in LAYOUTS:
        raise ShardError(f"unknown layout {layout!r} (expected one of {LAYOUTS})", shard=name)
    if not files or not all(isinstance(f, str) and f and "/" not in f for f in files):
        raise ShardError(f"its files must be names inside the directory, got {list(files)!r}", shard=name)
    return info


def refuse_bare_megatron(fs: fsspec.AbstractFileSystem, path: str, url: str) -> None:
    """A directory of Megatron ``.idx`` files without ``tokens.json``: ShardError naming the
    prefixes to pass instead (a directory is opened by its ``tokens.json``, which says the run
    that wrote it finished)."""
    try:
        names = [posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False)]
    except (FileNotFoundError, NotADirectoryError):
        return
    if any(n.endswith((".arrow", ".parquet")) or n in ("manifest.json", "state.json") for n in names):
        return  # an Arrow/Parquet token dataset: arrow_tokens.py reads it
    prefixes = sorted(n[: -len(".idx")] for n in names if n.endswith(".idx"))
    if not prefixes:
        return
    shown = ", ".join(_join(url, p) for p in prefixes[:4]) + (", ..." if len(prefixes) > 4 else "")
    raise ShardError(
        f"holds Megatron token files ({', '.join(p + '.idx' for p in prefixes[:4])}) but no {TOKENS_MANIFEST} "
        f"(written last by stallfree shard --tokenizer, so the run may not have finished): pass the "
        f"prefix instead: {shown}",
        shard=url,
    )


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a count must be a non-negative int, got {value!r}")
    return value


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


__all__ = [
    "LAYOUTS",
    "TOKENS_FORMAT",
    "TOKENS_MANIFEST",
    "TokenDir",
    "read_token_dir",
    "refuse_bare_megatron",
]
