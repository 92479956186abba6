"""The cluster tier's read, before vs after issue 36 item 7, side by side in one run.

Before: the client read a batch with ``MGET`` (plus ``EXISTS`` of the full flag, pipelined), so a
value of any size came back whole. After (``stallfree/cache/redis_functions.py``): one ``FCALL_RO``
of the admin-loaded ``stallfree_sizes_v1`` for the sizes, then ``MGET`` of the entries within the
client's bound only. Also the design we did not take: one ``FCALL`` whose Lua returns the values
itself (one round trip, but Lua copies every value twice). Same server, same keys, alternating
rounds; reported as batches/s and ratios to before (the machine is shared: read the ratios).

    .venv/bin/python benchmarks/bench_cluster_read.py [--entries 256] [--value-kb 110] [--batch 64] [--rounds 40]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from stallfree.cache import redis_functions
from stallfree.cache.redis_ops import FULL_KEY, connect
from stallfree.cache.server import RedisServer

LIMIT = 64 << 20

VALUES_IN_LUA = """#!lua name=bench_values
redis.register_function{function_name='bench_values', callback=function(keys, args)
  local limit = tonumber(args[1])
  local out = {redis.call('EXISTS', keys[1])}
  for i = 2, #keys do
    local n = redis.call('STRLEN', keys[i])
    if n > limit then out[i] = n else out[i] = redis.call('GET', keys[i]) end
  end
  return out end, flags={'no-writes'}}
"""


def mget_read(client, keys: list[bytes]) -> list:
    pipe = client.pipeline(transaction=False)
    pipe.mget(keys)
    pipe.exists(FULL_KEY)
    values, _full = pipe.execute()
    return values


def sizes_then_mget(client, keys: list[bytes]) -> list:
    return redis_functions.get_bounded(client, FULL_KEY, keys, LIMIT).values


def values_in_lua(client, keys: list[bytes]) -> list:
    return client.fcall_ro("bench_values", len(keys) + 1, FULL_KEY, *keys, LIMIT)[1:]


READS = {
    "mget (before)": mget_read,
    "sizes, then mget (after)": sizes_then_mget,
    "values from Lua (not taken)": values_in_lua,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=256)
    ap.add_argument("--value-kb", type=int, default=110, help="value size (a ~110 KB ImageNet JPEG by default)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(0)
    with RedisServer(password="pw", capacity_bytes=1 << 30, restricted=False) as server:
        client = connect({"host": server.host, "port": server.port, "password": "pw"})
        client.function_load(VALUES_IN_LUA, replace=True)
        keys = [f"sf/bench/raw/{i}".encode() for i in range(args.entries)]
        for key in keys:
            client.set(key, os.urandom(args.value_kb * 1000))
        batches = [rng.sample(keys, args.batch) for _ in range(args.rounds)]
        first = [read(client, batches[0]) for read in READS.values()]
        assert first[0] == first[1] == first[2]
        seconds = dict.fromkeys(READS, 0.0)
        for batch in batches:  # interleaved, so load on the shared machine falls on each alike
            for name, read in READS.items():
                t0 = time.perf_counter()
                read(client, batch)
                seconds[name] += time.perf_counter() - t0
        client.close()
    rates = {name: args.rounds / s for name, s in seconds.items()}
    before = rates["mget (before)"]
    if args.json:
        ratios = {name: rate / before for name, rate in rates.items()}
        print(json.dumps({"batches_per_s": rates, "ratio_to_before": ratios, "args": vars(args)}))
        return
    print(f"{args.rounds} batches of {args.batch} x {args.value_kb} KB values, one local redis-server")
    print(f"{'read':<28} {'batches/s':>10} {'MB/s':>7} {'vs before':>10}")
    for name, rate in rates.items():
        mb = rate * args.batch * args.value_kb / 1000
        print(f"{name:<28} {rate:>10.1f} {mb:>7.0f} {rate / before:>9.2f}x")


if __name__ == "__main__":
    main()
