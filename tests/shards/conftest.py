"""Shared fixtures for shard tests: small deterministic datasets written with our own writers."""

from __future__ import annotations

import pytest

from stallfree.shards.writer import ShardWriter


def make_samples(n: int, size: int = 1000, seed: int = 0) -> list[dict]:
    """``n`` samples with a binary payload of varying length, a ``cls`` label and a text field."""
    out = []
    for i in range(n):
        payload = bytes((i * 7 + j + seed) % 251 for j in range(size + (i * 37) % 300))
        out.append({"__key__": f"sample{i:05d}", "jpg": payload, "cls": i % 5, "txt": f"caption {i}"})
    return out


def tar_field(value) -> bytes:
    """What a tar member holds for a sample value (our writer's encoding)."""
    if isinstance(value, bytes):
        return value
    return str(value).encode()


@pytest.fixture
def samples() -> list[dict]:
    return make_samples(23)


@pytest.fixture
def tar_dataset(tmp_path, samples):
    """A 23-sample tar dataset in shards of 5 samples (5 shards, the last one short)."""
    root = tmp_path / "tards"
    with ShardWriter(str(root), format="tar", max_samples=5, classes=[f"c{i}" for i in range(5)]) as w:
        for s in samples:
            w.write(s)
    return root


@pytest.fixture
def arrow_dataset(tmp_path, samples):
    root = tmp_path / "arrowds"
    with ShardWriter(str(root), format="arrow", max_samples=5) as w:
        for s in samples:
            w.write(s)
    return root
