"""One bucket, a real round trip away: stallfree beside WebDataset, MosaicML Streaming, LitData and
Amazon's s3torchconnector, over the same samples, requests and bytes counted at the server.

The bucket is ``s3rver`` (a ranged GET costs what it returns; moto reads the whole object per
ranged GET, see ``bench_s3_server.py``) in a NetLab storage namespace, behind a counting proxy
that holds every byte for the ``--delays`` value in each direction, one port per delay
(``s3lab.S3Lab``; ``--rig two-hop``: a latency relay in front of the proxy instead, as the first
runs were made); this process re-runs itself in node0, so every request pays the round trip.
The dataset (``--samples`` x ``--sample-kb`` KB random ``bin`` + ``cls``) is uploaded once per
format, shards of ``--shard-mb`` MB:
  s3://bench/wds   tars + .idx + manifest by ``stallfree shard FOLDER s3://bench/wds --no-shuffle``
  s3://bench/mds   ``streaming.MDSWriter``
  s3://bench/lit   ``litdata.optimize`` to a local folder, then uploaded as it is
Readers, each one DataLoader of ``--workers`` workers, batch ``--batch``, two epochs: cold (open
included, fresh local caches) and warm (the same loader's next epoch; local caches kept):
  stallfree-block   ``stallfree.DataLoader(open_dataset(s3://bench/wds), shuffle=True)``: order
                    "auto" = "block" for remote data (shards shuffled, samples inside windows of 8),
                    and with it staging (each shard fetched whole, once per node, into a local
                    directory: here the reader's fresh scratch folder, so "cold" is cold)
  webdataset        ``webdataset.WebDataset`` over presigned URLs (shards shuffled, 1000-sample buffer)
  streaming         ``streaming.StreamingDataset(remote=s3://bench/mds, shuffle=True)``
  litdata           ``litdata.StreamingDataset(s3://bench/lit, shuffle=True)``
  s3torchconnector  ``S3IterableDataset.from_objects`` of the tars (shuffled per epoch, sharded
                    over workers) + webdataset's tar expander and a 1000-sample buffer
Per reader and epoch: samples/s, seconds to the first batch, GETs, requests and response bytes per
sample at the server, and two shuffle figures (so nobody wins by not shuffling): distinct tar
shards per batch (of the stallfree layout; a sequential reader scores 1) and Spearman's rank
correlation between delivery order and storage order (0 for a perfect shuffle, 1 sequential).
Every epoch must deliver every sample exactly once. ``--runs N`` repeats every reader N times
(runs interleaved: run 1 of every reader, then run 2, ...) and reports each figure's median.

``--variant raw decode`` (default ``raw``) picks the tables: ``raw`` is the above; ``decode``
uploads ``--samples`` ImageNet-like JPEGs (``jpg`` + ``cls``, cached in ``--jpeg-cache``) under
s3://bench/jpg/{wds,mds,lit} and every reader decodes them with its fastest recipe to the same
output, uint8 [N, 3, 224, 224] random-resized-crop 224 + flip (``s3_decode_variant.py``): ours
``ImageDecode(backend="auto", dtype="uint8")``, every peer simplejpeg + torchvision v2 in its
loader's workers. Both variants in one run: one table each, same columns.

    bash benchmarks/env.sh s3   # once: .venv-s3bench with every peer, and s3rver
    PYTHONPATH=. .venv-s3bench/bin/python benchmarks/bench_s3_netns.py --delays 0 10 25 --runs 3
    PYTHONPATH=. .venv-s3bench/bin/python benchmarks/bench_s3_netns.py --variant raw decode --runs 3
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import s3_decode_variant
from s3lab import RIGS, S3Lab, aws_env, requests_log, storage_options

BUCKET = "bench"
READERS = ("stallfree-block", "webdataset", "streaming", "litdata", "s3torchconnector")
VARIANTS = ("raw", "decode")
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Variant:
    """One table's data and output: where its formats live in the bucket (``prefix`` + wds/mds/
    lit), the payload's field (and file extension), and whether readers decode it."""

    name: str
    prefix: str
    field: str

    @property
    def decode(self) -> bool:
        return self.name == "decode"

    def collate(self) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
        """The peers' collate: raw keys/labels/payloads, or simplejpeg + crop/flip, stacked."""
        return s3_decode_variant.SimplejpegCropCollate() if self.decode else _keys_only


VARIANT = {"raw": Variant("raw", "", "bin"), "decode": Variant("decode", "jpg/", "jpg")}


# -- data --------------------------------------------------------------------------------------------
def make_source(root: Path, n: int, size: int) -> None:
    root.mkdir(parents=True)
    block = os.urandom(size + 4096)
    for i in range(n):
        off = (i * 61) % 4096
        (root / f"s{i:06d}.bin").write_bytes(block[off : off + size])
        (root / f"s{i:06d}.cls").write_bytes(str(i % 10).encode())


def _sample(src: Path, i: int, field: str = "bin") -> dict[str, Any]:
    key = f"s{i:06d}"
    return {
        "key": key,
        field: (src / f"{key}.{field}").read_bytes(),
        "cls": int((src / f"{key}.cls").read_text()),
    }


def upload(src: Path, tmp: Path, n: int, shard_mb: int, endpoint: str, variant: Variant) -> dict[str, Any]:
    import s3fs

    env = {**os.environ, **aws_env(endpoint)}
    fs = s3fs.S3FileSystem(**storage_options(endpoint))
    if not fs.exists(BUCKET):
        fs.call_s3("create_bucket", Bucket=BUCKET)
    base = f"{BUCKET}/{variant.prefix}"
    cmd = [sys.executable, "-m", "stallfree", "shard", str(src), f"s3://{base}wds"]
    # --no-shuffle: storage order = key order in every format, so the shuffle figures compare alike
    cmd += ["--max-bytes", f"{shard_mb}MB", "--no-progress", "--json", "--no-shuffle"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"stallfree shard failed: {r.stderr[-2000:]}")
    from streaming import MDSWriter

    with MDSWriter(
        out=f"s3://{base}mds", columns={"key": "str", variant.field: "bytes", "cls": "int"},
        size_limit=shard_mb * 1_000_000, compression=None, progress_bar=False,
    ) as w:  # fmt: skip
        for i in range(n):
            w.write(_sample(src, i, variant.field))
    import litdata

    lit = tmp / "lit"
    # optimize() sets the process's start method to "spawn" for good (force=True), which every
    # reader's DataLoader below would then inherit: put back the platform's default afterwards
    start_method = multiprocessing.get_start_method()
    litdata.optimize(
        fn=_lit_item, inputs=[(str(src), i, variant.field) for i in range(n)], output_dir=str(lit),
        chunk_bytes=f"{shard_mb}MB", num_workers=1, mode="overwrite",
    )  # fmt: skip
    multiprocessing.set_start_method(start_method, force=True)
    fs.put(str(lit) + "/", f"{base}lit/", recursive=True)
    shutil.rmtree(lit)
    fs.invalidate_cache()
    tars = sorted(p for p in fs.ls(f"{base}wds", detail=False) if p.endswith(".tar"))
    return {"tars": tars, "mds": len([p for p in fs.ls(f"{base}mds", detail=False) if p.endswith(".mds")]),
            "lit": len([p for p in fs.ls(f"{base}lit", detail=False) if p.endswith(".bin")])}  # fmt: skip


def _lit_item(job: tuple[str, int, str]) -> dict[str, Any]:
    return _sample(Path(job[0]), job[1], job[2])


# -- readers: each a function (endpoint, args, scratch, variant) -> an iterable of epochs ---------
def _keys_only(samples: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {
        "__key__": [s["__key__"] if "__key__" in s else s["key"] for s in samples],
        "cls": [s["cls"] for s in samples],
        "bin": [s["bin"] for s in samples],
    }


def stallfree_loader(endpoint: str, args: argparse.Namespace, scratch: Path, variant: Variant) -> Any:
    from stallfree import DataLoader
    from stallfree.shards.open import open_dataset

    ds = open_dataset(f"s3://{BUCKET}/{variant.prefix}wds", **storage_options(endpoint))
    # decode: ImageDecode makes the batch (its own collate); raw: the same collate as the peers
    output = {"decode": s3_decode_variant.image_decode()} if variant.decode else {"collate_fn": _keys_only}
    # shuffle=True, as torch's: without it order "auto" is "sequential" (the old bench_s3.py's slip);
    # staging in the scratch folder: the default (the node's temp dir) would outlive the reader
    return DataLoader(ds, batch_size=args.batch, shuffle=True, num_workers=args.workers, seed=0,
                      persistent_workers=True, staging=str(scratch / "stage"), **output)  # fmt: skip


def webdataset_loader(endpoint: str, args: argparse.Namespace, scratch: Path, variant: Variant) -> Any:
    import s3fs
    import torch
    import webdataset as wds

    fs = s3fs.S3FileSystem(**storage_options(endpoint))
    tars = sorted(p for p in fs.ls(f"{BUCKET}/{variant.prefix}wds", detail=False) if p.endswith(".tar"))
    urls = [fs.url(t, expires=3600) for t in tars]
    ds = (
        wds.WebDataset(urls, shardshuffle=len(urls), seed=0, detshuffle=True, empty_check=False)
        .shuffle(1000)
        .batched(args.batch, collation_fn=variant.collate(), partial=True)
    )
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.workers, persistent_workers=True)


def streaming_loader(endpoint: str, args: argparse.Namespace, scratch: Path, variant: Variant) -> Any:
    import torch
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = StreamingDataset(remote=f"s3://{BUCKET}/{variant.prefix}mds", local=str(scratch / "mds"), shuffle=True,
                          shuffle_seed=0, batch_size=args.batch)  # fmt: skip
    return torch.utils.data.DataLoader(ds, batch_size=args.batch, num_workers=args.workers,
                                       collate_fn=variant.collate(), persistent_workers=True)  # fmt: skip


def litdata_loader(endpoint: str, args: argparse.Namespace, scratch: Path, variant: Variant) -> Any:
    import litdata
    from litdata.streaming import downloader

    # LitData hands obstore fixed client options without allow_http, so an http:// endpoint fails
    # with reqwest's BadScheme whatever the environment says; set it in place (workers fork it)
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
    opts = {"endpoint_url": endpoint, "aws_access_key_id": "S3RVER", "aws_secret_access_key": "S3RVER"}
    ds = litdata.StreamingDataset(
        f"s3://{BUCKET}/{variant.prefix}lit", shuffle=True, seed=0, storage_options=opts,
        cache_dir=str(scratch / "lit-cache"),
    )  # fmt: skip
    return litdata.StreamingDataLoader(
        ds, batch_size=args.batch, num_workers=args.workers, collate_fn=variant.collate()
    )


class _S3TorchTars:
    """s3torchconnector's iterable of tar objects, reshuffled per epoch, expanded into samples by
    webdataset's tar parser, through a 1000-sample buffer (its documented webdataset pairing)."""

    def __init__(self, endpoint: str, tars: list[str], batch: int, variant: Variant) -> None:
        self.endpoint, self.tars, self.batch, self.epoch = endpoint, tars, batch, 0
        self.field, self.collate = variant.field, variant.collate()

    def __iter__(self):
        import webdataset as wds
        from s3torchconnector import S3ClientConfig, S3IterableDataset

        uris = list(self.tars)
        random.Random(self.epoch).shuffle(uris)
        self.epoch += 1
        objs = S3IterableDataset.from_objects(
            uris, region="us-east-1", endpoint=self.endpoint, enable_sharding=True,
            s3client_config=S3ClientConfig(force_path_style=True),
        )  # fmt: skip
        streams = ({"url": o.key, "stream": o} for o in objs)
        samples = wds.tariterators.group_by_keys(wds.tariterators.tar_file_expander(streams))
        buf = wds.filters.shuffle(1000)(
            {"key": s["__key__"].rsplit("/", 1)[-1], self.field: s[self.field], "cls": int(s["cls"])}
            for s in samples
        )
        chunk = []
        for s in buf:
            chunk.append(s)
            if len(chunk) == self.batch:
                yield self.collate(chunk)
                chunk = []
        if chunk:
            yield self.collate(chunk)


def s3torch_loader(endpoint: str, args: argparse.Namespace, scratch: Path, variant: Variant) -> Any:
    import s3fs
    import torch

    fs = s3fs.S3FileSystem(**storage_options(endpoint))
    tars = [
        f"s3://{p}"
        for p in sorted(fs.ls(f"{BUCKET}/{variant.prefix}wds", detail=False))
        if p.endswith(".tar")
    ]
    return torch.utils.data.DataLoader(
        _Iter(_S3TorchTars(endpoint, tars, args.batch, variant)), batch_size=None, num_workers=args.workers
    )


class _Iter(__import__("torch").utils.data.IterableDataset):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __iter__(self):
        return iter(self.inner)


LOADERS: dict[str, Callable[[str, argparse.Namespace, Path, Variant], Any]] = {
    "stallfree-block": stallfree_loader,
    "webdataset": webdataset_loader,
    "streaming": streaming_loader,
    "litdata": litdata_loader,
    "s3torchconnector": s3torch_loader,
}


# -- measurement -------------------------------------------------------------------------------------
def shuffle_quality(batches: list[list[str]], shard_of: np.ndarray) -> dict[str, float]:
    idx = np.array([int(k[1:]) for b in batches for k in b])
    per_batch = [len({int(shard_of[int(k[1:])]) for k in b}) for b in batches if b]
    pos = np.arange(len(idx), dtype=float)
    rank = np.argsort(np.argsort(idx)).astype(float)
    rho = float(np.corrcoef(pos, rank)[0, 1]) if len(idx) > 1 else 1.0
    return {"shards/batch": float(np.mean(per_batch)), "rank corr": rho}


RIG_MARKERS = ("s3rver", "s3lab.py count", "stallfree.testing.netlab relay")  # the bucket's processes
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this reader's process tree ("client": this process and its
    descendants, a loader's workers) and of the rig (s3rver, counter, relays: they share the
    machine's cores with the reader, where a real bucket would not). From /proc, whose pid
    namespace the network namespaces share."""
    procs: dict[int, tuple[int, float, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        fields = stat.rsplit(")", 1)[1].split()
        # utime + stime, and cutime + cstime: workers that ended and were waited for count too
        procs[int(entry)] = (int(fields[1]), sum(map(int, fields[11:15])) / _TICK, cmd)
    ours = {os.getpid()}
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _, _) in procs.items():
            if ppid in ours and pid not in ours:
                ours.add(pid)
                grew = True
    return {
        "client": sum(procs[p][1] for p in ours if p in procs),
        "rig": sum(cpu for _, cpu, cmd in procs.values() if any(m in cmd for m in RIG_MARKERS)),
    }


def _write_timeline(path: Path, row: dict, log: list[dict], wall0: float, first: float, sec: float) -> None:
    """Append one epoch's requests to ``path`` (JSON lines), times in seconds from the loader's
    construction (cold) or the epoch's start (warm): where a first batch's wait goes."""
    reqs = [
        {"start": r["start"] - wall0, "end": r["end"] - wall0, "method": r["method"], "path": r["path"],
         "range": r["range"], "bytes": r["bytes"]}
        for r in sorted(log, key=lambda r: r["start"])
    ]  # fmt: skip
    with path.open("a") as f:
        keys = ("variant", "reader", "epoch")
        f.write(
            json.dumps(
                {**{k: row[k] for k in keys}, "first batch s": first, "epoch s": sec, "requests": reqs}
            )
            + "\n"
        )


def run_reader(
    name: str,
    variant: Variant,
    endpoint: str,
    setup: str,
    args: argparse.Namespace,
    n: int,
    shard_of: np.ndarray,
) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as scratch:
        requests_log(setup, clear=True)
        t0, wall0 = time.perf_counter(), time.time()
        cpu0 = cpu_seconds()
        loader = LOADERS[name](endpoint, args, Path(scratch), variant)
        for epoch in ("cold", "warm"):
            if epoch == "warm":
                requests_log(setup, clear=True)
                t0, wall0 = time.perf_counter(), time.time()
                cpu0 = cpu_seconds()
            if hasattr(loader, "set_epoch"):  # stallfree's loader, as a training loop calls it
                loader.set_epoch(1 if epoch == "warm" else 0)
            batches, first = [], None
            for b in loader:
                if first is None:
                    first = time.perf_counter() - t0
                if variant.decode:
                    s3_decode_variant.check_batch(b)
                batches.append(list(b["__key__"]))
            sec = time.perf_counter() - t0
            cpu = cpu_seconds()
            log = requests_log(setup)
            keys = [k for b in batches for k in b]
            if len(keys) != n or len(set(keys)) != n:
                raise RuntimeError(f"{name} {epoch}: {len(keys)} samples, {len(set(keys))} distinct, of {n}")
            out.append({
                "variant": variant.name, "reader": name, "epoch": epoch, "samples/s": n / sec, "first batch s": first,
                "GETs/sample": sum(r["method"] == "GET" for r in log) / n,
                "requests/sample": len(log) / n,
                "KB/sample": sum(r["bytes"] for r in log) / n / 1000,
                **shuffle_quality(batches, shard_of),
                "client CPU s": cpu["client"] - cpu0["client"], "rig CPU s": cpu["rig"] - cpu0["rig"],
            })  # fmt: skip
            if args.timeline:
                _write_timeline(Path(args.timeline), out[-1], log, wall0, first, sec)
        del loader
        gc.collect()
    return out


def _median(rs: list[dict]) -> dict:
    """One row of the runs' medians (and every run's samples/s, to show the spread)."""
    out = {k: rs[0][k] for k in ("variant", "reader", "epoch")}
    for k in rs[0]:
        if k not in out:
            out[k] = float(np.median([r[k] for r in rs]))
    out["runs samples/s"] = [round(r["samples/s"]) for r in rs]
    return out


def prepare(variant: Variant, args: argparse.Namespace, setup: str) -> dict[str, Any]:
    """Upload the variant's data set in every format; returns its figures and shard layout."""
    with tempfile.TemporaryDirectory(prefix="bench_s3_netns_") as tmp:
        if variant.decode:
            cache = Path(args.jpeg_cache)
            src = s3_decode_variant.jpeg_source(cache, args.samples)
            stats = s3_decode_variant.source_stats(cache)
        else:
            src = Path(tmp) / "src"
            make_source(src, args.samples, args.sample_kb * 1000)
            stats = {"images": args.samples, "mean_kb": float(args.sample_kb)}
        t0 = time.perf_counter()
        meta = upload(src, Path(tmp), args.samples, args.shard_mb, setup, variant)
        meta["upload_s"] = time.perf_counter() - t0
        meta["source"] = stats
    from stallfree.shards.open import open_dataset

    ds = open_dataset(f"s3://{BUCKET}/{variant.prefix}wds", **storage_options(setup))
    sizes = [s.samples for s in ds.manifest.shards]
    meta.update(samples=len(ds), tar_shards=len(sizes), tars=None)
    meta["shard_of"] = np.repeat(np.arange(len(sizes)), sizes)
    return meta


def inner(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    endpoints = json.loads(args.endpoints)
    setup = endpoints["0"]
    os.environ.update(aws_env(setup))
    variants = [VARIANT[v] for v in args.variant]
    metas = {v.name: prepare(v, args, setup) for v in variants}
    runs: dict[tuple[int, str, str, str], list[dict]] = {}
    failed: dict[tuple[int, str, str], str] = {}
    for ms in args.delays:
        os.environ.update(aws_env(endpoints[str(ms)]))
        for run in range(args.runs):
            for variant in variants:
                meta = metas[variant.name]
                for name in args.readers:
                    if (ms, variant.name, name) in failed:
                        continue
                    try:
                        for r in run_reader(
                            name, variant, endpoints[str(ms)], setup, args, meta["samples"], meta["shard_of"]
                        ):
                            runs.setdefault((ms, variant.name, name, r["epoch"]), []).append(r)
                    except Exception as exc:  # noqa: BLE001 - one peer failing is a row, not the run
                        traceback.print_exc()
                        failed[(ms, variant.name, name)] = f"{type(exc).__name__}: {exc}"[:300].replace(
                            "\n", " "
                        )
                    sys.stderr.write(f"done {variant.name} {name} at {ms} ms, run {run + 1}\n")
    rows = [{"delay ms": ms, **_median(rs)} for (ms, _, _, _), rs in runs.items()]
    rows += [
        {"delay ms": ms, "variant": v, "reader": name, "epoch": "-", "error": e}
        for (ms, v, name), e in failed.items()
    ]
    for meta in metas.values():
        del meta["shard_of"]
    # the first variant's figures stay at the top level, where raw-only runs always put them
    print(json.dumps({"meta": {**metas[variants[0].name], "variants": metas}, "rows": rows}))
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--sample-kb", type=int, default=100)
    ap.add_argument("--shard-mb", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--delays", type=int, nargs="+", default=[10])
    ap.add_argument("--runs", type=int, default=1, help="runs per reader; figures are their medians")
    ap.add_argument("--readers", nargs="+", default=list(READERS), choices=READERS)
    ap.add_argument(
        "--variant",
        nargs="+",
        default=["raw"],
        choices=VARIANTS,
        help="raw: payload bytes as they are; decode: JPEGs, decoded + cropped by every reader",
    )
    ap.add_argument("--jpeg-cache", default=str(HERE / "out" / "s3_decode_jpegs"),
                    help="where the decode variant's JPEGs are written once and reused")  # fmt: skip
    ap.add_argument("--rig", default="one-hop", choices=RIGS,
                    help="one-hop: the counting proxy holds the delay; two-hop: a relay in front of it")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--timeline", help="append each epoch's request timeline (JSON lines) to this file")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--endpoints", help=argparse.SUPPRESS)
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.inner:
        return inner(args)
    t_start = time.perf_counter()
    with S3Lab(sorted({0, *args.delays}), rig=args.rig) as lab:
        endpoints = {str(ms): lab.endpoint(ms) for ms in lab.delays_ms}
        argv2 = [sys.executable, str(Path(__file__).resolve()), "--inner", "--endpoints", json.dumps(endpoints),
                 "--samples", str(args.samples), "--sample-kb", str(args.sample_kb), "--shard-mb", str(args.shard_mb),
                 "--workers", str(args.workers), "--batch", str(args.batch), "--delays", *map(str, args.delays),
                 "--runs", str(args.runs), "--variant", *args.variant, "--jpeg-cache", args.jpeg_cache,
                 "--readers", *args.readers,
                 *(["--timeline", str(Path(args.timeline).resolve())] if args.timeline else [])]  # fmt: skip
        done = lab.lab.run("node0", argv2, timeout=3600, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        return done.returncode
    res = json.loads(done.stdout.strip().splitlines()[-1])
    res["meta"]["total_s"] = time.perf_counter() - t_start
    res["meta"]["load_avg"] = os.getloadavg()
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    for name in args.variant:
        m = res["meta"]["variants"][name]
        src = m["source"]
        what = (
            f"ImageNet-like JPEGs (mean {src['mean_width']:.0f}x{src['mean_height']:.0f} px, {src['mean_kb']:.1f} KB), "
            "every reader decoding + RandomResizedCrop 224 + flip to uint8"
            if name == "decode"
            else f"x {args.sample_kb} KB raw"
        )
        print(
            f"[{name}] {m['samples']} samples {what}, s3rver, {args.rig} rig; {m['tar_shards']} tar / "
            f"{m['mds']} MDS / {m['lit']} LitData shards of ~{args.shard_mb} MB; {args.workers} workers, batch "
            f"{args.batch}; load average {res['meta']['load_avg'][0]:.1f}; upload {m['upload_s']:.0f} s, "
            f"run {res['meta']['total_s']:.0f} s"
        )
        print(
            "| delay ms | reader | epoch | samples/s | runs | first batch s | GETs/sample | KB/sample | shards/batch "
            "| rank corr | client CPU s | rig CPU s |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in res["rows"]:
            if r["variant"] != name:
                continue
            if "error" in r:
                print(f"| {r['delay ms']} | {r['reader']} | - | failed: {r['error']} ||||||||")
                continue
            print(
                f"| {r['delay ms']} | {r['reader']} | {r['epoch']} | {r['samples/s']:.0f} | "
                f"{', '.join(map(str, r['runs samples/s']))} | {r['first batch s']:.2f} | "
                f"{r['GETs/sample']:.3f} | {r['KB/sample']:.1f} | {r['shards/batch']:.1f} | {r['rank corr']:.3f} | "
                f"{r['client CPU s']:.2f} | {r['rig CPU s']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
