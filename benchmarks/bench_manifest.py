"""Opening a big manifest both ways: ``manifest.json`` parsed, or read through its binary sidecar.

Writes one dataset's manifest (``--shards`` tar shards of 5,000 samples, each with a sha256: at
200,000 shards that is 10^9 samples) with ``Manifest.save``, which writes ``manifest.json`` and
``manifest.shards.bin``; a second directory holds the same ``manifest.json`` alone. Only the
manifest is written: opening reads no shard. Then, each in a fresh process (its own peak RSS),
``--repeats`` times, modes interleaved:

  json     : open_dataset on the directory without a sidecar (``manifest.json`` parsed whole)
  streamed : the same JSON parsed one shard entry at a time (``json.JSONDecoder.raw_decode``
             over the ``shards`` array, each entry a ``ShardInfo`` at once, no list of dicts held),
             then a ``ShardedDataset`` over it: what a streamed reader would cost (bench-only)
  sidecar  : open_dataset on the directory with one (the JSON is hashed, not parsed)

and reports per mode (medians): open_s (open_dataset), peak_mib (peak RSS added by it),
fingerprint_s (the dataset's fingerprint, first ask), lookup_us (``locate`` of 100,000 random
indices, per index), first_sample_s (``manifest.shards[s]`` for 1,000 random shards, per shard),
and the files' sizes. Both modes are checked to agree: fingerprint, length, every shard's
``ShardInfo`` (1,000 random shards) and ``locate`` of the last index.

  .venv/bin/python benchmarks/bench_manifest.py --shards 200000 --repeats 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

PER_SHARD = 5000
MODES = ("json", "streamed", "sidecar")


def write(root: str, shards: int) -> None:
    """The two directories under ``root`` (kept between runs: the inputs do not change)."""
    from stallfree.shards.manifest.model import FORMAT_VERSION, MANIFEST_NAME, Manifest, ShardInfo
    from stallfree.shards.manifest.sidecar import sidecar_path_for

    with_sidecar, json_only = os.path.join(root, "sidecar"), os.path.join(root, "json")
    if os.path.exists(sidecar_path_for(os.path.join(with_sidecar, MANIFEST_NAME))):
        return
    for d in (with_sidecar, json_only):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    infos = [
        ShardInfo(
            f"shard-{i:06d}.tar", PER_SHARD, PER_SHARD * 110_000, hashlib.sha256(str(i).encode()).hexdigest()
        )
        for i in range(shards)
    ]
    Manifest(FORMAT_VERSION, "tar", ["jpg", "cls"], infos).save(with_sidecar)
    shutil.copy(os.path.join(with_sidecar, MANIFEST_NAME), os.path.join(json_only, MANIFEST_NAME))


def open_streamed(directory: str) -> Any:
    """A ``ShardedDataset`` from ``manifest.json`` parsed entry by entry (see the docstring)."""
    from stallfree.shards.manifest.model import MANIFEST_NAME, Manifest, ShardInfo
    from stallfree.shards.open import ShardedDataset

    with open(os.path.join(directory, MANIFEST_NAME)) as f:
        text = f.read()
    start = text.index('"shards": [') + len('"shards": [')
    decoder, pos, infos = json.JSONDecoder(), start, []
    while True:
        while text[pos] in " \n\t,":
            pos += 1
        if text[pos] == "]":
            break
        entry, pos = decoder.raw_decode(text, pos)
        infos.append(ShardInfo.from_json(entry))
    head = json.loads(text[: start - 1] + "[]" + text[pos + 1 :])  # everything but the shards
    manifest = Manifest.from_json(head, shards=infos)
    return ShardedDataset(directory, manifest, directory, "file:///", {})


def measure(root: str, mode: str, shards: int) -> dict[str, Any]:
    import psutil

    from stallfree.shards.manifest.model import MANIFEST_NAME
    from stallfree.shards.manifest.sidecar import sidecar_path_for
    from stallfree.shards.open import open_dataset

    directory = os.path.join(root, "json" if mode == "streamed" else mode)
    before = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    ds = open_streamed(directory) if mode == "streamed" else open_dataset(directory)
    t1 = time.perf_counter()
    fingerprint = ds.fingerprint
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rng = random.Random(0)
    indices = [rng.randrange(len(ds)) for _ in range(100_000)]
    t3 = time.perf_counter()
    for i in indices:
        ds.locate(i)
    t4 = time.perf_counter()
    picks = [rng.randrange(shards) for _ in range(1000)]
    t5 = time.perf_counter()
    rows = [ds.manifest.shards[s] for s in picks]
    t6 = time.perf_counter()
    manifest = os.path.join(directory, MANIFEST_NAME)
    side = sidecar_path_for(manifest)
    assert len(ds) == shards * PER_SHARD and ds.locate(len(ds) - 1) == (shards - 1, PER_SHARD - 1)
    return {
        "open_s": t1 - t0,
        "peak_mib": (peak - before) / 2**20,
        "fingerprint_s": t2 - t1,
        "lookup_us": (t4 - t3) / len(indices) * 1e6,
        "shard_info_us": (t6 - t5) / len(picks) * 1e6,
        "json_mib": os.path.getsize(manifest) / 2**20,
        "sidecar_mib": os.path.getsize(side) / 2**20 if os.path.exists(side) else 0.0,
        "check": hashlib.sha256(
            json.dumps([fingerprint, len(ds), [r.to_json() for r in rows]]).encode()
        ).hexdigest(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/stallfree-bench-manifest")
    ap.add_argument("--json", action="store_true", help="print the medians as JSON")
    ap.add_argument("--one", choices=(*MODES, "write"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    root = os.path.join(args.dir, str(args.shards))
    if args.one == "write":
        write(root, args.shards)
        return
    if args.one:
        print(json.dumps(measure(root, args.one, args.shards)))
        return
    # each step in its own process: a child's ru_maxrss starts at what its parent held when forked
    base = [sys.executable, os.path.abspath(__file__), "--shards", str(args.shards), "--dir", args.dir]
    subprocess.run([*base, "--one", "write"], check=True, timeout=600)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            out = subprocess.run([*base, "--one", mode], capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise SystemExit(f"{mode}: {out.stderr.strip()}")
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    checks = {r["check"] for rs in runs.values() for r in rs}
    if len(checks) != 1:
        raise SystemExit(f"the two ways disagree: {sorted(checks)}")
    medians = {
        m: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "check"} for m, rs in runs.items()
    }
    if args.json:
        print(json.dumps(medians))
        return
    print(
        f"{args.shards:,} shards, {args.shards * PER_SHARD:,} samples; medians of {args.repeats}; both ways agree"
    )
    print(
        "| mode | open_dataset | peak RSS added | fingerprint, first | locate / index "
        "| manifest.shards[s] | manifest.json | sidecar |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, m in medians.items():
        print(
            f"| {mode} | {m['open_s']:.3f} s | {m['peak_mib']:.0f} MiB | {m['fingerprint_s']:.3f} s "
            f"| {m['lookup_us']:.2f} us | {m['shard_info_us']:.2f} us | {m['json_mib']:.1f} MiB "
            f"| {m['sidecar_mib']:.1f} MiB |"
        )
    s = medians["sidecar"]
    for name in ("json", "streamed"):
        m = medians[name]
        print(
            f"sidecar vs {name}: open {m['open_s'] / s['open_s']:.1f}x faster, "
            f"peak {m['peak_mib'] / max(s['peak_mib'], 1e-9):.1f}x less"
        )


if __name__ == "__main__":
    main()
