"""``TokenDataset``: fixed-length training windows packed from the documents of a token source.

The documents are concatenated (an ``eos`` token between two documents when given) into one
stream of ``T`` tokens. Window ``i`` covers stream tokens ``[i*seq_len, (i+1)*seq_len + 1)``;
``input_ids`` are its first ``seq_len`` tokens, ``labels`` its last ``seq_len``, so over an epoch
every stream token but the dropped tail is an input exactly once. ``doc_ids`` name each input
token's document and ``position_ids`` restart at 0 at every document start. With
``positions="window"`` (the default, as Megatron's ``reset_position_ids`` and flash-attention's
varlen packing do) they also start at 0 at the window's start, since the model sees nothing of a
document before its window; ``positions="document"`` gives the offset from the document's true
start instead.

``labels`` says which training convention the windows follow. ``"shifted"`` (the default; Megatron,
nanoGPT, a hand-written ``cross_entropy(logits, labels)``): ``labels[i] = input_ids[i + 1]``, the
window's last ``seq_len`` tokens, so position ``i``'s logits are scored against ``labels[i]``.
``"inputs"`` (Hugging Face ``*ForCausalLM`` and ``Trainer``, which shift the labels themselves):
``labels`` equal ``input_ids``. Feeding ``"shifted"`` labels to a model that shifts again trains it
to predict the token two ahead, with nothing to warn (a dataset cannot see which model it feeds),
hence the choice is named. Neither convention masks anything: windows are always full (no
padding), and a document boundary is trained the same in both (the first token of the next
document predicted from the ``eos`` before it, or without ``eos`` from the previous document's last
token), so the ``"inputs"`` loss equals the ``"shifted"`` loss over each window's first
``seq_len - 1`` positions; the window's last target (its ``seq_len + 1``-th token), which a
shifting model cannot see, is the one prediction ``"inputs"`` gives up, as Hugging Face's own
``group_texts`` blocks do.

Bounds: a corpus of ``seq_len`` tokens or fewer holds no window, and is a ValueError naming its
size and ``seq_len`` (checked before anything ``seq_len`` long is allocated, so a huge one fails at
once). Windows are int64: a uint64 id >= 2**63 is rejected when read, with an error naming the
file, document and id, never wrapped negative.

Why it is fast: a window reads only its own bytes (document starts are one cumulative array; two
``searchsorted`` per window find its documents), and a batch is assembled with a handful of numpy
operations over the whole ``(batch, seq_len + 1)`` block, never per token in Python.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from stallfree.errors import CorruptShardError
from stallfree.tokens.base import TokenSource, check_lengths, fingerprint_of

POSITIONS = ("window", "document")
LABELS = ("shifted", "inputs")
_INT64_MAX = int(np.iinfo(np.int64).max)


def open_tokens(
    source: str,
    *,
    dtype: Any = None,
    field: str = "input_ids",
    eos: int | None = None,
    **storage_options: Any,
) -> TokenSource:
    """The token source ``source`` names: a Megatron prefix (``x/name`` for ``name.bin`` +
    ``name.idx``, or either file), a raw ``.bin`` (``dtype=`` required), the output directory of
    ``stallfree shard --tokenizer`` (opened by its ``tokens.json``, either layout), or an
    Arrow/Parquet dataset (file, directory, glob) with column ``field``."""
    from stallfree.storage import remote
    from stallfree.tokens.megatron import MegatronSource, prefix_of

    fs, path = remote.url_to_fs(source, **storage_options)
    prefix = prefix_of(path)
    data_file = path.endswith((".arrow", ".parquet"))
    if path.endswith(".idx") or (
        not data_file
        and remote.exists(fs, prefix + ".idx", shard=source)
        and remote.exists(fs, prefix + ".bin", shard=source)
    ):
        return MegatronSource(prefix_of(source), dtype=dtype, **storage_options)
    if path.endswith(".bin"):
        from stallfree.tokens.rawbin import RawBinSource

        return RawBinSource(source, dtype, eos=eos, **storage_options)
    if not data_file and not any(c in path for c in "*?["):
        from stallfree.tokens.token_dir import read_token_dir, refuse_bare_megatron

        written = read_token_dir(fs, path, source)
        if written is not None:
            return written.open(dtype=dtype, field=field, **storage_options)
        refuse_bare_megatron(fs, path, source)
    from stallfree.tokens.arrow_tokens import ArrowTokenSource

    return ArrowTokenSource(source, field=field, **storage_options)


class TokenDataset:
    """Map-style dataset of packed windows: ``ds[i]`` is a dict of int64 tensors of shape
    ``[seq_len]``: ``input_ids``, ``labels``, ``position_ids``, ``doc_ids``.

    ``source``: a path/URL (see ``open_tokens``) or an opened token source. ``eos``: a token
    inserted between documents (a raw ``.bin`` already holds its separators: there ``eos`` only
    marks where documents end). ``positions``: ``"window"`` or ``"document"``. ``labels``:
    ``"shifted"`` (``labels[i] = input_ids[i + 1]``: Megatron, nanoGPT, your own
    ``cross_entropy``) or ``"inputs"`` (``labels`` equal ``input_ids``: Hugging Face
    ``*ForCausalLM`` / ``Trainer``, which shift them again; see the module docstring).
    """

    def __init__(
        self,
        source: str | TokenSource,
        seq_len: int,
        *,
        dtype: Any = None,
        field: str = "input_ids",
        eos: int | None = None,
        positions: str = "window",
        labels: str = "shifted",
        **storage_options: Any,
    ) -> None:
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        if not isinstance(labels, str) or labels not in LABELS:
            raise ValueError(
                f"labels must be 'shifted' (labels[i] = input_ids[i + 1]: Megatron, nanoGPT, your own "
                f"cross_entropy) or 'inputs' (labels = input_ids: Hugging Face *ForCausalLM / Trainer, "
                f"which shift them), got {labels!r}"
            )
        if eos is not None and (not isinstance(eos, (int, np.integer)) or not 0 <= eos <= _INT64_MAX):
            raise ValueError(f"eos must be a token id in [0, 2**63), got {eos!r}")
        if isinstance(source, str):
            source = open_tokens(source, dtype=dtype, field=field, eos=eos, **storage_options)
        self.source = source
        self.seq_len = seq_len
        self.positions = positions
        self.labels = labels
        self.eos = None if eos is None else int(eos)
        joined = getattr(source, "eos", None) is not None  # a raw .bin's documents already end in eos
        self._sep = 1 if self.eos is not None and not joined else 0
        lengths = np.asarray(source.doc_lengths, np.int64)
        check_lengths(lengths, source.name)
        self.doc_lengths = lengths
        stream = lengths.copy()
        if self._sep and len(stream) > 1:
            stream[:-1] += 1  # the eos after every document but the last
        self.doc_starts = np.concatenate([[0], np.cumsum(stream)]).astype(np.int64)
        self.tokens = int(self.doc_starts[-1])
        if self.tokens <= seq_len:  # checked before anything seq_len long is allocated
            raise ValueError(
                f"seq_len {seq_len} is too long for {source.name}: its {self.tokens} tokens "
                f"({len(lengths)} documents{', eos between them' if self._sep else ''}) hold no "
                f"window; a window reads seq_len + 1 = {seq_len + 1} tokens (labels are inputs shifted by one)"
            )
        self._inner = self.doc_starts[1:-1]  # where documents 1.. start
        self._len = (self.tokens - 1) // seq_len

    @property
    def fingerprint(self) -> str:
        shifted = self.labels == "shifted"  # the default keeps the fingerprint (and caches) it always had
        return fingerprint_of(
            "tokens",
            self.source.fingerprint,
            self.seq_len,
            self.eos,
            self.positions,
            *(() if shifted else (self.labels,)),
        )

    @property
    def documents(self) -> int:
        return len(self.doc_lengths)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.get_many([index])[0]

    def _check(self, indices: Sequence[int]) -> np.ndarray:
        idx = np.fromiter((operator.index(i) for i in indices), np.int64, len(indices))
        idx = np.where(idx < 0, idx + self._len, idx)
        if len(idx) and (idx.min() < 0 or idx.max() >= self._len):
            bad = int(idx[(idx < 0) | (idx >= self._len)][0])
            raise IndexError(f"window {bad} out of range for {self._len} windows of {self.source.name}")
        return idx

    def get_many(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """Windows for ``indices``, built together: a few numpy operations for the whole batch."""
        arrays = self.windows(self._check(indices))
        keys = list(arrays)
        columns = [torch.from_numpy(arrays[k]).unbind(0) for k in keys]
        return [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)]

    def get_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The collated batch for ``indices`` (what ``default_collate(get_many(indices))`` gives),
        as four ``(len, seq_len)`` tensors: a loader can write each into its slot in one copy."""
        return {k: torch.from_numpy(v) for k, v in self.windows(self._check(indices)).items()}

    def windows(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """``(len(idx), seq_len)`` contiguous int64 arrays ``input_ids``, ``labels`` (as ``labels=``
        says), ``position_ids``, ``doc_ids``.

        A window is cut into segments, one per document it touches (``searchsorted`` twice per
        window); per-token ids are ``np.repeat`` of per-segment values over the whole block, laid
        out ``seq_len`` wide (only inputs carry ids: a document starting at the last label is an
        empty segment there), so nothing is sliced and copied again afterwards."""
        L, sep, starts = self.seq_len, self._sep, self.doc_starts
        width, rows = L + 1, len(idx)
        a = idx * L
        d0 = np.searchsorted(self._inner, a, "right")  # document holding each window's first token
        d1 = np.searchsorted(self._inner, a + L, "right")  # ... and its last
        nseg = d1 - d0 + 1
        row = np.repeat(np.arange(rows), nseg)
        first = np.cumsum(nseg) - nseg  # each row's first segment
        seg_doc = np.arange(len(row)) - np.repeat(first, nseg) + np.repeat(d0, nseg)
        col = np.maximum(starts[seg_doc] - a[row], 0)  # 0..L
        flat_start = row * L + col
        seg_len = np.diff(flat_start, append=rows * L)
        doc_ids = np.repeat(seg_doc, seg_len).reshape(rows, L)
        base = flat_start
        if self.positions == "document":
            base = flat_start - (a[row] + col - starts[seg_doc])  # a first segment starts mid-document
        position = (np.arange(rows * L) - np.repeat(base, seg_len)).reshape(rows, L)
        lo = a - d0 * sep  # flat index of the first non-eos token at or after the window's start
        if sep:
            # the eos after document d sits just before document d+1 starts
            at = starts[seg_doc + 1] - 1 - a[row]
            hit = (seg_doc < len(self.doc_lengths) - 1) & (at >= 0) & (at < width)
            is_eos = np.zeros(rows * width, bool)
            is_eos[row[hit] * width + at[hit]] = True
            count = width - np.bincount(row[hit], minlength=rows)
            tokens = np.full((rows, width), self.eos, np.int64)
            tokens.reshape(-1)[~is_eos] = self._gather(lo, count)
        else:
            tokens = self._gather(lo, np.full(rows, width, np.int64)).reshape(rows, width)
        inputs = np.ascontiguousarray(tokens[:, :L], np.int64)
        if self.labels == "inputs":
            labels = inputs.copy()  # not the same array: masking labels in place must leave inputs alone
        else:
            labels = np.ascontiguousarray(tokens[:, 1:], np.int64)
        return {"input_ids": inputs, "labels": labels, "position_ids": position, "doc_ids": doc_ids}

    def _gather(self, lo: np.ndarray, count: np.ndarray) -> np.ndarray:
        """Source tokens ``[lo[r], lo[r] + count[r])`` for every ``r``, back to back, in the
        source's dtype: one ``read_runs`` where the source has it (a local file: one ``pread``
        per window straight into one buffer; a remote one: one concurrent request), else each
        run read and joined."""
        src = self.source
        runs = getattr(src, "read_runs", None)
        if runs is not None:
            flat = runs(lo, count)
        else:
            chunks = [src.read(s, s + c) for s, c in zip(lo.tolist(), count.tolist(), strict=True)]
            flat = np.concatenate(chunks) if chunks else np.zeros(0, src.dtype)
        if flat.dtype == np.uint64:
            self._reject_wide(flat, lo, count)
        return flat

    def _reject_wide(self, flat: np.ndarray, lo: np.ndarray, count: np.ndarray) -> None:
        """uint64 ids >= 2**63 would wrap negative in the int64 windows: an error naming the
        file, document, id and (where known) byte offset instead. Rejected, not carried: torch
        has no uint64 arithmetic for embeddings, and no vocabulary has 2**63 entries, so such an
        id is a misread file (wrong dtype, or bytes that are not tokens)."""
        big = np.flatnonzero(flat > _INT64_MAX)
        if not len(big):
            return
        p = int(big[0])
        ends = np.cumsum(count)
        r = int(np.searchsorted(ends, p, "right"))
        token = int(lo[r]) + p - int(ends[r] - count[r])  # index in the source's flat run
        doc = int(np.searchsorted(np.cumsum(self.doc_lengths), token, "right"))
        locate = getattr(self.source, "locate", None)
        file, offset = locate(token) if locate is not None else (self.source.name, None)
        raise CorruptShardError(
            f"document {doc} holds token id {int(flat[p])} (token {token} of the source): uint64 ids "
            f"must be below 2**63 to fit the int64 windows (is the dtype right?)",
            shard=file,
            offset=offset,
        )

    def __repr__(self) -> str:
        return (
            f"TokenDataset({self.source!r}, seq_len={self.seq_len}, windows={self._len}, "
            f"documents={self.documents}, tokens={self.tokens}, labels={self.labels!r})"
        )


__all__ = ["LABELS", "POSITIONS", "TokenDataset", "open_tokens"]
