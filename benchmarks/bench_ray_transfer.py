"""The floor under remote workers (issue 32): the CPU Ray spends, per side, to move one batch.

A remote worker's batch (32 x 3 x 224 x 224 uint8, 4.8 MB, plus its labels) goes from an actor on
a CPU node to the trainer through Ray. This measures what that costs with no decode at all: an
actor on node B returns a batch it already holds (as ``stallfree/engines/ray_wire.py`` sends it:
numpy arrays, which Ray writes out of band), the driver on node A does what the loader does with
it (``ray.get``, one copy into memory of its own, the object freed), ``--in-flight`` calls
outstanding, and every Ray process's CPU is read before and after. The same
``start_loopback_cluster`` as ``benchmarks/bench_remote.py``: a head (no CPUs; the driver's node)
and one worker node of one CPU pinned to core 1, the driver and the head's processes on core 0
(where a trainer node's own raylet runs in a real deployment; ``--head-core 1`` puts the head
on the node's core, as bench_remote did before).

Each configuration (``--configs``, see ``CONFIGS``) starts a fresh cluster with its Ray system
config; the per-batch CPU (ms) is reported per side and per process group:

  driver        the driver process (its ``ray.get`` + copy, and its Ray threads)
  actor         the actor's process (serialising the return value, writing the store, replying)
  node raylet   the CPU node's raylet (its object store; sending the object)
  node other    the CPU node's dashboard and runtime-env agents, idle workers (background)
  head raylet   the head's raylet (pulling the object into the driver's node's store)
  head other    GCS, dashboard, monitor, log monitor, the head's agents (background)

and, before any batch moves, the background CPU of each group per second of idle.
That is the floor: a remote batch cannot cost the CPU node less than "actor + node raylet (+
agents)", nor the trainer's node less than "driver + head raylet", with Ray's object store.

Run: .venv/bin/python benchmarks/bench_ray_transfer.py [--batches 200] [--in-flight 2]
     [--configs default,inline-env,...|none] [--scaling-s 6] [--head-core 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import psutil

MB = 1 << 20
INLINE_ENV = {  # the same as "inline", for the actor's process only (Ray reads RAY_<name> at start)
    "RAY_max_direct_call_object_size": str(8 * MB),
    "RAY_task_rpc_inlined_bytes_limit": str(64 * MB),
}
HEAP_ENV = {  # glibc: batch-sized blocks from the heap, and freed ones kept for the next batch
    "MALLOC_MMAP_THRESHOLD_": str(32 * MB),
    "MALLOC_TRIM_THRESHOLD_": str(1024 * MB),
}
# name -> (Ray _system_config, what it changes); a name ending in "-env" also starts the actor with
# INLINE_ENV in its environment (RayWorkers(inline_bytes=) does that), "-heap" with HEAP_ENV too
CONFIGS: dict[str, tuple[dict, str]] = {
    "default": ({}, "Ray's defaults"),
    "quiet": (
        {"enable_metrics_collection": False, "task_events_report_interval_ms": 0},
        "metrics collection and task events off",
    ),
    "chunk-1m": ({"object_manager_default_chunk_size": 1 * MB}, "1 MiB transfer chunks (default 5 MiB)"),
    "chunk-8m": ({"object_manager_default_chunk_size": 8 * MB}, "8 MiB transfer chunks: one per batch"),
    "in-flight-8m": (
        {"object_manager_max_bytes_in_flight": 8 * MB},
        "at most 8 MiB of object chunks in flight per node (default 2 GiB)",
    ),
    "rpc-1": (
        {"object_manager_rpc_threads_num": 1, "object_manager_client_connection_num": 1},
        "one object-manager RPC thread and connection",
    ),
    "inline": (
        {"max_direct_call_object_size": 8 * MB, "task_rpc_inlined_bytes_limit": 64 * MB},
        "return values up to 8 MiB inlined in the task's reply (no object store, no raylet)",
    ),
    "inline-quiet": (
        {
            "max_direct_call_object_size": 8 * MB,
            "task_rpc_inlined_bytes_limit": 64 * MB,
            "enable_metrics_collection": False,
            "task_events_report_interval_ms": 0,
        },
        "inline + quiet",
    ),
    "inline-env": ({}, "inline, set for the actor's process only (its runtime_env's env_vars)"),
    "inline-env-heap": ({}, "inline-env, and the actor's malloc keeps batch-sized blocks"),
}
GROUPS = ("driver", "actor", "node raylet", "node other", "head raylet", "head other")


def _cpu(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def _tree(pid: int) -> list[int]:
    try:
        p = psutil.Process(pid)
        return [pid, *(c.pid for c in p.children(recursive=True))]
    except psutil.Error:
        return []


class Groups:
    """The cluster's processes by group (see the module docstring), found once the actor runs."""

    def __init__(self, cluster, actor_pid: int) -> None:
        head_raylet = cluster.raylet_pid(cluster.head)
        node_raylet = cluster.raylet_pid(cluster.worker_nodes[0])
        me = os.getpid()
        node_tree = set(_tree(node_raylet))
        head_tree = set(_tree(head_raylet))
        cluster_procs = set(_tree(me)) - {me}
        self.pids: dict[str, list[int]] = {
            "driver": [me],
            "actor": [actor_pid],
            "node raylet": [node_raylet],
            "node other": sorted(node_tree - {node_raylet, actor_pid}),
            "head raylet": [head_raylet],
            "head other": sorted(cluster_procs - node_tree - {head_raylet} | (head_tree - {head_raylet})),
        }

    def read(self) -> dict[str, float]:
        return {g: sum(_cpu(p) for p in pids) for g, pids in self.pids.items()}

    def pin(self, driver_core: int, head_core: int, node_core: int) -> None:
        for g, pids in self.pids.items():
            core = node_core if g in ("actor", "node raylet", "node other") else head_core
            if g == "driver":  # Ray's threads in it were started while it was on the node's core
                core = driver_core
            for p in pids:
                try:
                    os.sched_setaffinity(p, {core})
                    for t in psutil.Process(p).threads():  # a thread's own mask is not inherited
                        os.sched_setaffinity(t.id, {core})
                except (OSError, psutil.Error):
                    pass


def run_config(name: str, args, driver_core: int, ray_core: int) -> dict:
    import numpy as np

    from stallfree.testing.ray_cluster import start_loopback_cluster

    system_config, what = CONFIGS[name]
    os.sched_setaffinity(0, {ray_core})  # the cluster's processes inherit core 1
    cluster = start_loopback_cluster(
        worker_nodes=1,
        cpus_per_node=1,
        resource=None,
        object_store_bytes=256 << 20,
        system_config=system_config or None,
    )
    os.sched_setaffinity(0, {driver_core})
    import ray

    try:
        image_bytes = args.batch * 3 * 224 * 224

        @ray.remote(num_cpus=1)
        class Sender:
            def __init__(self, nbytes: int, batch: int) -> None:
                rng = np.random.default_rng(0)
                self.image = rng.integers(0, 255, nbytes, dtype=np.uint8)
                self.label = np.arange(batch, dtype=np.int64).view(np.uint8)

            def pid(self) -> int:
                return os.getpid()

            def send(self, i: int) -> dict:
                return {"seq": i, "image": self.image, "label": self.label}

        node = cluster.worker_nodes[0].node_id
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options: dict = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
        if "-env" in name:
            heap = HEAP_ENV if name.endswith("-heap") else {}
            options["runtime_env"] = {"env_vars": {**INLINE_ENV, **heap}}
        actor = Sender.options(**options).remote(
            image_bytes, args.batch
        )
        groups = Groups(cluster, ray.get(actor.pid.remote()))
        groups.pin(driver_core, driver_core if args.head_core == 0 else ray_core, ray_core)
        out = np.empty(image_bytes, dtype=np.uint8)
        pending: deque = deque()

        def one_batch(i: int, get_cpu: list[float]) -> None:
            while len(pending) < args.in_flight:
                pending.append(actor.send.remote(i))
            ref = pending.popleft()
            c0 = time.thread_time()
            value = ray.get(ref)
            np.copyto(out, value["image"])
            del value, ref  # the object is freed: the driver's store holds only what is in flight
            get_cpu.append(time.thread_time() - c0)

        warm: list[float] = []
        for i in range(args.warmup):
            one_batch(i, warm)
        time.sleep(0.5)
        i0 = groups.read()
        time.sleep(args.idle_s)
        i1 = groups.read()
        idle = {g: 1000 * (i1[g] - i0[g]) / args.idle_s for g in GROUPS}  # CPU-ms per second
        get_cpu: list[float] = []
        c0, t0 = groups.read(), time.perf_counter()
        for i in range(args.batches):
            one_batch(i, get_cpu)
        wall = time.perf_counter() - t0
        c1 = groups.read()
        while pending:
            ray.get(pending.popleft())
        per = {g: 1000 * (c1[g] - c0[g]) / args.batches for g in GROUPS}
        row = {
            "config": name,
            "what": what,
            "system_config": system_config,
            "batches_per_s": args.batches / wall,
            "mb_per_s": args.batches * image_bytes / wall / 1e6,
            "cpu_ms_per_batch": per,
            "cpu_ms_per_mb": {g: v / (image_bytes / 1e6) for g, v in per.items()},
            "trainer_get_copy_ms": 1000 * statistics.median(get_cpu),
            "node_side_ms": per["actor"] + per["node raylet"] + per["node other"],
            "head_side_ms": per["driver"] + per["head raylet"] + per["head other"],
            "idle_cpu_ms_per_s": idle,
        }
        ray.kill(actor)
    finally:
        cluster.shutdown()
    return row


def _decode_for(core: int, seconds: float, start, batch: int, out) -> None:
    """In a forked child: decode the bench's recipe on ``core`` for ``seconds``, batches counted."""
    os.sched_setaffinity(0, {core})
    import torch

    torch.set_num_threads(1)
    from stallfree import ImageDecode
    from stallfree.testing.images import jpeg_bytes

    decoder = ImageDecode(train=True, size=224, dtype="uint8", backend="cpu", num_threads=1)
    samples = [
        {"__key__": f"{i:08d}", "jpg": j, "cls": b"1"}
        for i, j in enumerate(jpeg_bytes(batch * 4, seed=0, sizes=((500, 375),), quality=90))
    ]
    decoder.decode_batch(samples[:batch], seed=0)  # warm
    start.wait()
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        k = (n % 4) * batch
        decoder.decode_batch(samples[k : k + batch], seed=n)
        n += 1
    out.put((core, n / (time.perf_counter() - t0), 1000 * (time.process_time() - c0) / n))


def core_scaling(cores: list[int], seconds: float, batch: int) -> dict:
    """The decode's batches/s on one core alone, on the other alone, and on both at once: the
    ceiling of any two-core layout on this machine (two vCPUs can share a physical core, a
    cache or memory bandwidth, so "two cores" need not be 2x one)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")

    def run(which: list[int]) -> dict[int, tuple[float, float]]:
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_decode_for, args=(c, seconds, start, batch, out)) for c in which]
        for p in procs:
            p.start()
        time.sleep(3.0)  # imports and warm-up in every child before the clock starts
        start.set()
        got = [out.get(timeout=seconds + 120) for _ in which]
        for p in procs:
            p.join()
        return {c: (rate, cpu) for c, rate, cpu in got}

    solo = {c: run([c])[c] for c in cores[:2]}
    both = run(cores[:2])
    best_solo = max(rate for rate, _ in solo.values())
    return {
        "solo_batches_per_s": {c: r for c, (r, _) in solo.items()},
        "solo_cpu_ms_per_batch": {c: m for c, (_, m) in solo.items()},
        "both_batches_per_s": {c: r for c, (r, _) in both.items()},
        "both_cpu_ms_per_batch": {c: m for c, (_, m) in both.items()},
        "two_over_one": sum(r for r, _ in both.values()) / best_solo,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="images of 3x224x224 uint8 per batch")
    ap.add_argument("--in-flight", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=3.0, help="seconds of idle to measure background CPU")
    ap.add_argument(
        "--configs",
        default="default,quiet,inline-env,inline-quiet",
        help=f"comma-separated, of {', '.join(CONFIGS)}; none: the decode's core scaling only",
    )
    ap.add_argument("--head-core", type=int, choices=(0, 1), default=0, help="the head's core (bench_remote: 0)")
    ap.add_argument(
        "--scaling-s",
        type=float,
        default=6.0,
        help="seconds of the decode alone on each core, then on both at once (0: skip)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        print("bench_ray_transfer: needs two cores", file=sys.stderr)
        return 2
    cores = sorted(os.sched_getaffinity(0))
    names = [] if args.configs == "none" else args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"bench_ray_transfer: unknown configs {unknown}; known: {sorted(CONFIGS)}", file=sys.stderr)
        return 2
    mb = args.batch * 3 * 224 * 224 / 1e6
    print(
        f"bench_ray_transfer: a {mb:.2f} MB batch from an actor on node B (core {cores[1]}) to the driver "
        f"(core {cores[0]}), head on core {cores[args.head_core]}, {args.in_flight} in flight, "
        f"{args.batches} batches; CPU-ms per batch",
        flush=True,
    )
    print(f"  {'config':13s} {'batch/s':>7s} " + " ".join(f"{g:>11s}" for g in GROUPS) + "  node-side head-side")
    scaling = None
    if args.scaling_s > 0:
        scaling = core_scaling(cores, args.scaling_s, args.batch)
        print(
            "  the decode alone (batches/s, CPU-ms per batch): "
            + ", ".join(
                f"core {c} {r:.1f} ({scaling['solo_cpu_ms_per_batch'][c]:.1f} ms)"
                for c, r in scaling["solo_batches_per_s"].items()
            )
            + "; on both at once: "
            + ", ".join(
                f"core {c} {r:.1f} ({scaling['both_cpu_ms_per_batch'][c]:.1f} ms)"
                for c, r in scaling["both_batches_per_s"].items()
            )
            + f"; two cores = {scaling['two_over_one']:.2f}x one",
            flush=True,
        )
    rows = []
    for name in names:
        row = run_config(name, args, cores[0], cores[1])
        rows.append(row)
        per = row["cpu_ms_per_batch"]
        print(
            f"  {name:13s} {row['batches_per_s']:7.1f} "
            + " ".join(f"{per[g]:11.2f}" for g in GROUPS)
            + f"  {row['node_side_ms']:9.2f} {row['head_side_ms']:9.2f}"
            + f"   (get+copy {row['trainer_get_copy_ms']:.2f} ms; idle CPU-ms/s: "
            + ", ".join(f"{g} {v:.0f}" for g, v in row["idle_cpu_ms_per_s"].items() if v >= 0.5)
            + ")",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "scaling": scaling, "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
