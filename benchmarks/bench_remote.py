"""Remote workers (issue 32): does a Ray node's core add to a trainer whose own core is the limit?

Two cores, one run, side by side. The trainer process is pinned to core 0 (every thread of it,
Ray's included, and its local worker, forked from it); a loopback Ray cluster (a head with no
CPUs and one worker node of one CPU) is started with its worker node pinned to core 1 and its
head on core 0 (``--head-core trainer``: the trainer node's own Ray, as in a real deployment;
``--head-core ray`` puts it on core 1). Each loader feeds a loop with a fixed step (``--step-ms``, a sleep: the
emulated GPU step) and the image recipe (JPEG decode + RandomResizedCrop 224 + flip, uint8:
``ImageDecode(train=True, size=224, dtype="uint8", backend="cpu")``, run in the workers):

  (a) local    stallfree.DataLoader(num_workers=1, persistent_workers=True)
  (b) remote   the same + remote=RayWorkers(1) (placed on the CPU node, not the trainer's)
  (c) ray-data Ray Data on the same cluster, the same decode: read_webdataset (raw bytes) ->
               map_batches(the same ImageDecode.decode_batch, batch_size=B) -> iter_torch_batches
               (its defaults: prefetch_batches=1)

Reported per loader: img/s, stall % (time blocked in next() over the measured wall time), CPU-s
per image in the trainer's process tree (core 0) and in the Ray worker processes (core 1), and for
(b) the bytes on the wire per image and the trainer's CPU per remote batch (ray.get + the copy out
of the reply), from ``loader.stats()["remote"]``.

The data is ``--images`` JPEGs of 500x375, 2,048 by default (64 batches an epoch: with 768 the
window's drain at every epoch's end, where a remote round trip is not hidden, weighed on the
rates). "late %" is the loop's time neither in ``next()`` nor in its step (the step overran:
the training thread waited for its core, or for the GIL).

The loaders take turns for ``--rounds`` rounds; ratios are taken within a round and their median
reported (the machines are shared: the load drifts between minutes).

Run: .venv/bin/python benchmarks/bench_remote.py [--images 2048] [--batch 32] [--steps 40]
     [--step-ms 10] [--rounds 3] [--inline-bytes N] [--no-keep-heap] [--head-core trainer|ray]
     [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent


def _tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its live children (a child that ended is not counted: the
    loaders here keep their workers for the whole run)."""
    total = 0.0
    try:
        proc = psutil.Process(pid)
        for p in [proc, *proc.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


def _tree_pids(pid: int) -> list[int]:
    try:
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return []


def _pin(pid: int, core: int) -> None:
    """Every thread of ``pid`` onto ``core`` (a process's mask is per thread: its threads started
    already keep theirs)."""
    try:
        for t in psutil.Process(pid).threads():
            os.sched_setaffinity(t.id, {core})
    except (OSError, psutil.Error):
        pass


HEAD: list[int] = []  # the head node's processes: the trainer's node's Ray
NODES: list[int] = []  # the CPU node's raylet (its workers and actors are its children)


def _cpu_of(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def _trainer_cpu() -> float:
    """CPU seconds of this process and its loader workers (forked: the same command line), not
    the Ray processes this process started (the loopback cluster's are its children too)."""
    me = psutil.Process()
    total = _cpu_of(me.pid)
    for child in me.children(recursive=False):
        try:
            if child.cmdline() == me.cmdline():
                total += _tree_cpu(child.pid)
        except psutil.Error:
            pass
    return total


def _head_cpu() -> float:
    return sum(_cpu_of(pid) for pid in HEAD)


def _ray_workers_cpu() -> float:
    """CPU seconds of the CPU node's raylet and every process it started (workers, actors)."""
    return sum(_tree_cpu(pid) for pid in NODES)


def measure(name: str, batches, steps: int, warmup: int, step_s: float, batch: int) -> dict:
    """Run ``warmup`` then ``steps`` steps over ``batches`` (an iterator), a fixed sleep per step."""
    it = iter(batches)
    for _ in range(warmup):
        next(it)
        time.sleep(step_s)
    cpu_trainer0, cpu_head0, cpu_ray0 = _trainer_cpu(), _head_cpu(), _ray_workers_cpu()
    wait = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        w0 = time.perf_counter()
        next(it)
        wait += time.perf_counter() - w0
        time.sleep(step_s)
    wall = time.perf_counter() - t0
    images = steps * batch
    out = {
        "loader": name,
        "img_s": images / wall,
        "stall_pct": 100 * wait / wall,
        # the loop's time neither blocked in next() nor in its step: the step overran (the
        # training thread waited for its core, or for the GIL held by a loader thread)
        "late_pct": 100 * max(0.0, wall - wait - steps * step_s) / wall,
        "trainer_cpu_ms_per_img": 1000 * (_trainer_cpu() - cpu_trainer0) / images,
        "head_cpu_ms_per_img": 1000 * (_head_cpu() - cpu_head0) / images,
        "ray_cpu_ms_per_img": 1000 * (_ray_workers_cpu() - cpu_ray0) / images,
    }
    print(
        f"  {name:9s} {out['img_s']:7.0f} img/s  stall {out['stall_pct']:5.1f}%  late {out['late_pct']:4.1f}%  "
        f"trainer {out['trainer_cpu_ms_per_img']:5.2f}  head {out['head_cpu_ms_per_img']:5.2f}  "
        f"CPU node {out['ray_cpu_ms_per_img']:5.2f} CPU-ms/img",
        flush=True,
    )
    return out


def forever(loader):
    while True:
        yield from loader


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefetch", type=int, default=2, help="prefetch_factor of both loaders")
    ap.add_argument("--in-flight", type=int, default=2, help="RayWorkers(in_flight=)")
    ap.add_argument("--local-ahead", type=int, default=4, help="RayWorkers(local_ahead=)")
    ap.add_argument(
        "--inline-bytes",
        type=int,
        default=64 << 20,
        help="RayWorkers(inline_bytes=): 0 sends every batch through the object store",
    )
    ap.add_argument(
        "--no-keep-heap",
        action="store_true",
        help="RayWorkers(keep_heap=False): the actor's malloc as glibc sets it by default",
    )
    ap.add_argument(
        "--head-core",
        choices=("trainer", "ray"),
        default="trainer",
        help="where the head node's processes run: the trainer's core (its node's raylet, as in a "
        "real deployment) or the Ray node's",
    )
    ap.add_argument("--any-order", action="store_true", help="in_order=False for both loaders")
    ap.add_argument("--only", default="a,b,c")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        print("bench_remote: needs two cores (one for the trainer, one for the Ray node)", file=sys.stderr)
        return 2
    cores = sorted(os.sched_getaffinity(0))
    trainer_core, ray_core = cores[0], cores[1]

    from stallfree.harness.fixtures import write_jpeg_shards
    from stallfree.testing.ray_cluster import start_loopback_cluster  # sets the loopback flags

    tmp = Path(tempfile.mkdtemp(prefix="bench_remote_"))
    shards = write_jpeg_shards(tmp / "ds", args.images, per_shard=64, size=(500, 375))

    os.sched_setaffinity(0, {ray_core})  # the cluster's processes inherit core 1
    cluster = start_loopback_cluster(
        worker_nodes=1, cpus_per_node=1, resource=None, object_store_bytes=256 << 20
    )
    # the trainer (and its local worker) on core 0: every thread, Ray's own that ray.init started
    # while this process was on core 1 included (they receive the remote batches)
    os.sched_setaffinity(0, {trainer_core})
    _pin(os.getpid(), trainer_core)
    NODES.extend(cluster.raylet_pid(n) for n in cluster.worker_nodes)
    # the head's processes (raylet, its agents, GCS, dashboard, monitors): all of the cluster's
    # that are not the CPU node's; with --head-core trainer they move to the trainer's core
    node_tree = {p for pid in NODES for p in _tree_pids(pid)}
    HEAD.extend(sorted(set(_tree_pids(os.getpid())) - {os.getpid()} - node_tree))
    if args.head_core == "trainer":
        for pid in HEAD:
            _pin(pid, trainer_core)
    import torch

    torch.set_num_threads(1)
    from stallfree import DataLoader, ImageDecode, RayWorkers
    from stallfree.shards import open_dataset

    step_s = args.step_ms / 1000
    recipe = dict(train=True, size=224, dtype="uint8", backend="cpu")
    results = []
    print(
        f"bench_remote: {args.images} JPEGs 500x375, batch {args.batch}, step {args.step_ms} ms, "
        f"trainer on core {trainer_core}, Ray node on core {ray_core}",
        flush=True,
    )
    only = set(args.only.split(","))

    def loader_for(remote: bool) -> DataLoader:
        return DataLoader(
            open_dataset(str(shards)),
            batch_size=args.batch,
            shuffle=True,
            seed=0,
            num_workers=1,
            persistent_workers=True,
            prefetch_factor=args.prefetch,
            in_order=not args.any_order,
            decode=ImageDecode(**recipe),
            remote=RayWorkers(
                1,
                cpus_per_worker=1,
                in_flight=args.in_flight,
                local_ahead=args.local_ahead,
                inline_bytes=args.inline_bytes,
                keep_heap=not args.no_keep_heap,
            )
            if remote
            else None,
        )

    def ray_data_stream():
        import ray.data

        decoder = ImageDecode(**recipe)

        def decode(batch: dict) -> dict:
            samples = [
                {"__key__": k, "jpg": bytes(j), "cls": bytes(c)}
                for k, j, c in zip(batch["__key__"], batch["jpg"], batch["cls"], strict=True)
            ]
            out = decoder.decode_batch(samples, seed=0)
            return {"image": out["image"].numpy(), "label": out["label"].numpy()}

        tars = sorted(str(p) for p in Path(shards).glob("*.tar"))
        ds = ray.data.read_webdataset(tars, decoder=None).map_batches(
            decode, batch_size=args.batch, batch_format="numpy"
        )
        while True:
            yield from ds.iter_torch_batches(batch_size=args.batch)

    # the loaders take turns, round after round (the machine's load drifts: a ratio within one
    # round compares like with like); each is made afresh per round and closed after it (the CPU
    # node has one CPU: a remote worker holds it while its loader lives), and measured after
    # warm-up steps (its start, the actor's placement, Ray Data's first tasks)
    rounds: list[list[dict]] = []
    remote_stats = None
    for r in range(args.rounds):
        print(f" round {r + 1}/{args.rounds}", flush=True)
        rnd = []
        for name in ("a", "b"):
            if name in only:
                loader = loader_for(remote=name == "b")
                label = "local" if name == "a" else "+remote"
                rnd.append(measure(label, forever(loader), args.steps, args.warmup, step_s, args.batch))
                if name == "b":
                    remote_stats = loader.stats()["remote"]
                loader.close()
        if "c" in only:
            stream = ray_data_stream()
            rnd.append(measure("ray-data", stream, args.steps, args.warmup, step_s, args.batch))
            stream.close()
        rounds.append(rnd)
    results = [row for rnd in rounds for row in rnd]
    cluster.shutdown()
    names = {row["loader"] for row in results}

    def ratio(x: str, y: str) -> list[float]:
        return [
            next(r["img_s"] for r in rnd if r["loader"] == x)
            / next(r["img_s"] for r in rnd if r["loader"] == y)
            for rnd in rounds
        ]

    summary: dict[str, object] = {}
    for x, y, label in (("+remote", "local", "(b)/(a)"), ("+remote", "ray-data", "(b)/(c)")):
        if {x, y} <= names:
            per = ratio(x, y)
            summary[label] = {"per_round": per, "median": statistics.median(per)}
            print(
                f"  {label} img/s: median {statistics.median(per):.2f}x; rounds "
                + ", ".join(f"{v:.2f}" for v in per)
            )
    if remote_stats is not None:
        remote_share = remote_stats["batches_remote"] / max(
            1, remote_stats["batches_remote"] + remote_stats["batches_local"]
        )
        worker = next(iter(remote_stats["workers"].values()))
        per_batch = max(1, worker["batches"])
        summary["remote"] = {
            "busy_ms_per_batch": 1000 * worker["busy_s"] / per_batch,
            "in_flight_ms_per_batch": 1000 * worker["in_flight_s"] / per_batch,
            "share_of_batches": remote_share,
            "bytes_per_img": remote_stats["bytes_per_batch"] / args.batch,
            "trainer_cpu_ms_per_remote_batch": remote_stats["trainer_cpu_ms_per_batch"],
            "passed_over": remote_stats.get("passed_over", 0),
            "probes": remote_stats.get("probes", 0),
        }
        print(
            f"  remote batches: {remote_share:.0%} of (b)'s; on the wire {remote_stats['bytes_per_batch'] / args.batch / 1024:.0f} "
            f"KiB/img; trainer CPU per remote batch {remote_stats['trainer_cpu_ms_per_batch']:.2f} ms "
            f"(ray.get + the copy out, in the loader's thread); a remote batch took "
            f"{summary['remote']['busy_ms_per_batch']:.0f} ms on its worker and "
            f"{summary['remote']['in_flight_ms_per_batch']:.0f} ms from dispatch to delivery; "
            f"{summary['remote']['passed_over']} batches kept local (the remote worker would be later), "
            f"{summary['remote']['probes']} probes (last round)"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "results": results, "summary": summary}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
