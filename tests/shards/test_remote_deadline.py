"""Reads from a server that answers but trickles (one byte every 0.2 s, each gap far under the
read timeout) end at their deadline (``remote.Timeouts.deadline_s``) with a RemoteReadError
naming URL and range, on every route: presigned GETs (``s3direct``), s3fs (staging parts and
pinned sample reads) and fsspec's HTTP client; and a process that exits while a staged download
trickles exits (issue 36 items 3 and 12b). The trickle is ``netlab.TrickleRelay`` in front of a
real server (moto's S3, the loopback HTTP server).

Every scenario runs in a child process (this file, ``python -m tests.shards.test_remote_deadline
SCENARIO ...``) with a timeout, so a hang fails a test instead of stalling the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from stallfree.testing.s3serve import moto_available
from tests.zygote import run_python

REPO = Path(__file__).resolve().parents[2]
TRICKLE_S = 0.2
# child processes against moto and a trickling relay: ~30 s for the module
pytestmark = [
    pytest.mark.skipif(moto_available() is not None, reason=str(moto_available())),
    pytest.mark.slow,
]

# errors, in one child
SCENARIOS = ("presigned", "presigned-headers", "s3fs-parts", "s3-samples", "http-samples")


_MODULE = "tests.shards.test_remote_deadline"
_MAIN = f"import runpy\nrunpy.run_module({_MODULE!r}, run_name='__main__', alter_sys=True)"


def _child(*args: str, timeout: float, torch: bool = True) -> subprocess.CompletedProcess:
    """``python -m tests.shards.test_remote_deadline ARGS`` from the repository root. A scenario that
    imports torch (the loader's) forks from the test zygote, torch imported once; it still leaves
    through the interpreter's own exit (non-daemon threads joined, atexit run), which is what the
    exit scenarios watch. One that does not (``torch=False``) starts a fresh interpreter: cheaper
    than a zygote child, whose exit alone costs more than its start."""
    if torch:
        return run_python(_MAIN, *args, cwd=REPO, timeout=timeout)
    return subprocess.run(
        [sys.executable, "-m", _MODULE, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.fixture(scope="module")
def s3():
    from stallfree.testing.s3serve import serve_s3

    with serve_s3() as server:
        yield server


@pytest.fixture(scope="module")
def observed(s3) -> dict[str, dict[str, Any]]:
    """Every error scenario once, in one child process (one interpreter start for all)."""
    r = _child(s3.endpoint_url, *SCENARIOS, timeout=150, torch=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return {x["scenario"]: x for x in map(json.loads, filter(None, r.stdout.splitlines()))}


def _assert_deadline_error(x: dict[str, Any], url: str, start: int, end: int) -> None:
    assert x["type"] == "RemoteReadError", x
    assert (x["url"], x["start"], x["end"]) == (url, start, end), x
    assert f"reading bytes {start}..{end} of {url} did not finish within its deadline" in x["message"]
    assert "the server is sending too slowly" in x["message"]


def test_presigned_part_ends_at_its_deadline(observed):
    """The first part (0..1000) is read on the calling thread: its error is the one raised."""
    x = observed["presigned"]
    _assert_deadline_error(x, f"s3://bkt-err/obj.tar (endpoint {x['endpoint']})", 0, 1000)


def test_presigned_part_whose_headers_trickle_ends_at_its_deadline(observed):
    """Status line and headers a byte at a time too: http.client reads them a line at a time,
    under no read timeout; the watchdog's shutdown of the socket ends it."""
    x = observed["presigned-headers"]
    _assert_deadline_error(x, f"s3://bkt-err/obj.tar (endpoint {x['endpoint']})", 0, 1000)


def test_s3fs_parts_end_at_their_deadline(observed):
    x = observed["s3fs-parts"]
    assert x["type"] == "RemoteReadError" and "did not finish within its deadline" in x["message"], x
    assert x["url"] == f"s3://bkt-err/obj.tar (endpoint {x['endpoint']})"
    assert (x["start"], x["end"]) in ((0, 1000), (1000, 2000), (2000, 3000), (3000, 3017))


def test_pinned_s3_sample_read_ends_at_its_deadline(observed):
    """An unstaged read (the shard's open-time header check) through s3fs, with If-Match."""
    x = observed["s3-samples"]
    url = f"s3://bkt-err/ds/shard-000000.tar (endpoint {x['endpoint']})"
    _assert_deadline_error(x, url, x["want_start"], x["want_end"])
    assert x["shard"] == "shard-000000.tar"


def test_http_sample_read_ends_at_its_deadline(observed):
    x = observed["http-samples"]
    _assert_deadline_error(x, f"{x['relay']}/ds/shard-000000.tar", x["want_start"], x["want_end"])


def test_process_exits_while_a_staged_download_trickles(s3, tmp_path):
    """The child starts staging a shard whose body trickles (its deadline set to 10 minutes, so
    only abandoning the download can end it), then returns from main: it must exit. Before the
    download threads were daemon threads, interpreter exit joined them (issue 36: alive 505 s
    later)."""
    s3.create_bucket("bkt-exit")
    _write("s3://bkt-exit/ds", **s3.storage_options)
    r = _child(s3.endpoint_url, "exit-staged", str(tmp_path), timeout=90, torch=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1])["trickling"] is True


def test_process_exits_after_a_staged_read_of_a_shard_rewritten_shorter(s3, tmp_path):
    """12b: a loader staging a shard rewritten shorter than its manifest says gets the error
    naming it, and the process exits."""
    s3.create_bucket("bkt-short")
    _write("s3://bkt-short/ds", **s3.storage_options)
    fs = s3.filesystem()
    fs.pipe("bkt-short/ds/shard-000001.tar", fs.cat_file("bkt-short/ds/shard-000001.tar")[:-700])
    r = _child(s3.endpoint_url, "exit-shorter", str(tmp_path), timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    x = json.loads(r.stdout.splitlines()[-1])
    assert x["type"] in ("CorruptShardError", "RemoteReadError", "HashMismatchError"), x
    assert "shard-000001.tar" in x["message"] and x["delivered_wrong"] == 0, x


def test_process_exits_after_an_unstaged_loader_without_workers_gives_up():
    """0 workers, 4 fetch threads, staging=False, every shard read trickling (deadline 10
    minutes): the loader's WorkerHungError comes at worker_timeout and the process then exits.
    Before the fetch threads were daemon threads (a ThreadPoolExecutor), exit waited for the
    reads' deadline."""
    r = _child("-", "exit-fetch", timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    x = json.loads(r.stdout.splitlines()[-1])
    assert x["type"] == "WorkerHungError" and "made no progress" in x["message"], x


def test_daemon_pool_runs_what_is_submitted_and_cancels_what_has_not_started():
    import threading

    from stallfree.storage.daemon_pool import DaemonThreadPool

    pool = DaemonThreadPool(2, thread_name_prefix="t-pool")
    assert [f.result(timeout=10) for f in [pool.submit(pow, 2, k) for k in range(5)]] == [1, 2, 4, 8, 16]
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(timeout=10)
    gate, started = threading.Event(), threading.Semaphore(0)

    def hold() -> bool:
        started.release()
        return gate.wait(10)

    running = [pool.submit(hold) for _ in range(2)]
    assert started.acquire(timeout=10) and started.acquire(timeout=10)  # both threads busy
    queued = pool.submit(pow, 3, 2)
    names = {t.name for t in threading.enumerate() if t.name.startswith("t-pool_")}
    assert len(names) == 2 and all(t.daemon for t in threading.enumerate() if t.name in names)
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(pow, 1, 1)
    gate.set()
    assert [f.result(timeout=10) for f in running] == [True, True]


# -- the child ------------------------------------------------------------------------------------


def _emit(scenario: str, **fields: Any) -> None:
    print(json.dumps({"scenario": scenario, **fields}), flush=True)


def _error_fields(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        **{k: getattr(exc, k, None) for k in ("url", "start", "end", "got", "key", "shard")},
    }


def _samples(n: int = 6) -> list[dict[str, Any]]:
    return [{"__key__": f"s{i:03d}", "bin": bytes([i]) * (1000 + 10 * i)} for i in range(n)]


def _write(url: str, **options: Any) -> None:
    from stallfree.shards.writer import ShardWriter

    with ShardWriter(url, format="tar", max_samples=3, **options) as w:
        for s in _samples():
            w.write(s)


def _first_header_check(idx: bytes) -> tuple[int, int]:
    """The first range a tar reader asks for at open (from its ``.idx``): the first header."""
    line = idx.decode().splitlines()[1].split()
    return int(line[1]) - 512, int(line[1])


def _s3_scenarios(endpoint: str, scenarios: list[str]) -> None:
    from stallfree.shards.open import open_dataset
    from stallfree.storage import file_copy, remote
    from stallfree.testing.netlab import TrickleRelay
    from stallfree.testing.s3serve import S3Server

    s3 = S3Server(int(endpoint.rsplit(":", 1)[1]), None)  # the parent's server
    remote.DEFAULT_POLICY = remote.RetryPolicy(attempts=3, backoff_s=0.01, max_backoff_s=0.05)
    short = remote.Timeouts(connect_s=5, read_s=3, part_grace_s=1.0, part_min_bytes_per_s=1e9)
    s3.create_bucket("bkt-err")
    data = os.urandom(3017)
    s3.filesystem().pipe_file("bkt-err/obj.tar", data)
    _write("s3://bkt-err/ds", **s3.storage_options)
    header = _first_header_check(s3.filesystem().cat_file("bkt-err/ds/shard-000000.idx"))
    with (
        tempfile.TemporaryDirectory() as tmp,
        TrickleRelay(("127.0.0.1", s3.port), TRICKLE_S, match=b".tar") as body_relay,
        TrickleRelay(("127.0.0.1", s3.port), TRICKLE_S, match=b".tar?", headers=True) as head_relay,
    ):
        for scenario in scenarios:
            relay = head_relay if scenario == "presigned-headers" else body_relay
            options = {**s3.storage_options, "endpoint_url": relay.url, "stallfree_timeouts": short}
            try:
                if scenario == "s3-samples":
                    open_dataset("s3://bkt-err/ds", **options)[0]
                else:
                    fs, path = remote.url_to_fs("s3://bkt-err/obj.tar", **options)
                    with open(f"{tmp}/copy", "w+b") as f:
                        file_copy.copy_parts(
                            fs, path, len(data), f.fileno(), shard="obj.tar", part_bytes=1000,
                            concurrency=4, direct=scenario.startswith("presigned"),
                        )  # fmt: skip
                _emit(scenario, type=None)
            except Exception as exc:  # noqa: BLE001 - the child reports every outcome
                _emit(
                    scenario,
                    endpoint=relay.url,
                    want_start=header[0],
                    want_end=header[1],
                    **_error_fields(exc),
                )


def _http_scenario() -> None:
    from stallfree.shards.open import open_dataset
    from stallfree.storage import remote
    from stallfree.testing.httpserve import serve_directory
    from stallfree.testing.netlab import TrickleRelay

    short = remote.Timeouts(connect_s=5, read_s=3, part_grace_s=1.0, part_min_bytes_per_s=1e9)
    with tempfile.TemporaryDirectory() as tmp:
        _write(f"{tmp}/ds")
        header = _first_header_check(Path(tmp, "ds", "shard-000000.idx").read_bytes())
        with serve_directory(tmp) as server:
            port = int(server.url.rsplit(":", 1)[1])
            with TrickleRelay(("127.0.0.1", port), TRICKLE_S, match=b".tar ") as relay:
                try:
                    open_dataset(f"{relay.url}/ds", stallfree_timeouts=short)[0]
                    _emit("http-samples", type=None)
                except Exception as exc:  # noqa: BLE001
                    fields = _error_fields(exc)
                    _emit("http-samples", relay=relay.url, want_start=header[0], want_end=header[1], **fields)


def _exit_staged(endpoint: str, tmp: str) -> None:
    """Start staging shard 0 through a trickling relay, wait until its body trickles, return."""
    from stallfree.loader.lead_staging import LeadStaging
    from stallfree.shards.open import open_dataset
    from stallfree.storage import remote
    from stallfree.storage.staging import Staging
    from stallfree.testing.netlab import TrickleRelay
    from stallfree.testing.s3serve import S3Server

    s3 = S3Server(int(endpoint.rsplit(":", 1)[1]), None)
    patient = remote.Timeouts(part_grace_s=600.0)  # only abandoning the download ends it
    relay = TrickleRelay(("127.0.0.1", s3.port), TRICKLE_S, match=b".tar?").start()  # presigned GETs
    options = {**s3.storage_options, "endpoint_url": relay.url, "stallfree_timeouts": patient}
    ds = open_dataset("s3://bkt-exit/ds", **options)
    LeadStaging(ds, Staging(root=f"{tmp}/staging"), shards=[0])
    _emit("exit-staged", trickling=relay.trickling.wait(30))


def _exit_shorter(endpoint: str, tmp: str) -> None:
    """A loader with workers staging a dataset whose second shard was rewritten shorter."""
    import stallfree
    from stallfree.shards.open import open_dataset
    from stallfree.storage.staging import Staging
    from stallfree.testing.s3serve import S3Server

    s3 = S3Server(int(endpoint.rsplit(":", 1)[1]), None)
    ds = open_dataset("s3://bkt-short/ds", **s3.storage_options)
    truth = {s["__key__"]: s["bin"] for s in _samples()}
    loader = stallfree.DataLoader(
        ds,
        batch_size=2,
        num_workers=2,
        collate_fn=list,
        staging=Staging(root=f"{tmp}/staging", part_bytes=1024),
    )
    wrong = 0
    try:
        for batch in loader:
            wrong += sum(s["bin"] != truth[s["__key__"]] for s in batch)
        _emit("exit-shorter", type=None, delivered_wrong=wrong)
    except Exception as exc:  # noqa: BLE001 - the child reports every outcome
        _emit("exit-shorter", delivered_wrong=wrong, **_error_fields(exc))


def _exit_fetch() -> None:
    """An unstaged loader without workers over a trickling HTTP server gives up; return."""
    import stallfree
    from stallfree.shards.open import open_dataset
    from stallfree.storage import remote
    from stallfree.testing.httpserve import serve_directory
    from stallfree.testing.netlab import TrickleRelay

    patient = remote.Timeouts(part_grace_s=600.0)  # only abandoning the reads ends them
    with tempfile.TemporaryDirectory() as tmp:
        _write(f"{tmp}/ds")
        with serve_directory(tmp) as server:
            port = int(server.url.rsplit(":", 1)[1])
            relay = TrickleRelay(("127.0.0.1", port), TRICKLE_S, match=b".tar ").start()
            ds = open_dataset(f"{relay.url}/ds", stallfree_timeouts=patient)
            loader = stallfree.DataLoader(
                ds, batch_size=1, num_workers=0, fetch_threads=4, staging=False, collate_fn=list,
                worker_timeout=3,
            )  # fmt: skip
            try:
                next(iter(loader))
                _emit("exit-fetch", type=None)
            except Exception as exc:  # noqa: BLE001 - the child reports every outcome
                _emit("exit-fetch", **_error_fields(exc))


def main(endpoint: str, scenarios: list[str]) -> None:
    if scenarios[0] == "exit-fetch":
        _exit_fetch()
    elif scenarios[0] == "exit-staged":
        _exit_staged(endpoint, scenarios[1])
    elif scenarios[0] == "exit-shorter":
        _exit_shorter(endpoint, scenarios[1])
    else:
        _s3_scenarios(endpoint, [s for s in scenarios if s != "http-samples"])
        if "http-samples" in scenarios:
            _http_scenario()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
