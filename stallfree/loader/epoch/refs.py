"""What a sample index names in a dataset, asked without reading the sample: a mixture's source
and the index there, a sharded dataset's shard, row and key (from its manifest and index), a
packed token window's documents with token offsets. Datasets are asked by what they have
(duck-typed: this module imports nothing of ours, so the loader may call it), and anything else
is named by its index alone."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DocumentSpan:
    """Tokens ``[offset, offset + tokens)`` of document ``doc`` are inputs of a packed window."""

    doc: int
    offset: int
    tokens: int


@dataclass(frozen=True)
class SampleRef:
    """One sample of a batch: its epoch ``position``, the dataset ``index`` there, and what the
    dataset tells of it (None / empty where it cannot say)."""

    position: int
    index: int
    padded: bool = False  # a repeat that evens out the ranks' shares (uneven="pad")
    source: str | None = None  # a mixture's source
    source_index: int | None = None  # the index in that source
    shard: str | None = None  # the shard file (manifest path)
    row: int | None = None  # the row in that shard
    key: str | None = None  # the sample's key (``__key__``)
    token_source: str | None = None  # a packed window's token source
    documents: tuple[DocumentSpan, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v is not None and v != () and v != []}
        out["padded"] = self.padded
        return out


def describe(dataset: Any, indices: Sequence[int], epoch: int, *, keys: bool = True) -> list[dict[str, Any]]:
    """Per index, the fields ``SampleRef`` takes beyond position and index. ``keys=False``
    leaves out sample keys, which a sharded dataset reads from each shard's index (one small
    read per shard the batch touches, the first time)."""
    idx = np.asarray(indices, np.int64).reshape(-1)
    locate_many = getattr(dataset, "locate_many", None)
    if locate_many is not None and hasattr(dataset, "names") and hasattr(dataset, "datasets"):
        return _mixture(dataset, idx, epoch, keys)
    if hasattr(dataset, "doc_starts") and hasattr(dataset, "seq_len") and hasattr(dataset, "doc_lengths"):
        return _windows(dataset, idx)
    if hasattr(dataset, "locate") and hasattr(dataset, "manifest"):
        return _sharded(dataset, idx, keys)
    return [{} for _ in idx]


def _mixture(mixture: Any, idx: np.ndarray, epoch: int, keys: bool) -> list[dict[str, Any]]:
    src, local = mixture.locate_many(idx, epoch)
    out: list[dict[str, Any]] = [{} for _ in idx]
    for s in np.unique(src).tolist():
        where = np.flatnonzero(src == s)
        name = mixture.names[s]
        inner = describe(mixture.datasets[name], local[where].tolist(), epoch, keys=keys)
        for p, fields in zip(where.tolist(), inner, strict=True):
            out[p] = {**fields, "source": name, "source_index": int(local[p])}
    return out


def _windows(ds: Any, idx: np.ndarray) -> list[dict[str, Any]]:
    """Window ``i``'s inputs are stream tokens ``[i*L, (i+1)*L)``; document ``d`` occupies
    ``[doc_starts[d], doc_starts[d] + doc_lengths[d])`` of the stream (an eos after it, where
    documents are joined by one, belongs to none)."""
    L = int(ds.seq_len)
    starts = np.asarray(ds.doc_starts, np.int64)
    lengths = np.asarray(ds.doc_lengths, np.int64)
    name = getattr(getattr(ds, "source", None), "name", None)
    out = []
    for i in idx.tolist():
        a, b = i * L, (i + 1) * L
        d0 = int(np.searchsorted(starts, a, "right")) - 1
        d1 = int(np.searchsorted(starts, b - 1, "right")) - 1
        docs = []
        for d in range(max(d0, 0), min(d1, len(lengths) - 1) + 1):
            lo, hi = max(a, int(starts[d])), min(b, int(starts[d] + lengths[d]))
            if hi > lo:
                docs.append(DocumentSpan(d, lo - int(starts[d]), hi - lo))
        out.append({"token_source": name, "documents": tuple(docs)})
    return out


def _sharded(ds: Any, idx: np.ndarray, keys: bool) -> list[dict[str, Any]]:
    """Shard and row from the shard sizes (one vectorised search: a Python bisect per sample
    over 200,000 shards cost more than the rest of a lookup), the key from the shard's index."""
    shards = getattr(ds.manifest, "shards", None)
    key_of = getattr(ds, "key_of", None) if keys else None
    starts = _shard_starts(ds)
    if starts is not None:
        shard = np.searchsorted(starts, idx, side="right") - 1  # empty shards share a start: skipped
        rows = idx - starts[shard]
        located = list(zip(shard.tolist(), rows.tolist(), strict=True))
    else:
        located = [ds.locate(i) for i in idx.tolist()]
    out = []
    for i, (s, row) in zip(idx.tolist(), located, strict=True):
        path = getattr(shards[s], "path", None) if shards is not None else None
        out.append({"shard": path, "row": int(row), "key": key_of(i) if key_of is not None else None})
    return out


_STARTS: weakref.WeakKeyDictionary[Any, np.ndarray] = weakref.WeakKeyDictionary()


def _shard_starts(ds: Any) -> np.ndarray | None:
    """Each shard's first index, kept per dataset (an array of 200,000 shards costs ~10 ms to make)."""
    sizes = getattr(ds, "shard_sizes", None)
    if sizes is None:
        return None
    try:
        got = _STARTS.get(ds)
    except TypeError:  # not weakly referable or not hashable: made each time
        got = None
    if got is None or len(got) != len(sizes):
        counts = np.asarray(sizes, np.int64)
        got = np.cumsum(counts) - counts
        try:
            _STARTS[ds] = got
        except TypeError:
            pass
    return got
