"""What checking a reused staged copy costs (issue 36 item 2): a loader epoch over a dataset
already staged whole (a warm staging area), time to first batch and the epoch, three ways in one
process, rounds interleaved (the order rotated), median per case, ratios against "trusted":

- ``trusted``: copies taken as found, by size (the reads before issue 36: the check is switched
  off in this process, and so in the workers it forks);
- ``first check``: the copies carry no record of a check (the first run after an upgrade, or a
  file system without extended attributes): each is hashed (xxh3-128) before its first use;
- ``marked``: the steady state: each copy carries the record of the check the node made of it
  (inode, size, mtime, digest), so a process reads that record instead of hashing the copy.

    .venv/bin/python benchmarks/bench_staging_reuse.py
    .venv/bin/python benchmarks/bench_staging_reuse.py --shards 16 --shard-mb 16 --rounds 5

Then the same three per copy, without a loader: the seconds ``StagingArea.stage`` takes to hand
back a staged shard (open, pin, check), median over the shards: where the epoch's figures are
within the noise of a shared machine, this is the cost itself.

The bucket is moto on loopback (``stallfree.testing.s3serve``); the warm epochs read no remote
byte, only the staged copies (in the page cache). Collation keeps keys only, so the epoch is
the loader's own work: what a check adds shows at full size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stallfree import DataLoader  # noqa: E402
from stallfree.shards.open import open_dataset  # noqa: E402
from stallfree.shards.staged_reads import _expected  # noqa: E402
from stallfree.shards.writer import ShardWriter  # noqa: E402
from stallfree.storage import staging  # noqa: E402
from stallfree.storage.staging import Staging, StagingArea  # noqa: E402
from stallfree.testing.s3serve import serve_s3  # noqa: E402


def write(url: str, shards: int, shard_mb: int, sample_kb: int, **options) -> None:
    rng = np.random.default_rng(0)
    per_shard = max(1, (shard_mb << 10) // sample_kb)
    with ShardWriter(url, format="tar", max_samples=per_shard, **options) as w:
        for i in range(shards * per_shard):
            w.write({"__key__": f"s{i:07d}", "bin": rng.bytes(sample_kb << 10)})


def _keys(batch):
    return [s["__key__"] for s in batch]


def epoch(ds, root: str, workers: int) -> tuple[float, float, int]:
    """(seconds to the first batch, seconds for the epoch, samples) of a fresh loader."""
    dl = DataLoader(ds, batch_size=32, shuffle=True, num_workers=workers, seed=0, collate_fn=_keys,
                    staging=Staging(root=root))  # fmt: skip
    t0 = time.perf_counter()
    it = iter(dl)
    n = len(next(it))
    first = time.perf_counter() - t0
    for batch in it:
        n += len(batch)
    total = time.perf_counter() - t0
    del it, dl
    return first, total, n


def unmark(root: str) -> int:
    """Remove every copy's check record (as a copy staged before them): how many."""
    n = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                os.removexattr(os.path.join(dirpath, name), staging._MARK)
                n += 1
            except OSError:
                pass
    return n


def trusting(fd, st, expect):  # noqa: ANN001, ANN201 - the check switched off: size only
    if expect.size is not None and st.st_size != expect.size:
        return "wrong size"
    return staging._OK


def _never(f):  # noqa: ANN001, ANN202 - every copy is staged: nothing may be fetched
    raise AssertionError("fetched a copy that was staged")


def per_copy(ds, root: str, case: str, rounds: int) -> float:
    """Median seconds for ``stage`` to hand back one staged shard, checked as ``case`` says."""
    area = StagingArea(root)
    times = []
    for _ in range(rounds):
        for info in ds.manifest.shards:
            staging._CHECKED.clear()
            if case == "first check":
                os.removexattr(area.path_of(ds.fingerprint, info.path), staging._MARK)
            t0 = time.perf_counter()
            area.stage(ds.fingerprint, info.path, _never, size=info.bytes, expect=_expected(info)).close()
            times.append(time.perf_counter() - t0)
    area.close()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--shard-mb", type=int, default=16)
    p.add_argument("--sample-kb", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    judge = staging._judge
    with serve_s3() as s3, tempfile.TemporaryDirectory(prefix="bench-staging-") as tmp:
        s3.create_bucket("bench")
        url = "s3://bench/ds"
        write(url, args.shards, args.shard_mb, args.sample_kb, **s3.storage_options)
        ds = open_dataset(url, **s3.storage_options)
        root = os.path.join(tmp, "stage")
        epoch(ds, root, args.workers)  # stage it all (cold), then every epoch is warm
        gets_before = sum(1 for r in s3.requests() if r.method == "GET")
        cases = {"trusted": [], "first check": [], "marked": []}
        names = list(cases)
        for r in range(args.rounds):  # each round in another order: no case is always the first
            for case in names[r % 3 :] + names[: r % 3]:
                runs = cases[case]
                staging._CHECKED.clear()  # this process (and the workers it forks) checked nothing
                if case == "first check":
                    unmark(root)
                staging._judge = trusting if case == "trusted" else judge
                try:
                    runs.append(epoch(ds, root, args.workers))
                finally:
                    staging._judge = judge
        copies = {}
        for case in cases:
            staging._judge = trusting if case == "trusted" else judge
            try:
                copies[case] = per_copy(ds, root, case, args.rounds)
            finally:
                staging._judge = judge
        fetched = sum(1 for r in s3.requests() if r.method == "GET") - gets_before
    size_mb = sum(info.bytes for info in ds.manifest.shards) / 2**20
    print(f"{args.shards} shards, {size_mb:.0f} MiB staged, {args.workers} workers, {args.rounds} rounds "
          f"(median), shard GETs during the warm epochs: {fetched}")  # fmt: skip
    base_first = statistics.median(r[0] for r in cases["trusted"])
    base_epoch = statistics.median(r[1] for r in cases["trusted"])
    print("| case | first batch, s | epoch, s | first batch vs trusted | epoch vs trusted |")
    print("|---|---|---|---|---|")
    for case, runs in cases.items():
        first = statistics.median(r[0] for r in runs)
        total = statistics.median(r[1] for r in runs)
        assert all(r[2] == len(ds) for r in runs), "an epoch lost or repeated samples"
        print(
            f"| {case} | {first:.3f} | {total:.3f} | {first / base_first:.2f}x | {total / base_epoch:.2f}x |"
        )
    shard_mb = size_mb / len(ds.manifest.shards)
    print(f"\nper staged copy ({shard_mb:.1f} MiB), StagingArea.stage of a staged shard, median:")
    print("| case | ms per copy | vs trusted |")
    print("|---|---|---|")
    for case, t in copies.items():
        print(f"| {case} | {t * 1e3:.3f} | {t / copies['trusted']:.2f}x |")


if __name__ == "__main__":
    main()
