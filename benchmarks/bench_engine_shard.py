"""Sharding on engines, one run: ``stallfree shard`` local vs ``--engine ray`` vs ``--engine spark``
on this machine (the engines' overhead), and each engine's peer on the same input in the same
session: Ray Data's ``write_webdataset`` vs our ``write_ray``; MosaicML Streaming's
``dataframe_to_mds`` vs our ``write_spark``.

Inputs (made once under benchmarks/out/engine-bench): a Parquet table of small rows (id, a
caption of ~60-120 characters, a 64-byte embedding blob) and an ImageFolder of small real-photo
JPEGs (320x240, ~15 KB). Rows become Arrow shards in the engine comparison; JPEGs become tar
shards. The peers write their own formats (WebDataset tars; MDS), ours write tars (Arrow for the
table rows on Spark, MDS's closest), from the same materialised Ray Dataset / cached Spark
DataFrame, so the read of the source is not timed. Clusters: Ray, a head (no CPUs) and two worker
nodes of one CPU on 127.0.0.1 (``stallfree/testing/ray_cluster.py``); Spark
``local-cluster[2,1,1024]`` on 127.0.0.1 (``stallfree/testing/spark_cluster.py``). Figures:
samples/s (wall time of the write call, median of ``--repeats`` after one untimed warm-up call,
so no figure includes an engine's Python workers starting), output bytes, and the driver
process's peak RSS above its level before the call. Each engine's output is compared byte for
byte with the local run's. Run in .venv-engines (``scripts/engines_env.sh``: the MDS peer)::

    bash scripts/engines_env.sh
    .venv-engines/bin/python benchmarks/bench_engine_shard.py [--rows 200000] [--images 4000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

OUT = Path(__file__).resolve().parent / "out" / "engine-bench"


# -- inputs ---------------------------------------------------------------------------------------
def make_table(path: Path, rows: int) -> Path:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.exists() and pq.read_metadata(path).num_rows == rows:
        return path
    rng = np.random.default_rng(0)
    words = ["a", "photo", "of", "the", "cat", "dog", "red", "car", "on", "street", "in", "winter"]
    lengths = rng.integers(10, 20, rows)
    picks = rng.integers(0, len(words), (rows, 20))
    captions = [" ".join(words[j] for j in picks[i, : lengths[i]]) for i in range(rows)]
    blobs = rng.integers(0, 256, (rows, 64), dtype=np.uint8)
    table = pa.table(
        {
            "id": pa.array(np.arange(rows), pa.int64()),
            "caption": captions,
            "emb": pa.array([b.tobytes() for b in blobs], pa.binary()),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=50_000)
    return path


def make_images(root: Path, n: int) -> Path:
    from stallfree.testing.images import make_image_folder

    marker = root / f".complete-{n}"
    if marker.exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    make_image_folder(root, classes=10, per_class=n // 10, sizes=((320, 240), (240, 320)), quality=85)
    marker.write_text("")
    return root


# -- measuring --------------------------------------------------------------------------------------
class PeakRSS:
    """The driver's peak RSS while a call runs, above the level before it (sampled every 20 ms)."""

    def __enter__(self) -> PeakRSS:
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def mb(self) -> float:
        return (self.peak - self.base) / 1e6


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def tree(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


WARMUP = 1  # untimed calls first: each engine's Python workers start and import on the first task


def measure(name: str, samples: int, out: Path, repeats: int, call: Callable[[Path], Any]) -> dict[str, Any]:
    times, peaks = [], []
    for w in range(WARMUP):
        target = out / f"{name}-warmup{w}"
        shutil.rmtree(target, ignore_errors=True)
        call(target)
        shutil.rmtree(target, ignore_errors=True)
    for r in range(repeats):
        target = out / f"{name}-{r}"
        shutil.rmtree(target, ignore_errors=True)
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            call(target)
            times.append(time.perf_counter() - t0)
        peaks.append(rss.mb)
    last = out / f"{name}-{repeats - 1}"
    row = {
        "name": name,
        "samples": samples,
        "seconds": round(statistics.median(times), 3),
        "samples_per_s": round(samples / statistics.median(times)),
        "output_bytes": dir_bytes(last),
        "driver_peak_rss_mb": round(max(peaks), 1),
        "times": [round(t, 3) for t in times],
        "dir": str(last),
    }
    print(json.dumps({k: v for k, v in row.items() if k != "dir"}), file=sys.stderr, flush=True)
    return row


# -- phases -----------------------------------------------------------------------------------------
def engines_phase(args, table: Path, images: Path, out: Path, ray_ex: Any, spark_ex: Any) -> list[dict]:
    """shard_dataset: local (--workers 2) vs Ray vs Spark, same plan, byte-identical output."""
    from stallfree.shards.parallel import shard_dataset
    from stallfree.shards.sources.registry import open_source

    rows: list[dict] = []
    for label, src, fmt, limit in (
        ("rows->arrow", table, "arrow", {"max_samples": max(1, args.rows // 16)}),
        ("jpegs->tar", images, "tar", {"max_bytes": 8_000_000}),
    ):
        source = open_source(str(src))
        n = len(source.items())
        runs = {}
        for engine, executor, workers in (("local", None, 2), ("ray", ray_ex, 1), ("spark", spark_ex, 1)):
            name = f"{label} {engine}"
            runs[engine] = measure(
                name.replace(" ", "_").replace(">", ""),
                n,
                out,
                args.repeats,
                lambda d, fmt=fmt, limit=limit, src=src, workers=workers, executor=executor: shard_dataset(
                    str(src), str(d), format=fmt, workers=workers, executor=executor, **limit
                ),
            )
            runs[engine]["name"] = name
        base = tree(Path(runs["local"]["dir"]))
        for engine in ("ray", "spark"):
            runs[engine]["identical_to_local"] = tree(Path(runs[engine]["dir"])) == base
            runs[engine]["vs_local"] = round(
                runs[engine]["samples_per_s"] / runs["local"]["samples_per_s"], 2
            )
        rows += runs.values()
    return rows


def ray_phase(args, table: Path, images: Path, out: Path) -> list[dict]:
    import ray

    from stallfree.shards import write_ray

    rows: list[dict] = []
    table_ds = (  # write_webdataset takes str and bytes values only: the id as the key
        ray.data.read_parquet(str(table))
        .map(lambda r: {"__key__": f"{r['id']:09d}", "caption": r["caption"], "emb": r["emb"]})
        .repartition(4)
        .materialize()
    )
    jpegs = ray.data.read_binary_files(str(images), include_paths=True)
    jpeg_ds = (
        jpegs.map(
            lambda r: {
                "__key__": r["path"].split("/engine-bench/", 1)[1].rsplit(".", 1)[0].replace(".", "_"),
                "jpg": r["bytes"],
            }
        )  # fmt: skip
        .repartition(4)
        .materialize()
    )
    for label, ds, n in (("rows", table_ds, args.rows), ("jpegs", jpeg_ds, jpeg_ds.count())):
        peer = measure(
            f"ray_{label}_write_webdataset",
            n,
            out,
            args.repeats,
            lambda d, ds=ds: ds.write_webdataset(str(d), encoder=None),
        )
        ours = measure(
            f"ray_{label}_write_ray",
            n,
            out,
            args.repeats,
            lambda d, ds=ds: write_ray(ds, str(d), format="tar"),
        )
        ours["vs_peer"] = round(ours["samples_per_s"] / peer["samples_per_s"], 2)
        rows += [peer, ours]
    return rows


def write_row_by_row(parts: dict[int, list[Any]], dst: Path, fmt: str) -> None:
    """``write_spark``'s output made on the driver with every row a sample through
    ``ShardWriter.write`` (``arrow_rows=False``: the way before the Arrow path), for identity."""
    from stallfree.shards.write_engines import PartitionWrite, commit_parts, open_destination, write_partition

    spec = PartitionWrite(str(dst), {}, fmt)
    dest = open_destination(str(dst), overwrite=False, storage_options={})
    done = [
        write_partition(spec, partition, batches, batches[0].schema, arrow_rows=False)
        for partition, batches in sorted(parts.items())
    ]
    commit_parts(dest, spec, done, time.perf_counter(), {"writer": "write_spark"})


def spark_phase(args, spark: Any, table: Path, images: Path, out: Path) -> list[dict]:
    from pyspark.sql import functions as F
    from streaming.base.converters import dataframe_to_mds

    from stallfree.shards import write_spark
    from stallfree.testing.spark_cluster import partition_batches

    rows: list[dict] = []
    table_df = spark.read.parquet(str(table)).repartition(4).cache()
    table_df.count()
    photos = spark.read.format("binaryFile").option("recursiveFileLookup", "true").load(str(images))
    jpeg_df = (
        photos.select(
            F.regexp_extract("path", r"([^/]+/[^/]+)\.[A-Za-z]+$", 1).alias("__key__"),
            F.col("content").alias("jpg"),
        )
        .repartition(4)
        .cache()
    )
    n_jpegs = jpeg_df.count()
    for label, df, n, fmt, columns in (
        ("rows", table_df, args.rows, "arrow", {"id": "int64", "caption": "str", "emb": "bytes"}),
        ("jpegs", jpeg_df, n_jpegs, "tar", {"__key__": "str", "jpg": "bytes"}),
    ):
        peer = measure(
            f"spark_{label}_dataframe_to_mds",
            n,
            out,
            args.repeats,
            lambda d, df=df, columns=columns: dataframe_to_mds(
                df, merge_index=True, mds_kwargs={"out": str(d), "columns": columns, "keep_local": True}
            ),
        )
        ours = measure(
            f"spark_{label}_write_spark",
            n,
            out,
            args.repeats,
            lambda d, df=df, fmt=fmt: write_spark(df, str(d), format=fmt),
        )
        ours["vs_peer"] = round(ours["samples_per_s"] / peer["samples_per_s"], 2)
        # the same partitions written row by row on the driver: the bytes must not differ
        reference = out / f"spark_{label}_row_by_row"
        shutil.rmtree(reference, ignore_errors=True)
        write_row_by_row(partition_batches(df), reference, fmt)
        ours["identical_to_local"] = tree(Path(ours["dir"])) == tree(reference)
        rows += [peer, ours]
    return rows


def spark_batches_phase(args, spark: Any, table: Path, out: Path) -> list[dict]:
    """The Spark side both writers share: the Arrow batch size Spark hands the Python tasks
    (``spark.sql.execution.arrow.maxRecordsPerBatch``, 10,000 by default) against a task that
    only counts its rows (Spark's own floor), ``write_spark`` and ``dataframe_to_mds``."""
    import pyarrow as pa
    from streaming.base.converters import dataframe_to_mds

    from stallfree.shards import write_spark

    df = spark.read.parquet(str(table)).repartition(4).cache()
    df.count()
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    previous = spark.conf.get(key)

    def count_rows(batches):
        yield pa.RecordBatch.from_pydict({"n": [sum(b.num_rows for b in batches)]})

    rows: list[dict] = []
    try:
        for size in (2_000, 10_000, 100_000):
            spark.conf.set(key, str(size))
            for name, call in (
                ("count_only", lambda d: df.mapInArrow(count_rows, "n long").collect()),
                ("write_spark", lambda d: write_spark(df, str(d), format="arrow")),
                (
                    "dataframe_to_mds",
                    lambda d: dataframe_to_mds(
                        df,
                        merge_index=True,
                        mds_kwargs={
                            "out": str(d),
                            "columns": {"id": "int64", "caption": "str", "emb": "bytes"},
                            "keep_local": True,
                        },
                    ),
                ),
            ):
                row = measure(f"spark_batches{size}_{name}", args.rows, out, args.repeats, call)
                row["max_records_per_batch"] = size
                rows.append(row)
    finally:
        spark.conf.set(key, previous)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--images", type=int, default=4_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed calls before the timed ones")
    parser.add_argument(
        "--phases",
        default="engines,ray,spark",
        help="which comparisons to run (comma-separated; also spark-batches: Spark's Arrow batch size)",
    )
    args = parser.parse_args()
    globals()["WARMUP"] = args.warmup

    from stallfree.engines.ray_shard import RayExecutor
    from stallfree.engines.spark import SparkExecutor
    from stallfree.testing.ray_cluster import loopback_cluster
    from stallfree.testing.spark_cluster import local_spark_cluster

    table = make_table(OUT / "table.parquet", args.rows)
    images = make_images(OUT / "images", args.images)
    out = OUT / "runs"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "rows": args.rows,
        "images": args.images,
        "cpus": os.cpu_count(),
        "load_average_start": round(os.getloadavg()[0], 1),  # other work on the machine skews every figure
    }
    with (
        loopback_cluster(worker_nodes=2, cpus_per_node=1, resource=None) as _cluster,
        local_spark_cluster(workers=2, cores=1, memory_mb=1024) as spark,
    ):
        ray_ex = RayExecutor()
        spark_ex = SparkExecutor(spark=spark)
        phases = set(args.phases.split(","))
        results["engines"] = (
            engines_phase(args, table, images, out, ray_ex, spark_ex) if "engines" in phases else []
        )
        results["ray_peer"] = ray_phase(args, table, images, out) if "ray" in phases else []
        results["spark_peer"] = spark_phase(args, spark, table, images, out) if "spark" in phases else []
        if "spark-batches" in phases:
            results["spark_batches"] = spark_batches_phase(args, spark, table, out)
    results["load_average_end"] = round(os.getloadavg()[0], 1)
    for rows in ("engines", "ray_peer", "spark_peer", "spark_batches"):
        for row in results.get(rows, []):
            row.pop("dir", None)
    print(json.dumps(results, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    print_table(results)
    print(f"load average {results['load_average_start']} -> {results['load_average_end']}", file=sys.stderr)


def print_table(results: dict[str, Any]) -> None:
    print(
        "\n| run | samples | samples/s | ratio | output MB | driver peak RSS MB | identical |",
        file=sys.stderr,
    )
    print("|---|---:|---:|---:|---:|---:|---|", file=sys.stderr)
    for group in ("engines", "ray_peer", "spark_peer", "spark_batches"):
        for r in results.get(group, []):
            ratio = r.get("vs_local", r.get("vs_peer", ""))
            same = {True: "yes", False: "NO"}.get(r.get("identical_to_local"), "")
            print(
                f"| {r['name']} | {r['samples']:,} | {r['samples_per_s']:,} | {ratio} | "
                f"{r['output_bytes'] / 1e6:.1f} | {r['driver_peak_rss_mb']} | {same} |",
                file=sys.stderr,
            )


if __name__ == "__main__":
    main()
