"""One epoch from object storage (S3 API): stallfree beside WebDataset and MosaicML Streaming over
the same samples in the same bucket, requests and bytes counted at the server.

Starts the real moto S3 server (``stallfree.testing.s3serve``: moto's server mode in its own
process, on loopback, with a request log that records each response's bytes) and uploads one
dataset of ``--samples`` samples (a ``--sample-kb`` KB random payload ``bin`` plus a ``cls``
label) twice:
  s3://bench/wds   WebDataset tars with our ``.idx`` files and ``manifest.json``, written by
                   ``stallfree shard FOLDER s3://bench/wds`` (the CLI, credentials and endpoint in
                   the standard AWS variables)
  s3://bench/mds   the same samples as a Streaming MDS dataset, written by ``streaming.MDSWriter``
Both with shards of ``--shard-mb`` MB. Then, rounds interleaved (each round runs every reader
once, in turn, from cold: open the dataset, read one shuffled epoch of raw samples, no decode),
through a ``torch`` DataLoader of ``--workers`` worker processes and batches of ``--batch``:
  stallfree-block   ``stallfree.DataLoader(open_dataset("s3://bench/wds"))``: order="auto", which
                    is "block" for remote data (shards shuffled, samples shuffled inside windows of
                    8 shards), one ranged GET per sample (neighbours merged)
  stallfree-global  the same with order="global" (a permutation of the whole dataset)
  webdataset        ``webdataset.WebDataset`` over the same tars (shards shuffled, split over the
                    workers, a 1000-sample shuffle buffer), presigned URLs read through its own
                    http handler (curl: one streaming GET per shard)
  streaming         ``streaming.StreamingDataset(remote="s3://bench/mds", shuffle=True)``: whole
                    shards downloaded with boto3 into a fresh local cache each round
Per reader: samples/s (median round), GETs per sample and response bytes per sample (every
request the server received during the run: index, manifest and listing reads included), each
also as a ratio to the best of the two peers (webdataset, streaming).

moto is a Python server: it answers a ranged GET by reading the whole object first, so its
latency grows with the shard size, which real S3 does not do; samples/s here is a property of
this server as much as of the readers. GETs and bytes per sample are what a real bucket would
bill and carry.

    bash benchmarks/env.sh
    .venv-bench/bin/python benchmarks/bench_s3.py --samples 2000 --sample-kb 100 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from stallfree import DataLoader as SFDataLoader
from stallfree.shards.open import open_dataset
from stallfree.testing.s3serve import S3Server, serve_s3

BUCKET = "bench"
PEERS = ("webdataset", "streaming")


def make_source(root: Path, n: int, size: int) -> int:
    """A folder of ``KEY.bin`` + ``KEY.cls`` files (``stallfree shard``'s "files" source); returns
    the payload bytes."""
    root.mkdir(parents=True)
    block = os.urandom(size + 4096)
    for i in range(n):
        off = (i * 61) % 4096
        (root / f"s{i:06d}.bin").write_bytes(block[off : off + size])
        (root / f"s{i:06d}.cls").write_bytes(str(i % 10).encode())
    return n * size


def upload_wds(s3: S3Server, src: Path, shard_mb: int) -> list[str]:
    """``stallfree shard`` to s3:// (a subprocess, as a user runs it); returns the tar keys."""
    env = {**os.environ, **s3.env}
    cmd = [sys.executable, "-m", "stallfree", "shard", str(src), f"s3://{BUCKET}/wds"]
    cmd += ["--max-bytes", f"{shard_mb}MB", "--no-progress", "--json"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"stallfree shard failed: {r.stderr[-2000:]}")
    fs = s3.filesystem()
    return sorted(p for p in fs.ls(f"{BUCKET}/wds", detail=False) if p.endswith(".tar"))


def upload_mds(src: Path, n: int, shard_mb: int) -> None:
    """The same samples, same order, with ``streaming.MDSWriter`` straight to s3:// (it writes each
    shard locally, then uploads it with boto3 to ``S3_ENDPOINT_URL``)."""
    from streaming import MDSWriter

    with MDSWriter(
        out=f"s3://{BUCKET}/mds",
        columns={"key": "str", "bin": "bytes", "cls": "int"},
        size_limit=shard_mb * 1_000_000,
        compression=None,
        progress_bar=False,
    ) as w:
        for i in range(n):
            key = f"s{i:06d}"
            cls = int((src / f"{key}.cls").read_text())
            w.write({"key": key, "bin": (src / f"{key}.bin").read_bytes(), "cls": cls})


def _count(batch: Any) -> int:
    if isinstance(batch, dict):
        return len(batch["__key__"])
    return len(batch[0])


def stallfree_epoch(s3: S3Server, args: argparse.Namespace, order: str) -> int:
    ds = open_dataset(f"s3://{BUCKET}/wds", **s3.storage_options)
    # shuffle=True: without it order="auto" resolves to "sequential" (runs before this fix measured that)
    loader = SFDataLoader(
        ds,
        batch_size=args.batch,
        shuffle=True,
        num_workers=args.workers,
        order=order,
        seed=0,
        collate_fn=_keys_only,
    )
    n = sum(_count(b) for b in loader)
    del loader
    ds.close()
    return n


def _keys_only(samples: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """One collate for every reader: the batch's keys, labels and payloads as lists (no tensors:
    the payloads are raw bytes, and building tensors is not what is measured)."""
    return {
        "__key__": [s["__key__"] if "__key__" in s else s["key"] for s in samples],
        "cls": [s["cls"] for s in samples],
        "bin": [s["bin"] for s in samples],
    }


def webdataset_epoch(s3: S3Server, args: argparse.Namespace, tars: list[str]) -> int:
    import webdataset as wds

    fs = s3.filesystem()
    urls = [fs.url(t, expires=3600) for t in tars]  # presigned: plain https(http) GETs, signed
    ds = (
        wds.WebDataset(urls, shardshuffle=len(urls), seed=0, detshuffle=True)
        .shuffle(1000)
        .batched(args.batch, collation_fn=_keys_only, partial=True)
    )
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.workers)
    return sum(_count(b) for b in loader)


def streaming_epoch(s3: S3Server, args: argparse.Namespace, local: Path) -> int:
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = StreamingDataset(
        remote=f"s3://{BUCKET}/mds", local=str(local), shuffle=True, shuffle_seed=0, batch_size=args.batch
    )
    loader = torch.utils.data.DataLoader(
        ds, batch_size=args.batch, num_workers=args.workers, collate_fn=_keys_only
    )
    n = sum(_count(b) for b in loader)
    del loader, ds
    gc.collect()
    return n


def measure(s3: S3Server, run: Callable[[], int]) -> dict[str, float]:
    """One cold run: its wall time, and what the server received meanwhile."""
    s3.reset()
    t0 = time.perf_counter()
    n = run()
    seconds = time.perf_counter() - t0
    reqs = s3.requests()
    gets = [r for r in reqs if r.method == "GET"]
    return {
        "samples": n,
        "seconds": seconds,
        "requests": len(reqs),
        "gets": len(gets),
        "ranged_gets": sum(r.is_ranged_get for r in gets),
        "bytes": sum(r.bytes for r in reqs),
    }


def summarise(runs: dict[str, list[dict[str, float]]], n: int) -> dict[str, dict[str, float]]:
    out = {}
    for name, rs in runs.items():
        bad = [r["samples"] for r in rs if r["samples"] != n]
        if bad:
            raise RuntimeError(f"{name} read {bad} samples, the dataset holds {n}")
        out[name] = {
            "samples/s": statistics.median(n / r["seconds"] for r in rs),
            "seconds": statistics.median(r["seconds"] for r in rs),
            "GETs/sample": statistics.median(r["gets"] for r in rs) / n,
            "requests/sample": statistics.median(r["requests"] for r in rs) / n,
            "bytes/sample": statistics.median(r["bytes"] for r in rs) / n,
        }
    best_rate = max(out[p]["samples/s"] for p in PEERS)
    best_gets = min(out[p]["GETs/sample"] for p in PEERS)
    best_bytes = min(out[p]["bytes/sample"] for p in PEERS)
    for r in out.values():
        r["samples/s vs best peer"] = r["samples/s"] / best_rate
        r["GETs vs best peer"] = r["GETs/sample"] / best_gets
        r["bytes vs best peer"] = r["bytes/sample"] / best_bytes
    return out


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--sample-kb", type=int, default=100)
    ap.add_argument("--shard-mb", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(list(argv) if argv is not None else None)

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_s3_") as tmp, serve_s3() as s3:
        # the process's own AWS settings (benchmark = CLI edge): streaming and boto3 read these
        os.environ.update(s3.env)
        os.environ["S3_ENDPOINT_URL"] = s3.endpoint_url
        s3.create_bucket(BUCKET)
        src = Path(tmp) / "src"
        payload = make_source(src, args.samples, args.sample_kb * 1000)
        t0 = time.perf_counter()
        tars = upload_wds(s3, src, args.shard_mb)
        upload_mds(src, args.samples, args.shard_mb)
        shutil.rmtree(src)
        t_upload = time.perf_counter() - t0
        n = len(open_dataset(f"s3://{BUCKET}/wds", **s3.storage_options))
        mds_shards = [p for p in s3.filesystem().ls(f"{BUCKET}/mds", detail=False) if p.endswith(".mds")]

        readers: dict[str, Callable[[int], Callable[[], int]]] = {
            "stallfree-block": lambda r: lambda: stallfree_epoch(s3, args, "auto"),
            "stallfree-global": lambda r: lambda: stallfree_epoch(s3, args, "global"),
            "webdataset": lambda r: lambda: webdataset_epoch(s3, args, tars),
            "streaming": lambda r: lambda: streaming_epoch(s3, args, Path(tmp) / f"mds-cache-{r}"),
        }
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in readers}
        for r in range(args.rounds):
            names = list(readers)
            names = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
            for name in names:
                runs[name].append(measure(s3, readers[name](r)))
        results = summarise(runs, n)
    meta = {
        "samples": n,
        "sample_bytes": args.sample_kb * 1000,
        "payload_bytes": payload,
        "tar_shards": len(tars),
        "mds_shards": len(mds_shards),
        "shard_mb": args.shard_mb,
        "workers": args.workers,
        "batch": args.batch,
        "rounds": args.rounds,
        "upload_s": t_upload,
        "total_s": time.perf_counter() - t_start,
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
    }
    if args.json:
        print(json.dumps({"meta": meta, "results": results, "runs": runs}, indent=1))
        return 0
    print(
        f"{n} samples x {args.sample_kb} KB from moto S3 on loopback: {len(tars)} tar / {len(mds_shards)} MDS "
        f"shards of ~{args.shard_mb} MB; {args.workers} workers, batch {args.batch}; median of "
        f"{args.rounds} interleaved rounds; load average {meta['load_avg'][0]:.1f}"
    )
    head = f"{'reader':<17} {'samples/s':>9} {'x best':>7} {'GETs/sample':>11} {'x best':>7} {'KB/sample':>9} {'x best':>7}"
    print(head)
    for name, r in results.items():
        print(
            f"{name:<17} {r['samples/s']:>9.0f} {r['samples/s vs best peer']:>7.2f} "
            f"{r['GETs/sample']:>11.3f} {r['GETs vs best peer']:>7.2f} "
            f"{r['bytes/sample'] / 1000:>9.1f} {r['bytes vs best peer']:>7.2f}"
        )
    print(f"(upload {t_upload:.0f} s, whole run {meta['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
