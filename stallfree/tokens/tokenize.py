"""Tokenize text (JSONL lines or a Parquet column) with a Hugging Face ``tokenizers`` tokenizer
(a local ``tokenizer.json``) into token shards: a Megatron ``.bin``/``.idx`` pair or Arrow shards
with an ``input_ids`` column. Every file is written under a temp name and renamed into place;
``tokens.json`` (what was written, with sha256s, the tokenizer's hash and the sources) goes last,
so its presence means the output is whole.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import fsspec
import numpy as np

from stallfree.errors import SampleDecodeError, ShardError, WriteError
from stallfree.storage.atomic import AtomicFile
from stallfree.tokens.token_dir import LAYOUTS, TOKENS_FORMAT, TOKENS_MANIFEST

log = logging.getLogger(__name__)

__all__ = ["LAYOUTS", "TOKENS_MANIFEST", "iter_texts", "tokenize_files"]


def _texts_jsonl(fs: fsspec.AbstractFileSystem, path: str, field: str) -> Iterator[str]:
    offset = 0
    with fs.open(path, "rb", compression="infer") as f:
        for number, line in enumerate(f, 1):
            at, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise SampleDecodeError(f"line {number} is not JSON: {exc}", shard=path, offset=at) from None
            text = obj.get(field) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise SampleDecodeError(
                    f"line {number} has no string field {field!r} (pass text_field=)", shard=path, offset=at
                )
            yield text


def _texts_parquet(fs: fsspec.AbstractFileSystem, path: str, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        if field not in pf.schema_arrow.names:
            raise ShardError(f"no column {field!r}; the columns are {pf.schema_arrow.names}", shard=path)
        row = 0
        for batch in pf.iter_batches(columns=[field], batch_size=4096):
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    raise SampleDecodeError(f"row {row}: {field!r} is not a string", shard=path)
                row += 1
                yield text


def iter_texts(urls: Sequence[str], field: str = "text", **storage_options: Any) -> Iterator[str]:
    """Every document's text, file by file (``.parquet``, else JSON lines, ``.gz`` etc. inferred)."""
    for url in urls:
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
        reader = _texts_parquet if path.endswith(".parquet") else _texts_jsonl
        yield from reader(fs, path, field)


def _batches(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def check_name(name: str) -> str:
    """``name`` when it names files inside the destination; a ``ValueError`` for a path
    (``../x`` would write outside it) or an empty name."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(
            f"{name!r} is not a plain file name stem (no '/', '\\' or '..'): files go inside dst"
        )
    return name


def tokenize_files(
    sources: str | Sequence[str],
    dst: str,
    tokenizer: str,
    *,
    layout: str = "megatron",
    text_field: str = "text",
    name: str = "tokens",
    dtype: Any = None,
    add_special_tokens: bool = False,
    batch_size: int = 1000,
    max_bytes: int = 256_000_000,
    progress: Callable[[int, int], None] | None = None,
    **storage_options: Any,
) -> dict[str, Any]:
    """Tokenize every document of ``sources`` into ``dst`` (a directory URL) and return the
    ``tokens.json`` contents. ``layout``: ``"megatron"`` (``dst/name.bin`` + ``.idx``) or
    ``"arrow"`` (Arrow shards + ``manifest.json``); open either with ``TokenDataset(dst, seq_len)``
    (token_dir.py reads ``tokens.json``).
    ``dtype``: default uint16 when the vocabulary fits (< 65536 ids), else int32.
    ``progress(documents, tokens)``: called after each batch of ``batch_size`` documents (the CLI
    draws its progress bar from it)."""
    from stallfree.extras import require

    Tokenizer = require("tokenizers", "tokens", "tokenize_files (stallfree shard --tokenizer)").Tokenizer

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    check_name(name)
    urls = [sources] if isinstance(sources, str) else list(sources)
    with fsspec.open(tokenizer, "rb") as f:
        tok_bytes = f.read()
    try:
        tok = Tokenizer.from_str(tok_bytes.decode())
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own Exception types
        raise ValueError(f"{tokenizer}: not a tokenizers tokenizer.json: {exc}") from None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dt = np.dtype(dtype if dtype is not None else (np.uint16 if vocab <= 65536 else np.int32))
    fs, root = fsspec.core.url_to_fs(dst, **storage_options)
    root = root.rstrip("/")
    docs = tokens = 0
    texts = iter_texts(urls, text_field, **storage_options)
    if layout == "megatron":
        from stallfree.tokens.megatron import MegatronWriter

        with MegatronWriter(posixpath.join(dst.rstrip("/"), name), dtype=dt, **storage_options) as w:
            for batch in _batches(texts, batch_size):
                for enc in tok.encode_batch(batch, add_special_tokens=add_special_tokens):
                    w.write(np.asarray(enc.ids, dt))
                    docs += 1
                    tokens += len(enc.ids)
                if progress is not None:
                    progress(docs, tokens)
        files = [w.info["bin"], w.info["idx"]]  # type: ignore[index]
        docs, tokens = w.info["documents"], w.info["tokens"]  # type: ignore[index]
    else:
        from stallfree.shards.writer import ShardWriter

        with ShardWriter(
            dst, format="arrow", max_bytes=max_bytes, name=name + "-{index:06d}", **storage_options
        ) as w:
            for batch in _batches(texts, batch_size):
                for enc in tok.encode_batch(batch, add_special_tokens=add_special_tokens):
                    w.write({"__key__": f"{docs:010d}", "input_ids": np.asarray(enc.ids, dt)})
                    docs += 1
                    tokens += len(enc.ids)
                if progress is not None:
                    progress(docs, tokens)
        files = [s.to_json() for s in w.shards]
    manifest = {
        "format": TOKENS_FORMAT,
        "version": 1,
        "layout": layout,
        "dtype": dt.name,
        "documents": docs,
        "tokens": tokens,
        "files": files,
        "text_field": text_field,
        "sources": urls,
        "tokenizer": {
            "path": posixpath.basename(tokenizer),
            "sha256": hashlib.sha256(tok_bytes).hexdigest(),
            "vocab_size": vocab,
            "add_special_tokens": add_special_tokens,
        },
    }
    out = AtomicFile(fs, posixpath.join(root, TOKENS_MANIFEST))
    try:
        out.write((json.dumps(manifest, indent=1) + "\n").encode())
        out.commit()
    except WriteError:
        raise
    except BaseException:
        out.abort()
        raise
    log.info("tokenized %d documents (%d tokens) into %s", docs, tokens, dst)
    return manifest
