"""Test data written by hand, independently of stallfree's writers."""

from __future__ import annotations

import struct

import numpy as np

CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint16": 8}


def write_megatron(prefix, docs, dtype="uint16", *, pointers=None, modes=False):
    """``prefix.bin`` + ``prefix.idx`` exactly as Megatron-LM's documented layout says, with
    struct.pack field by field (not our MegatronWriter)."""
    dt = np.dtype(dtype)
    lengths = [len(d) for d in docs]
    if pointers is None:
        pointers, at = [], 0
        for n in lengths:
            pointers.append(at)
            at += n * dt.itemsize
    with open(f"{prefix}.bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dt).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dt.name]))
        f.write(struct.pack("<Q", len(docs)))
        f.write(struct.pack("<Q", len(docs) + 1))
        for n in lengths:
            f.write(struct.pack("<i", n))
        for p in pointers:
            f.write(struct.pack("<q", p))
        for d in range(len(docs) + 1):
            f.write(struct.pack("<q", d))
        if modes:
            f.write(bytes(len(docs)))


def random_docs(seed=0, n=40, max_len=50, vocab=60000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(k)).tolist() for k in rng.integers(0, max_len, n)]


def stream_of(docs, eos=None):
    """(tokens, doc id, offset in doc) of the documents concatenated, eos between them."""
    tokens, doc_ids, offsets = [], [], []
    for i, d in enumerate(docs):
        tokens += list(d)
        doc_ids += [i] * len(d)
        offsets += list(range(len(d)))
        if eos is not None and i < len(docs) - 1:
            tokens.append(eos)
            doc_ids.append(i)
            offsets.append(len(d))
    return tokens, doc_ids, offsets


def check_windows(ds, docs, eos=None, positions="window"):
    """Every window against the stream built by hand: each token an input exactly once."""
    tokens, doc_ids, offsets = stream_of(docs, eos)
    L = ds.seq_len
    n = (len(tokens) - 1) // L
    assert len(ds) == n
    seen = []
    for i in range(n):
        s = ds[i]
        assert set(s) == {"input_ids", "labels", "position_ids", "doc_ids"}
        assert all(v.dtype.is_floating_point is False and str(v.dtype) == "torch.int64" for v in s.values())
        assert all(tuple(v.shape) == (L,) for v in s.values())
        assert s["input_ids"].tolist() == tokens[i * L : (i + 1) * L]
        assert s["labels"].tolist() == tokens[i * L + 1 : (i + 1) * L + 1]
        assert s["doc_ids"].tolist() == doc_ids[i * L : (i + 1) * L]
        want = offsets[i * L : (i + 1) * L]
        if positions == "window":
            want = [min(o, k) for k, o in enumerate(want)]
        assert s["position_ids"].tolist() == want
        seen += list(range(i * L, (i + 1) * L))
    assert seen == list(range(n * L))  # every stream position an input exactly once, in order
    return tokens


# The texts the tokenizer fixture (conftest.py) is trained on and tokenize tests write.
TEXTS = [f"the quick brown fox {i} jumps over the lazy dog {i * 7}" for i in range(40)] + ["", "ünïcödé"]
