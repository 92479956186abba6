"""One rank of ``bench_multinode.py`` (started by torchrun inside a node namespace): epochs of a
fixed step time over one loader reading remote shards; writes ``OUT/LOADER-rank-R.json`` with, per
epoch, the time blocked waiting for batches, the total time, the samples delivered and (rank 0)
the storage server's byte count after the epoch.

Loaders (the same data, the same batch size, workers and step time):
- ``stallfree``: ``stallfree.DataLoader`` (block order for remote shards) with the cluster cache
  over every node's ``stallfree cache serve``;
- ``torch``: ``torch.utils.data.DataLoader`` + ``DistributedSampler`` over the same shards opened
  with ``stallfree.open_dataset`` (ranged HTTP reads per sample, no cache);
- ``webdataset``: ``webdataset.WebDataset`` over the tar URLs, shards shuffled and split by rank,
  its documented 1,000-sample shuffle buffer, ``WebLoader``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from pathlib import Path

import torch
import torch.distributed as dist


def storage_bytes(url: str) -> int:
    with urllib.request.urlopen(url, timeout=30) as r:
        return int(json.loads(r.read())["bytes_sent"])


def _collate_raw(samples: list[dict]) -> dict:
    return {"__key__": [s["__key__"] for s in samples], "n": len(samples)}


def make_loader(args: argparse.Namespace, rank: int, world: int):
    """``(set_epoch, iterable)`` for the loader named by ``args.loader``."""
    import stallfree

    if args.loader == "stallfree":
        from stallfree.cache import ClusterCache

        cache = ClusterCache(args.cache, password_file=args.password_file, backoff_s=0.2, max_backoff_s=2.0)
        loader = stallfree.DataLoader(
            stallfree.open_dataset(args.data),
            batch_size=args.batch_size,
            shuffle=True,
            seed=0,
            num_workers=args.workers,
            cache=cache,
            collate_fn=_collate_raw,
            drop_last=True,
        )
        return loader.set_epoch, loader
    if args.loader == "torch":
        from torch.utils.data import DataLoader, DistributedSampler

        dataset = stallfree.open_dataset(args.data)
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(
            dataset,
            batch_size=args.batch_size,
            sampler=sampler,
            num_workers=args.workers,
            collate_fn=_collate_raw,
            drop_last=True,
            persistent_workers=True,
        )
        return sampler.set_epoch, loader
    if args.loader == "webdataset":
        import webdataset as wds

        urls = json.loads(Path(args.data_dir_listing).read_text())

        def split_by_rank(src):
            return src[rank::world] if isinstance(src, list) else list(src)[rank::world]

        ds = wds.WebDataset(
            urls, shardshuffle=len(urls), nodesplitter=split_by_rank, seed=0, empty_check=False
        )
        ds = ds.shuffle(1000).batched(args.batch_size, collation_fn=_collate_raw, partial=False)
        loader = wds.WebLoader(ds, batch_size=None, num_workers=args.workers, persistent_workers=True)
        epoch_box = {"epoch": 0}

        def set_epoch(epoch: int) -> None:
            epoch_box["epoch"] = epoch  # WebDataset reshuffles shards itself every pass

        return set_epoch, loader
    raise ValueError(f"unknown loader {args.loader!r}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--loader", required=True, choices=["stallfree", "torch", "webdataset"])
    p.add_argument("--data", required=True)
    p.add_argument("--data-dir-listing", default=None, help="JSON list of tar URLs (webdataset)")
    p.add_argument("--stats-url", required=True)
    p.add_argument("--cache", nargs="*", default=[])
    p.add_argument("--password-file", default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument(
        "--kill-at-epoch", type=int, default=-1, help="rank 0 asks the driver to kill a cache node"
    )
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    set_epoch, loader = make_loader(args, rank, world)
    record = {
        "loader": args.loader,
        "rank": rank,
        "world": world,
        "node": int(os.environ.get("GROUP_RANK", rank)),
    }
    record["epochs"] = []
    for epoch in range(args.epochs):
        if epoch == args.kill_at_epoch and rank == 0:
            (out / "kill").write_text("now")
            deadline = time.monotonic() + 60
            while not (out / "killed").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        dist.barrier()
        set_epoch(epoch)
        wait = samples = 0.0
        first_batch = None
        start = time.perf_counter()
        it = iter(loader)
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            waited = time.perf_counter() - t
            first_batch = waited if first_batch is None else first_batch
            wait += waited
            samples += batch["n"]
            time.sleep(args.step_ms / 1000)  # the training step (GPU compute stands still here)
        total = time.perf_counter() - start
        record["epochs"].append(
            {"wait_s": wait, "total_s": total, "samples": samples, "first_batch_s": first_batch}
        )
        dist.barrier()
        if rank == 0:
            record["epochs"][-1]["storage_bytes"] = storage_bytes(args.stats_url)
        dist.barrier()
    (out / f"{args.loader}-rank-{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
