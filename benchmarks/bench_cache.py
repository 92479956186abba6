"""Cache benchmark, side by side in one run (issue 4).

A. Single node, decode-bound: real-photo JPEGs in local tar shards, each decoded with PIL and
   resized to a fixed 224x224x3 uint8 array. Epoch 1 (cold) reads shards and decodes; its decoded
   arrays go into a NodeCache (LMDB) under a decoded stage; epoch 2 (warm) reads them back.
   Reports samples/s of both and warm/cold (target >= 5x).
B. Raw-sample reads in random order: ClusterCache on a local redis-server vs reading the local
   tar shards directly (open_dataset.get_many), samples/s and ratio; for context also the same
   shards behind the loopback HTTP server with a per-request latency (remote storage).

    .venv/bin/python benchmarks/bench_cache.py [--images 384] [--batch 32] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from stallfree.cache.cluster import ClusterCache
from stallfree.cache.node import NodeCache
from stallfree.cache.readthrough import ReadStats, read_through
from stallfree.cache.server import RedisServer
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter
from stallfree.testing.httpserve import serve_directory
from stallfree.testing.images import jpeg_bytes

SIZE = 224


def decode(sample: dict) -> dict:
    """The decode-bound stage: JPEG -> RGB -> 224x224 uint8 (deterministic, so cacheable)."""
    img = Image.open(io.BytesIO(sample["jpg"])).convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    return {"__key__": sample["__key__"], "image": np.asarray(img), "cls": int(sample["cls"])}


class Decoded:
    """The dataset as the decoded stage sees it: same fingerprint, decoded samples."""

    def __init__(self, ds) -> None:
        self.ds = ds
        self.fingerprint = ds.fingerprint

    def __len__(self) -> int:
        return len(self.ds)

    def get_many(self, indices):
        return [decode(s) for s in self.ds.get_many(indices)]


def epoch(fn, n: int, batch: int, seed: int) -> tuple[float, int]:
    order = np.random.default_rng(seed).permutation(n)
    t0 = time.perf_counter()
    got = 0
    for start in range(0, n, batch):
        got += len(fn(order[start : start + batch]))
    return got / (time.perf_counter() - t0), got


class StageDecode:
    """A per-sample decode the loader may cache: its output is stored under ``cache_stage``."""

    cache_stage = "decoded-224"

    def __call__(self, sample: dict) -> dict:
        return decode(sample)


def loader_epochs(ds, path: Path, batch: int) -> dict:
    """Epoch 1 and 2 samples/s through stallfree.DataLoader(cache=NodeCache, decode=StageDecode())."""
    from stallfree.loader.dataloader import DataLoader

    cache = NodeCache(path, capacity_bytes=4 << 30)
    loader = DataLoader(
        ds, batch_size=batch, seed=0, cache=cache, decode=StageDecode(), collate_fn=lambda b: len(b)
    )
    rates = []
    for _ in range(2):
        t0 = time.perf_counter()
        n = sum(loader)
        rates.append(n / (time.perf_counter() - t0))
    return {
        "cold_samples_per_s": rates[0],
        "warm_samples_per_s": rates[1],
        "warm_over_cold": rates[1] / rates[0],
    }


def make_shards(root: Path, n: int) -> Path:
    images = jpeg_bytes(n, seed=0)  # ImageNet-like sizes: 500x375, 640x480, 375x500, 320x240
    with ShardWriter(root / "ds", format="tar", max_samples=128) as writer:
        for i, jpg in enumerate(images):
            writer.write({"__key__": f"s{i:06d}", "jpg": jpg, "cls": str(i % 10).encode()})
    return root / "ds"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=384)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--http-latency-ms", type=float, default=2.0, help="per-request latency of the HTTP row")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out: dict = {"images": args.images, "batch": args.batch}
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        root = Path(tmp)
        ds = open_dataset(str(make_shards(root, args.images)))
        n = len(ds)

        # A: decoded-sample cache on the node tier
        view = Decoded(ds)
        node = NodeCache(root / "node", capacity_bytes=4 << 30)
        stats = ReadStats()
        cold, _ = epoch(
            lambda idx: read_through(view, idx, node, "decoded-224", stats=stats), n, args.batch, 1
        )
        cold_reads = stats.storage_reads
        warm, _ = epoch(
            lambda idx: read_through(view, idx, node, "decoded-224", stats=stats), n, args.batch, 2
        )
        out["decode"] = {
            "cold_samples_per_s": cold,
            "warm_samples_per_s": warm,
            "warm_over_cold": warm / cold,
            "epoch1_storage_reads": cold_reads,
            "epoch2_storage_reads": stats.storage_reads - cold_reads,
        }

        # A through stallfree.DataLoader: decode= with a cache_stage, cache=NodeCache
        out["decode_loader"] = loader_epochs(ds, root / "node-loader", args.batch)

        # B: raw reads, cluster cache (local redis-server) vs local shards
        with RedisServer(workdir=root / "redis") as server:
            cluster = ClusterCache([server.url])
            read_through(ds, list(range(n)), cluster)  # fill
            shard_rate, _ = epoch(ds.get_many, n, args.batch, 3)
            cluster_rate, _ = epoch(lambda idx: read_through(ds, idx, cluster), n, args.batch, 3)
            shard_rate2, _ = epoch(ds.get_many, n, args.batch, 4)  # again, to bracket drift
            cstats = cluster.stats()
        with serve_directory(root, latency_s=args.http_latency_ms / 1000) as http:
            remote = open_dataset(f"{http.url}/ds")
            http_rate, _ = epoch(remote.get_many, n, args.batch, 3)
        shard_rate = (shard_rate + shard_rate2) / 2
        out["raw_reads"] = {
            "local_shards_samples_per_s": shard_rate,
            "cluster_cache_samples_per_s": cluster_rate,
            "cluster_over_shards": cluster_rate / shard_rate,
            "cluster_hit_rate": cstats["hit_rate"],
            "http_shards_samples_per_s": http_rate,
            "http_latency_ms": args.http_latency_ms,
            "mean_jpeg_bytes": int(np.mean([len(s["jpg"]) for s in ds.get_many(range(min(n, 64)))])),
        }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        d, r = out["decode"], out["raw_reads"]
        print(f"{n} real-photo JPEGs, batch {args.batch}, random order each epoch")
        print(f"A decode-bound (PIL decode+resize to {SIZE}x{SIZE}), NodeCache of decoded arrays:")
        print(
            f"  epoch 1 cold  {d['cold_samples_per_s']:9.0f} samples/s  (storage reads {d['epoch1_storage_reads']})"
        )
        print(
            f"  epoch 2 warm  {d['warm_samples_per_s']:9.0f} samples/s  (storage reads {d['epoch2_storage_reads']})"
        )
        print(f"  warm / cold   {d['warm_over_cold']:9.1f}x  (target >= 5x)")
        dl = out["decode_loader"]
        print(
            "  the same through stallfree.DataLoader(decode=<cache_stage>, cache=NodeCache, num_workers=0):"
        )
        print(
            f"  epoch 1 {dl['cold_samples_per_s']:.0f}, epoch 2 {dl['warm_samples_per_s']:.0f} samples/s: "
            f"{dl['warm_over_cold']:.1f}x"
        )
        print(f"B raw samples (~{r['mean_jpeg_bytes'] // 1000} KB JPEG each):")
        print(f"  local tar shards       {r['local_shards_samples_per_s']:9.0f} samples/s")
        print(f"  cluster cache (redis)  {r['cluster_cache_samples_per_s']:9.0f} samples/s")
        print(f"  cluster / shards       {r['cluster_over_shards']:9.2f}x")
        print(
            f"  (context: same shards over loopback HTTP, {r['http_latency_ms']:g} ms/request: "
            f"{r['http_shards_samples_per_s']:.0f} samples/s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
