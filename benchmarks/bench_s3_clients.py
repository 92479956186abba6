"""Which S3 client should read s3:// ranges: s3fs (fsspec, aiobotocore), obstore (Rust
``object_store``) or boto3, for many concurrent ranged GETs, on one server one round trip away.

The server is ``s3rver`` in a NetLab storage namespace behind a counting proxy and a latency
relay (``s3lab.S3Lab``; ``--delay-ms`` each way); this process re-runs itself in node0. One object
of ``--object-mb`` MB; each trial reads ``--ranges`` ranges of ``--range-kb`` KB at random offsets
(one per ``object / ranges`` slot, so no two touch), ``--concurrency`` at a time:
  s3fs      ``fs._cat_file(path, start, end)`` under an asyncio semaphore (fsspec's own loop)
  obstore   ``obstore.get_range_async`` under an asyncio semaphore
  boto3     ``get_object(Range=...)`` in a thread pool of that many threads (max_pool_connections)
plus each library's own batched call, concurrency its own: ``s3fs.cat_ranges`` and
``obstore.get_ranges`` (which coalesces ranges less than 1 MiB apart: fewer, longer GETs).
Reported: MB/s of range payload (median of ``--trials``), and GETs and bytes at the server per
trial (from the proxy), so coalescing shows as fewer GETs, not as speed from nowhere.

``--parts``: what staging does instead: the whole object in ``--part-mb`` MB ranged GETs,
``--concurrency`` at once, written into a local file at their offsets, each client at its
leanest: stallfree's ``file_copy.copy_parts`` through s3fs (``direct=False``: ``read_parts``, then
``pwrite``) and through its direct route (presigned GETs, ``readinto`` + ``pwrite``,
``storage/s3direct.py``), obstore (``get_range_async``, its buffer written without a copy) and
boto3 (threads, ``Body.read()``). Reported: MB/s and this process's CPU ms per MiB (user + system,
every thread), the figure that matters where the reader shares its cores with training.

    .venv-s3bench/bin/python benchmarks/bench_s3_clients.py --delay-ms 10
    .venv-s3bench/bin/python benchmarks/bench_s3_clients.py --delay-ms 10 --parts --concurrency 8 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from s3lab import REGION, S3RVER_KEY, S3Lab, requests_log, storage_options

BUCKET, KEY = "clients", "object.bin"


def _boto(endpoint: str, pool: int = 10) -> Any:
    import boto3
    from botocore.config import Config

    cfg = Config(max_pool_connections=max(pool, 10), s3={"addressing_style": "path"})
    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=S3RVER_KEY, aws_secret_access_key=S3RVER_KEY,
        region_name=REGION, config=cfg,
    )  # fmt: skip


def _obstore(endpoint: str) -> Any:
    from obstore.store import S3Store

    return S3Store(
        BUCKET, endpoint=endpoint, access_key_id=S3RVER_KEY, secret_access_key=S3RVER_KEY,
        region=REGION, virtual_hosted_style_request=False, client_options={"allow_http": True},
    )  # fmt: skip


def _s3fs(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**storage_options(endpoint))


def ranges_of(size: int, n: int, span: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    slot = size // n
    out = [(i * slot + (o := rng.randrange(0, slot - span)), i * slot + o + span) for i in range(n)]
    rng.shuffle(out)
    return out


def read_s3fs(fs: Any, ranges: list[tuple[int, int]], conc: int) -> list[bytes]:
    from fsspec.asyn import sync

    async def go() -> list[bytes]:
        sem = asyncio.Semaphore(conc)

        async def one(a: int, b: int) -> bytes:
            async with sem:
                return await fs._cat_file(f"{BUCKET}/{KEY}", start=a, end=b)

        return await asyncio.gather(*(one(a, b) for a, b in ranges))

    return sync(fs.loop, go)


def read_s3fs_batched(fs: Any, ranges: list[tuple[int, int]], conc: int) -> list[bytes]:
    p = f"{BUCKET}/{KEY}"
    return fs.cat_ranges([p] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges])


def read_obstore(store: Any, ranges: list[tuple[int, int]], conc: int) -> list[bytes]:
    import obstore

    async def go() -> list[bytes]:
        sem = asyncio.Semaphore(conc)

        async def one(a: int, b: int) -> bytes:
            async with sem:
                return bytes(await obstore.get_range_async(store, KEY, start=a, end=b))

        return await asyncio.gather(*(one(a, b) for a, b in ranges))

    return asyncio.run(go())


def read_obstore_batched(store: Any, ranges: list[tuple[int, int]], conc: int) -> list[bytes]:
    import obstore

    got = obstore.get_ranges(store, KEY, starts=[a for a, _ in ranges], ends=[b for _, b in ranges])
    return [bytes(g) for g in got]


def read_boto3(client: Any, ranges: list[tuple[int, int]], conc: int) -> list[bytes]:
    def one(r: tuple[int, int]) -> bytes:
        resp = client.get_object(Bucket=BUCKET, Key=KEY, Range=f"bytes={r[0]}-{r[1] - 1}")
        return resp["Body"].read()

    with ThreadPoolExecutor(conc) as pool:
        return list(pool.map(one, ranges))


def _parts(size: int, part: int) -> list[tuple[int, int]]:
    return [(a, min(size, a + part)) for a in range(0, size, part)]


def copy_stallfree(direct: bool) -> Any:
    def copy(endpoint: str, size: int, part: int, conc: int, fd: int) -> None:
        from stallfree.storage import file_copy, remote

        fs, path = remote.url_to_fs(f"s3://{BUCKET}/{KEY}", **storage_options(endpoint))
        file_copy.copy_parts(fs, path, size, fd, shard=KEY, part_bytes=part, concurrency=conc, direct=direct)

    return copy


def copy_obstore(endpoint: str, size: int, part: int, conc: int, fd: int) -> None:
    import obstore

    store = _CLIENTS.setdefault("obstore", _obstore(endpoint))

    async def go() -> None:
        sem = asyncio.Semaphore(conc)

        async def one(a: int, b: int) -> None:
            async with sem:
                buf = await obstore.get_range_async(store, KEY, start=a, end=b)
            os.pwrite(fd, memoryview(buf), a)

        await asyncio.gather(*(one(a, b) for a, b in _parts(size, part)))

    asyncio.run(go())


def copy_boto3(endpoint: str, size: int, part: int, conc: int, fd: int) -> None:
    client = _CLIENTS.setdefault(f"boto3-{conc}", _boto(endpoint, conc))

    def one(r: tuple[int, int]) -> None:
        body = client.get_object(Bucket=BUCKET, Key=KEY, Range=f"bytes={r[0]}-{r[1] - 1}")["Body"].read()
        os.pwrite(fd, body, r[0])

    with ThreadPoolExecutor(conc) as pool:
        list(pool.map(one, _parts(size, part)))


_CLIENTS: dict[str, Any] = {}  # made once per process, as a reader keeps its client


def staging_parts(args: argparse.Namespace, payload: bytes) -> list[dict[str, Any]]:
    """``--parts``: the whole object into a file per trial, by each client; MB/s, CPU ms/MiB."""
    import tempfile

    size, part = len(payload), args.part_mb << 20
    clients = {
        "stallfree s3fs (read_parts)": copy_stallfree(direct=False),
        "stallfree direct (presigned, readinto)": copy_stallfree(direct=True),
        "obstore": copy_obstore,
        "boto3": copy_boto3,
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for conc in args.concurrency:
            for name, copy in clients.items():
                path = os.path.join(tmp, "copy")
                with open(path, "w+b") as f:
                    copy(args.endpoint, size, part, conc, f.fileno())  # connect, sign, warm
                times, cpus = [], []
                for _ in range(args.trials):
                    os.unlink(path)
                    with open(path, "w+b") as f:
                        t0, c0 = time.perf_counter(), time.process_time()
                        copy(args.endpoint, size, part, conc, f.fileno())
                        times.append(time.perf_counter() - t0)
                        cpus.append(time.process_time() - c0)
                    with open(path, "rb") as f:
                        if f.read() != payload:
                            raise RuntimeError(f"{name}: the copy differs from the object")
                sec, cpu = statistics.median(times), statistics.median(cpus)
                rows.append({"client": name, "concurrency": conc, "seconds": sec, "MB/s": size / sec / 1e6,
                             "CPU ms/MiB": cpu * 1000 / (size >> 20)})  # fmt: skip
    return rows


def inner(args: argparse.Namespace) -> int:
    endpoint, setup = args.endpoint, args.setup_endpoint
    size = args.object_mb << 20
    payload = os.urandom(size)
    b = _boto(setup)
    b.create_bucket(Bucket=BUCKET)
    b.put_object(Bucket=BUCKET, Key=KEY, Body=payload)
    if args.parts:
        print(json.dumps(staging_parts(args, payload)))
        return 0
    clients = {
        "s3fs": (lambda c: _s3fs(endpoint), read_s3fs),
        "obstore": (lambda c: _obstore(endpoint), read_obstore),
        "boto3": (lambda c: _boto(endpoint, c), read_boto3),
        "s3fs.cat_ranges": (lambda c: _s3fs(endpoint), read_s3fs_batched),
        "obstore.get_ranges": (lambda c: _obstore(endpoint), read_obstore_batched),
    }
    rows = []
    span = args.range_kb * 1000
    for conc in args.concurrency:
        for name, (make, read) in clients.items():
            if "." in name and conc != args.concurrency[0]:
                continue  # the batched calls choose their own concurrency: one row each
            client = make(conc)
            read(client, ranges_of(size, 4, span, 99), conc)  # connect, sign, warm
            times, gets, nbytes = [], [], []
            for t in range(args.trials):
                rs = ranges_of(size, args.ranges, span, t)
                requests_log(setup, clear=True)
                t0 = time.perf_counter()
                got = read(client, rs, conc)
                times.append(time.perf_counter() - t0)
                log = requests_log(setup)
                gets.append(sum(r["method"] == "GET" for r in log))
                nbytes.append(sum(r["bytes"] for r in log))
                for (a, e), g in zip(rs, got, strict=True):
                    if g != payload[a:e]:
                        raise RuntimeError(f"{name}: range {a}-{e} came back wrong")
            sec = statistics.median(times)
            rows.append(
                {"client": name, "concurrency": conc if "." not in name else "own", "seconds": sec,
                 "MB/s": args.ranges * span / sec / 1e6, "GETs": statistics.median(gets),
                 "server MB": statistics.median(nbytes) / 1e6}
            )  # fmt: skip
    print(json.dumps(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delay-ms", type=int, default=10)
    ap.add_argument("--object-mb", type=int, default=64)
    ap.add_argument("--ranges", type=int, default=64)
    ap.add_argument("--range-kb", type=int, default=100)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--parts", action="store_true", help="staging's whole-object part reads into a file")
    ap.add_argument("--part-mb", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--setup-endpoint", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inner:
        return inner(args)
    delays = sorted({0, args.delay_ms})
    with S3Lab(delays) as lab:
        argv2 = [sys.executable, str(Path(__file__).resolve()), "--inner",
                 "--endpoint", lab.endpoint(args.delay_ms), "--setup-endpoint", lab.endpoint(0),
                 "--object-mb", str(args.object_mb), "--ranges", str(args.ranges),
                 "--range-kb", str(args.range_kb), "--trials", str(args.trials),
                 "--part-mb", str(args.part_mb),
                 *(["--parts"] if args.parts else []),
                 "--concurrency", *map(str, args.concurrency)]  # fmt: skip
        done = lab.lab.run("node0", argv2, timeout=900, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        return done.returncode
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    load = os.getloadavg()[0]
    if args.parts:
        print(
            f"one {args.object_mb} MB object into a local file in {args.part_mb} MB ranged GETs, s3rver "
            f"{args.delay_ms} ms away each way; median of {args.trials}; load average {load:.1f}"
        )
        print("| client | concurrency | seconds | MB/s | CPU ms/MiB |\n|---|---:|---:|---:|---:|")
        for r in rows:
            cells = (r["client"], r["concurrency"], f"{r['seconds']:.3f}", f"{r['MB/s']:.0f}")
            print("| " + " | ".join(map(str, cells)) + f" | {r['CPU ms/MiB']:.2f} |")
        return 0
    print(
        f"{args.ranges} x {args.range_kb} KB ranged GETs of one {args.object_mb} MB object, s3rver "
        f"{args.delay_ms} ms away each way; median of {args.trials}; load average {load:.1f}"
    )
    print(f"{'client':<20} {'conc':>5} {'seconds':>8} {'MB/s':>7} {'GETs':>5} {'server MB':>9}")
    for r in rows:
        print(
            f"{r['client']:<20} {r['concurrency']!s:>5} {r['seconds']:>8.3f} {r['MB/s']:>7.1f} "
            f"{r['GETs']:>5.0f} {r['server MB']:>9.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
