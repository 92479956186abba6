"""Child process of ``test_remote_faults.py``: serves a dataset over loopback HTTP, makes the
server misbehave (``Faults``, ``kill``), reads through ``open_dataset`` and prints one JSON line per
read: ``ok`` (bytes equal to the local copy), ``wrong`` (a sample delivered with other bytes: the
bug this guards against) or ``error`` (with the error's fields). Run in a subprocess with a
timeout, so a hang is a failed test, not a stuck suite.

    python -m tests.shards.remote_faults_child ROOT SCENARIO [SCENARIO ...]

Each line carries its ``scenario``; every scenario gets a fresh server.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from stallfree.shards.open import open_dataset
from stallfree.storage import remote
from stallfree.testing.httpserve import serve_directory

FAST = remote.RetryPolicy(attempts=3, backoff_s=0.01, max_backoff_s=0.05)


_SCENARIO = [""]


def _emit(**fields: Any) -> None:
    print(json.dumps({"scenario": _SCENARIO[0], **fields}), flush=True)


def _record(what: str, i: Any, read, truth) -> None:
    try:
        got = read()
    except Exception as exc:  # noqa: BLE001 - the child reports every outcome
        _emit(
            what=what,
            i=i,
            result="error",
            type=type(exc).__name__,
            message=str(exc),
            **{k: getattr(exc, k, None) for k in ("url", "start", "end", "got", "key", "shard")},
        )
        return
    _emit(what=what, i=i, result="ok" if got == truth else "wrong")


def _fast_retries() -> None:
    """Short backoff so a fault costs milliseconds (the defaults are for real networks)."""
    remote.DEFAULT_POLICY = FAST


def main(root: str, scenarios: list[str]) -> None:
    _fast_retries()
    for scenario in scenarios:
        _SCENARIO[0] = scenario
        run(scenario, root)


def run(scenario: str, root: str) -> None:
    kind = "arrow" if scenario.startswith("arrow") else "many" if scenario == "loader-dies" else "tar"
    truth = open_dataset(f"{root}/{kind}")
    n = len(truth)
    with serve_directory(root) as server:
        if scenario == "open-500":
            server.faults.set(status=500)
            _record("open", None, lambda: open_dataset(f"{server.url}/tar"), None)
            return
        if scenario == "open-dead":
            url = server.url
            server.kill()
            _record("open", None, lambda: open_dataset(f"{url}/tar"), None)
            return
        fmt = kind
        opts: dict[str, Any] = {}
        if scenario == "hang":
            import aiohttp

            opts = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(sock_connect=1, sock_read=0.5)}}
        ds = open_dataset(f"{server.url}/{fmt}", **opts)
        for s in range(len(ds.shard_sizes)):  # open every shard while the server is well
            ds[sum(ds.shard_sizes[:s])]
        suffix = ".arrow" if fmt == "arrow" else ".tar"
        if scenario in ("short", "arrow-short"):
            server.faults.set(short_by=7, suffix=suffix)
        elif scenario == "short-once":
            server.faults.set(short_by=7, suffix=suffix, count=1)
        elif scenario == "ignore-range":
            server.faults.set(ignore_range=True, suffix=suffix)
        elif scenario == "hang":
            server.faults.set(hang=True, suffix=suffix)
        if scenario == "loader-dies":  # through the DataLoader's worker processes (forked)
            import stallfree

            loader = stallfree.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=list)
            seen = 0
            t0 = None
            try:
                for batch in loader:
                    for sample in batch:
                        _emit(what="loaded", i=seen, result="ok" if sample == truth[seen] else "wrong")
                        seen += 1
                    if seen == 20:  # far ahead of what the workers have read
                        server.kill()
                        t0 = time.monotonic()
                _emit(what="loader", result="finished")
            except Exception as exc:  # noqa: BLE001 - the child reports every outcome
                _emit(what="loader", result="error", type=type(exc).__name__, message=str(exc), after=seen)
            _emit(what="elapsed", seconds=None if t0 is None else time.monotonic() - t0)
            return
        if scenario == "dies":
            half = n // 2
            for i in range(half):
                _record("get", i, lambda i=i: ds[i], truth[i])
            server.kill()
            t0 = time.monotonic()
            for i in range(half, n):
                _record("get", i, lambda i=i: ds[i], truth[i])
            _emit(what="elapsed", seconds=time.monotonic() - t0)
            return
        t0 = time.monotonic()
        for i in range(n):
            _record("get", i, lambda i=i: ds[i], truth[i])
            if scenario == "hang":
                break  # one timed-out read says it; more only cost time
        _emit(what="elapsed", seconds=time.monotonic() - t0)
        if scenario == "hang":
            server.faults.clear()
            return
        everything = list(range(n))
        _record("get_many", everything, lambda: ds.get_many(everything), [truth[i] for i in everything])
        _emit(what="hit", count=server.faults.hit)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
