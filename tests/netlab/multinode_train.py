"""One rank of the multi-node test job (started by torchrun inside a node namespace): epochs over a
remote sharded dataset through stallfree.DataLoader with the cluster cache spanning every node.

Writes ``OUT/rank-R.json``: per epoch, the sample keys this rank received, and (rank 0) the storage
server's byte count after the epoch. With ``--kill-at-epoch E``, rank 0 writes ``OUT/kill`` after
its first batches of epoch E and waits for the test to kill a cache node, then goes on.

``--stop-at E B``: after batch B of epoch E every rank waits for the others, rank 0 writes the
loader's state to ``OUT/state.json`` (what a checkpoint holds), and the job dies there (exit 3,
no cleanup), as a preempted job does. ``--resume STATE`` starts from such a state, on any number
of nodes.
"""

from __future__ import annotations

import argparse
import json
import os
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
    p.add_argument("--stop-at", type=int, nargs=2, default=None, metavar=("EPOCH", "BATCH"))
    p.add_argument("--resume", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    dataset = stallfree.open_dataset(args.data)
    cache = ClusterCache(args.cache, password_file=args.password_file, backoff_s=0.2, max_backoff_s=1.0)
    loader = stallfree.DataLoader(dataset, batch_size=8, shuffle=True, seed=3, num_workers=1, cache=cache)
    record: dict = {"rank": rank, "world": dist.get_world_size(), "epochs": [], "storage_bytes": []}
    first = 0
    if args.resume:
        state = json.loads(Path(args.resume).read_text())
        loader.load_state_dict(state)
        first = state["epoch"]
    for epoch in range(first, args.epochs):
        if epoch != first or not args.resume:
            loader.set_epoch(epoch)  # not for the epoch being resumed: the state holds it
        keys: list[str] = []
        for b, batch in enumerate(loader):
            keys.extend(batch["__key__"])
            if args.stop_at == [epoch, b]:
                record["epochs"].append(keys)
                (out / f"rank-{rank}.json").write_text(json.dumps(record))
                dist.barrier()  # every rank is past batch b: the state covers what all received
                if rank == 0:
                    (out / "state.json").write_text(json.dumps(loader.state_dict()))
                dist.barrier()
                os._exit(3)
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
