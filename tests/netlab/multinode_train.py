"""One rank of the multi-node test job (started by torchrun inside a node namespace): epochs over a
remote sharded dataset through stallfree.DataLoader with the cluster cache spanning every node.

Writes ``OUT/rank-R.json``: per epoch, the sample keys this rank received, and (rank 0) the storage
server's byte count after the epoch. With ``--kill-at-epoch E``, rank 0 writes ``OUT/kill`` after
its first batches of epoch E and waits for the test to kill a cache node, then goes on.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path

import torch.distributed as dist

import stallfree
from stallfree.cache import ClusterCache


def storage_bytes(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as r:
        return int(json.loads(r.read())["bytes_sent"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--stats-url", required=True)
    p.add_argument("--cache", nargs="+", required=True)
    p.add_argument("--password-file", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--kill-at-epoch", type=int, default=-1)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    dataset = stallfree.open_dataset(args.data)
    cache = ClusterCache(args.cache, password_file=args.password_file, backoff_s=0.2, max_backoff_s=1.0)
    loader = stallfree.DataLoader(dataset, batch_size=8, shuffle=True, seed=3, num_workers=1, cache=cache)
    record: dict = {"rank": rank, "world": dist.get_world_size(), "epochs": [], "storage_bytes": []}
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        keys: list[str] = []
        for b, batch in enumerate(loader):
            keys.extend(batch["__key__"])
            if epoch == args.kill_at_epoch and b == 1 and rank == 0:
                (out / "kill").write_text("now")
                deadline = time.monotonic() + 60
                while not (out / "killed").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
        record["epochs"].append(keys)
        dist.barrier()
        if rank == 0:
            record["storage_bytes"].append(storage_bytes(args.stats_url))
        dist.barrier()
    record["cache"] = {k: v for k, v in loader.stats().get("cache", {}).items() if isinstance(v, int | float)}
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
