"""Bench data on demand: real-photo JPEG samples written as tar shards with a manifest (what
tests, benchmarks and the demo bench run on; nothing binary is committed)."""

from __future__ import annotations

from pathlib import Path


def write_jpeg_shards(
    root: str | Path,
    n: int,
    *,
    per_shard: int = 64,
    size: tuple[int, int] = (160, 120),
    classes: int = 10,
    seed: int = 0,
    quality: int = 90,
) -> Path:
    """Write ``n`` samples (``jpg``, ``cls``) into tar shards of ``per_shard`` under ``root``."""
    from stallfree.shards.writer import ShardWriter
    from stallfree.testing.images import jpeg_bytes

    if n <= 0 or per_shard <= 0:
        raise ValueError(f"need positive sample and shard counts, got n={n}, per_shard={per_shard}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with ShardWriter(str(root), format="tar", max_samples=per_shard) as writer:
        for i, jpg in enumerate(jpeg_bytes(n, seed=seed, sizes=(size,), quality=quality)):
            writer.write({"__key__": f"{i:08d}", "jpg": jpg, "cls": str(i % classes).encode()})
    return root
