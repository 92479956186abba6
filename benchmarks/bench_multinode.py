"""Multi-node data stall, side by side: N nodes with their own addresses (``stallfree.testing.netlab``
namespaces), storage one ``--delay-ms`` away each way (an HTTP range server behind the lab's latency
relay), one ``stallfree cache serve`` per node, one torchrun rank per node with ``--workers``
loader workers and a fixed ``--step-ms`` training step. Loaders, in one run, on the same data:

- stallfree: ``stallfree.DataLoader`` (block order) + the cluster cache spanning every node;
- torch: ``torch.utils.data.DataLoader`` + ``DistributedSampler`` over the same remote shards;
- webdataset: ``webdataset.WebDataset`` over the same tar URLs (shards split by rank);
- stallfree, node 1's cache killed before epoch 2 (the tier down for the rest of the run).

Reported per loader and epoch: stall % per node (time blocked in ``next()`` / epoch time), storage
bytes read / data size, samples/s. Run as root (namespaces)::

    .venv/bin/python benchmarks/bench_multinode.py --nodes 2 4 --delay-ms 10 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import stallfree  # noqa: E402
from stallfree.cache.credentials import ensure_secret_file  # noqa: E402
from stallfree.testing.netlab import NetLab, unavailable_reason  # noqa: E402

TORCHRUN = Path(sys.executable).with_name("torchrun")
HTTP_PORT, RELAY_PORT, CACHE_PORT, RDZV_PORT = 7100, 8100, 6380, 29400
LOADERS = ["stallfree", "torch", "webdataset", "stallfree-cache-node-killed"]


def write_dataset(root: Path, samples: int, mean_kb: float, shard_mb: float) -> int:
    """Samples whose sizes follow ImageNet's JPEGs (log-normal, median ~``mean_kb``); bytes written."""
    rng = np.random.default_rng(0)
    sizes = np.clip(rng.lognormal(np.log(mean_kb * 1000 * 0.85), 0.55, samples), 2000, 2_000_000).astype(int)
    with stallfree.ShardWriter(str(root), format="tar", max_bytes=int(shard_mb * 1e6)) as w:
        for i, size in enumerate(sizes):
            w.write({"__key__": f"{i:07d}", "jpg": rng.bytes(int(size)), "cls": int(i % 1000)})
    return sum(p.stat().st_size for p in root.glob("*.tar"))


def _serve_caches(lab: NetLab, tmp: Path, password_file: Path, tag: str) -> dict[str, subprocess.Popen]:
    caches = {}
    for node in lab.nodes:
        argv = [
            sys.executable, "-m", "stallfree", "cache", "serve", "--bind", node.address,
            "--port", str(CACHE_PORT), "--capacity", "2GB", "--password-file", str(password_file),
            "--dir", str(tmp / f"cache-{tag}-{node.name}"),
        ]  # fmt: skip
        serve = lab.popen(node, argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
        while "serving" not in (line := serve.stderr.readline()):
            if not line:
                raise RuntimeError(f"cache serve on {node.name} exited")
        caches[node.name] = serve
    return caches


def run_loader(lab: NetLab, loader: str, ctx: dict, args: argparse.Namespace) -> list[dict]:
    """One torchrun job per node for ``loader``; the per-rank records."""
    tmp: Path = ctx["tmp"]
    out = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{loader}-"))
    kill = loader == "stallfree-cache-node-killed"
    name = "stallfree" if kill else loader
    caches = _serve_caches(lab, tmp, ctx["password_file"], out.name) if name == "stallfree" else {}
    rdzv = f"{lab.nodes[0].address}:{RDZV_PORT}"
    procs = []
    for i, node in enumerate(lab.nodes):
        argv = [
            str(TORCHRUN), "--nnodes", str(len(lab.nodes)), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", f"bench-{out.name}",
            "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", node.address, "--max-restarts", "0",
            str(REPO / "benchmarks" / "multinode_rank.py"), "--loader", name,
            "--data", ctx["data_url"], "--data-dir-listing", str(ctx["listing"]),
            "--stats-url", ctx["stats_url"], "--epochs", str(args.epochs),
            "--batch-size", str(args.batch_size), "--workers", str(args.workers),
            "--step-ms", str(args.step_ms), "--out", str(out),
            "--kill-at-epoch", "1" if kill else "-1",
        ]  # fmt: skip
        if name == "stallfree":
            argv += ["--cache", *ctx["cache_urls"], "--password-file", str(ctx["password_file"])]
        env = {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(REPO),
            "GLOO_SOCKET_IFNAME": "eth0",
            "OMP_NUM_THREADS": "1",
        }
        log = open(out / f"{node.name}.log", "w")  # noqa: SIM115 - one per job, closed below
        procs.append(lab.popen(node, argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    deadline = time.monotonic() + args.timeout
    while any(p.poll() is None for p in procs):
        if kill and (out / "kill").exists() and not (out / "killed").exists():
            caches["node1"].kill()
            (out / "killed").write_text("done")
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise RuntimeError(f"{loader} did not finish in {args.timeout}s; logs in {out}")
        time.sleep(0.1)
    for serve in caches.values():
        serve.kill()
    if any(p.returncode for p in procs):
        tail = "\n".join((out / f"{n.name}.log").read_text()[-2000:] for n in lab.nodes)
        raise RuntimeError(f"{loader} failed:\n{tail}")
    return [json.loads((out / f"{name}-rank-{r}.json").read_text()) for r in range(len(lab.nodes))]


def summarise(loader: str, records: list[dict], payload: int, base_bytes: int) -> dict:
    """Per epoch: stall % per node, storage bytes / data, samples/s."""
    epochs = []
    before = base_bytes
    for e in range(len(records[0]["epochs"])):
        per_node = {
            f"node{r['rank']}": 100 * r["epochs"][e]["wait_s"] / r["epochs"][e]["total_s"] for r in records
        }
        total = max(r["epochs"][e]["total_s"] for r in records)
        samples = sum(r["epochs"][e]["samples"] for r in records)
        read = records[0]["epochs"][e]["storage_bytes"] - before
        before = records[0]["epochs"][e]["storage_bytes"]
        epochs.append(
            {
                "stall_pct": per_node,
                "storage_read": read / payload,
                "samples_per_s": samples / total,
                "first_batch_s": max(r["epochs"][e]["first_batch_s"] or 0 for r in records),
            }
        )
    return {"loader": loader, "epochs": epochs, "last_bytes": before}


def bench(nodes: int, args: argparse.Namespace, tmp: Path) -> list[dict]:
    data = tmp / f"data-{nodes}" / "ds"
    payload = write_dataset(data, args.samples, args.sample_kb, args.shard_mb)
    password_file = tmp / "cache.password"
    ensure_secret_file(password_file)
    results = []
    with NetLab(nodes=nodes) as lab:
        st = lab.storage.address
        storage = lab.popen(
            "storage",
            [
                sys.executable,
                str(REPO / "tests" / "netlab" / "storage_server.py"),
                str(data.parent),
                st,
                str(HTTP_PORT),
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert storage.stdout.readline().strip() == "ready"
        lab.relay("storage", RELAY_PORT, to=(st, HTTP_PORT), one_way_delay_s=args.delay_ms / 1000)
        base = f"http://{st}:{RELAY_PORT}/ds"
        listing = tmp / f"tars-{nodes}.json"
        listing.write_text(json.dumps([f"{base}/{p.name}" for p in sorted(data.glob("*.tar"))]))
        ctx = {
            "tmp": tmp,
            "password_file": password_file,
            "data_url": base,
            "listing": listing,
            "stats_url": f"http://{st}:{HTTP_PORT + 1}/",
            "cache_urls": [f"redis://{n.address}:{CACHE_PORT}" for n in lab.nodes],
        }
        bytes_so_far = 0
        for loader in args.loaders:
            records = run_loader(lab, loader, ctx, args)
            summary = summarise(loader, records, payload, bytes_so_far)
            bytes_so_far = summary.pop("last_bytes")
            summary["nodes"] = nodes
            results.append(summary)
            _print_summary(summary)
    return results


def _print_summary(s: dict) -> None:
    for e, ep in enumerate(s["epochs"]):
        stalls = " ".join(f"{v:5.1f}" for v in ep["stall_pct"].values())
        print(
            f"{s['nodes']} nodes  {s['loader']:<28} epoch {e + 1}: stall % per node [{stalls}]  "
            f"storage {ep['storage_read']:.3f}x  {ep['samples_per_s']:7.0f} samples/s  "
            f"first batch {ep['first_batch_s']:.2f}s",
            flush=True,
        )


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({r["nodes"] for r in results})
    fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4.6), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], configs, strict=True):
        rows = [r for r in results if r["nodes"] == n]
        width = 0.8 / len(rows)
        for k, r in enumerate(rows):
            # the steady state: stall % per node in the last epoch
            stalls = list(r["epochs"][-1]["stall_pct"].values())
            ax.bar(np.arange(len(stalls)) + k * width, stalls, width, label=r["loader"])
        ax.set_xticks(np.arange(n) + 0.4 - width / 2, [f"node{i}" for i in range(n)])
        ax.set_title(f"{n} nodes, last epoch")
        ax.set_ylabel("stall % (time blocked in next())")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay between storage and nodes")
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument(
        "--sample-kb", type=float, default=110.0, help="median sample size (ImageNet JPEGs: ~110 KB)"
    )
    p.add_argument("--shard-mb", type=float, default=16.0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--loaders", nargs="+", default=LOADERS, choices=LOADERS)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"bench_multinode: {reason}", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-multinode-") as tmp:
        for n in args.nodes:
            results += bench(n, args, Path(tmp))
    ratios = []
    for n in args.nodes:
        by = {r["loader"]: r for r in results if r["nodes"] == n}
        if "stallfree" in by and "torch" in by:
            ours = statistics.mean(by["stallfree"]["epochs"][-1]["stall_pct"].values())
            theirs = statistics.mean(by["torch"]["epochs"][-1]["stall_pct"].values())
            ratios.append((n, ours, theirs))
    for n, ours, theirs in ratios:
        print(
            f"{n} nodes, last epoch: stallfree stall {ours:.1f}% vs torch {theirs:.1f}% ({ours / max(theirs, 1e-9):.2f}x)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
