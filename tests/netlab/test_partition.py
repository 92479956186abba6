"""A cache node cut off by the network (100% loss, not a refused connection) is marked down within
the client's timeout, its keys become misses (never an error), and it is used again once the
network heals: the documented bound is ``timeout_s`` for the first call that meets the partition,
then ``backoff_s`` doubling up to ``max_backoff_s`` between retries."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stallfree.cache.credentials import ensure_secret_file
from stallfree.testing.netlab import NetLab, unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")
REPO = Path(__file__).parent.parent.parent
TIMEOUT_S, MAX_BACKOFF_S = 1.0, 0.5

CLIENT = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from stallfree.cache import ClusterCache
    from stallfree.cache.base import CacheKey

    url, password_file, control = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    timeout_s, max_backoff_s = float(sys.argv[4]), float(sys.argv[5])

    def wait_for(name):
        deadline = time.monotonic() + 60
        while not (control / name).exists():
            if time.monotonic() > deadline:
                sys.exit(f"no {name} from the test")
            time.sleep(0.02)

    cache = ClusterCache([url], password_file=password_file, timeout_s=timeout_s, connect_timeout_s=timeout_s,
                         backoff_s=0.1, max_backoff_s=max_backoff_s)
    keys = [CacheKey("fp", i, "raw") for i in range(20)]
    cache.put_many([(k, b"v%d" % k.index) for k in keys])
    out = {"before": sum(v is not None for v in cache.get_many(keys))}
    (control / "ready").write_text("")
    wait_for("partitioned")
    t = time.monotonic()
    got = cache.get_many(keys)
    out["first_call_s"] = time.monotonic() - t
    out["during"] = sum(v is not None for v in got)
    out["state"] = cache.stats()["servers"][url]["state"]
    t = time.monotonic()
    for _ in range(5):
        cache.get_many(keys)  # the breaker is open: misses at once
    out["next_calls_s"] = time.monotonic() - t
    (control / "measured").write_text("")
    wait_for("healed")
    t = time.monotonic()
    while sum(v is not None for v in cache.get_many(keys)) < len(keys) and time.monotonic() - t < 30:
        time.sleep(0.05)
    out["recovered_s"] = time.monotonic() - t
    out["after"] = sum(v is not None for v in cache.get_many(keys))
    out["state_after"] = cache.stats()["servers"][url]["state"]
    print(json.dumps(out), flush=True)
    """
)


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"client stopped or stalled before {path.name}: {proc.communicate()}")
        time.sleep(0.02)


def test_a_partitioned_cache_node_is_a_miss_then_comes_back(tmp_path):
    password_file = tmp_path / "pw"
    ensure_secret_file(password_file)
    control = tmp_path / "control"
    control.mkdir()
    with NetLab(nodes=2, storage=False) as lab:
        node1 = lab.nodes[1]
        serve = lab.popen(
            node1,
            [
                sys.executable,
                "-m",
                "stallfree",
                "cache",
                "serve",
                "--bind",
                node1.address,
                "--port",
                "6381",
                "--password-file",
                str(password_file),
                "--dir",
                str(tmp_path / "srv"),
            ],  # fmt: skip
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        while "serving" not in (line := serve.stderr.readline()):
            assert line, "cache serve exited"
        url = f"redis://{node1.address}:6381"
        argv = [
            sys.executable,
            "-c",
            CLIENT,
            url,
            str(password_file),
            str(control),
            str(TIMEOUT_S),
            str(MAX_BACKOFF_S),
        ]
        client = lab.popen("node0", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        _wait_file(control / "ready", client)
        lab.partition(node1)
        (control / "partitioned").write_text("")
        _wait_file(control / "measured", client)
        lab.heal(node1)
        (control / "healed").write_text("")
        stdout, stderr = client.communicate(timeout=60)
    assert client.returncode == 0, stderr
    out = json.loads(stdout.strip().splitlines()[-1])
    print(out)
    assert out["before"] == 20
    assert out["during"] == 0 and out["state"] == "down"
    # bounded: one timeout for the call that meets the partition (slack for a loaded machine), then
    # the open breaker answers without the network
    assert out["first_call_s"] <= 2 * TIMEOUT_S + 1.0, out
    assert out["next_calls_s"] <= 2 * TIMEOUT_S + 1.0, out
    assert out["after"] == 20 and out["state_after"] != "down", out
    assert "Traceback" not in stderr
    assert stderr.count("unusable") <= 10, stderr
