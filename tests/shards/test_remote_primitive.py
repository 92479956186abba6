"""``shards.remote``: the one checked, retried read primitive, against a scripted filesystem (no
network): lengths checked, only transient failures retried, errors carry URL/key/range/length,
timeouts filled in only where the user set none."""

from __future__ import annotations

import os
import pickle

import aiohttp
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from stallfree.errors import MissingShardError, RemoteReadError, ShardReadError
from stallfree.storage import remote

DATA = bytes(range(256)) * 8
FAST = remote.RetryPolicy(attempts=3, backoff_s=0.0)


class Scripted(MemoryFileSystem):
    """Memory storage whose next ``cat_file`` outcomes are scripted: ``"short"`` (7 bytes
    fewer), ``"long"`` (the whole file, as a server ignoring Range), an exception to raise, or
    ``"ok"``; then normal. Counts calls."""

    protocol = "scripted"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.script: list = []
        self.calls = 0

    def cat_file(self, path, start=None, end=None, **kwargs):
        self.calls += 1
        what = self.script.pop(0) if self.script else "ok"
        if isinstance(what, BaseException):
            raise what
        data = super().cat_file(path, start=start, end=end, **kwargs)
        if what == "short":
            return data[:-7]
        if what == "long":
            return super().cat_file(path)
        return data

    def cat_ranges(self, paths, starts, ends, max_gap=None, on_error="return", **kwargs):
        out = []
        for p, s, e in zip(paths, starts, ends, strict=True):
            try:
                out.append(self.cat_file(p, start=s, end=e))
            except Exception as exc:  # noqa: BLE001 - fsspec's on_error="return" contract
                out.append(exc)
        return out


# what the client below retries itself (s3fs's module names its tuple S3_RETRYABLE_ERRORS)
FAKE_RETRYABLE_ERRORS = (TimeoutError, ConnectionResetError)


class Retrying(Scripted):
    """A client that retries some failures on its own (as s3fs does, ``retries = 5``)."""

    retries = 5


@pytest.fixture
def fs():
    f = Scripted(skip_instance_cache=True)
    f.pipe("/d/a.tar", DATA)
    yield f
    f.rm("/d", recursive=True)


def _500() -> aiohttp.ClientResponseError:
    return aiohttp.ClientResponseError(None, (), status=500, message="Internal Server Error")


def test_exact_bytes(fs):
    assert remote.read_range(fs, "/d/a.tar", 10, 900, shard="a.tar") == DATA[10:900]
    assert remote.read_range(fs, "/d/a.tar", 5, 5, shard="a.tar") == b""
    assert remote.read_ranges(fs, "/d/a.tar", [(0, 3), (100, 200)], shard="a.tar") == [
        DATA[:3],
        DATA[100:200],
    ]
    assert remote.read_file(fs, "/d/a.tar", shard="a.tar") == DATA
    assert remote.read_file(fs, "/d/a.tar", shard="a.tar", size=len(DATA)) == DATA


def test_short_read_is_retried_then_named(fs):
    fs.script = ["short"]
    assert remote.read_range(fs, "/d/a.tar", 10, 900, shard="a.tar", policy=FAST) == DATA[10:900]
    assert fs.calls == 2
    fs.script, fs.calls = ["short"] * 3, 0
    with pytest.raises(RemoteReadError) as info:
        remote.read_range(fs, "/d/a.tar", 10, 900, shard="a.tar", key="k7", policy=FAST)
    e = info.value
    assert fs.calls == 3
    assert (e.url, e.start, e.end, e.got, e.shard, e.key, e.offset) == (
        "scripted:///d/a.tar",
        10,
        900,
        883,
        "a.tar",
        "k7",
        10,
    )
    assert str(e) == (
        "short read from scripted:///d/a.tar: asked for bytes 10..900 (890 bytes), got 883 (3 attempts) "
        "(shard a.tar, sample 'k7', byte offset 10)"
    )
    again = pickle.loads(pickle.dumps(e))  # crosses worker -> main intact
    assert (type(again), str(again), again.url, again.got) == (RemoteReadError, str(e), e.url, 883)
    assert isinstance(again, ShardReadError)


def test_read_ranges_rereads_only_the_bad_range(fs):
    fs.script = ["ok", "short", "ok"]
    got = remote.read_ranges(fs, "/d/a.tar", [(0, 10), (20, 40), (50, 60)], shard="a.tar", policy=FAST)
    assert got == [DATA[0:10], DATA[20:40], DATA[50:60]] and fs.calls == 4
    fs.script, fs.calls = ["ok", "short", "short", "short"], 0
    with pytest.raises(RemoteReadError) as info:
        remote.read_ranges(fs, "/d/a.tar", [(0, 10), (20, 40)], shard="a.tar", keys=["a", "b"], policy=FAST)
    assert (info.value.key, info.value.start, info.value.got) == ("b", 20, 13)


def test_longer_body_means_range_ignored_and_is_not_retried(fs):
    fs.script = ["long"]
    with pytest.raises(RemoteReadError, match="does not honour HTTP Range requests") as info:
        remote.read_range(fs, "/d/a.tar", 10, 20, shard="a.tar", policy=FAST)
    assert fs.calls == 1 and info.value.got == len(DATA)


@pytest.mark.parametrize(
    ("failure", "calls", "match"),
    [
        (
            ConnectionResetError("reset by peer"),
            3,
            "failed \\(3 attempts\\): ConnectionResetError: reset by peer",
        ),
        (TimeoutError(), 3, "no answer within the timeout"),
        (_500(), 3, "the server answered HTTP 500: Internal Server Error"),
        (aiohttp.ClientResponseError(None, (), status=400, message="Bad Request"), 1, "HTTP 400"),
    ],
)
def test_transport_failures(fs, failure, calls, match):
    fs.script = [failure] * 3
    with pytest.raises(RemoteReadError, match=match) as info:
        remote.read_range(fs, "/d/a.tar", 0, 10, shard="a.tar", policy=FAST)
    assert fs.calls == calls and info.value.got is None and info.value.start == 0


def test_transient_failure_then_success(fs):
    fs.script = [_500(), ConnectionResetError()]
    assert remote.read_range(fs, "/d/a.tar", 0, 10, shard="a.tar", policy=FAST) == DATA[:10]
    assert fs.calls == 3


def test_final_failures_are_not_retried(fs):
    with pytest.raises(MissingShardError, match="scripted:///d/gone.tar not found"):
        remote.read_range(fs, "/d/gone.tar", 0, 10, shard="gone.tar", policy=FAST)
    fs.script, fs.calls = [PermissionError("Access Denied")], 0
    with pytest.raises(ShardReadError, match="access denied reading scripted:///d/a.tar: Access Denied"):
        remote.read_range(fs, "/d/a.tar", 0, 10, shard="a.tar", policy=FAST)
    assert fs.calls == 1
    fs.script, fs.calls = [KeyError("a bug")], 0
    with pytest.raises(KeyError):  # not a storage failure: not ours to reword
        remote.read_range(fs, "/d/a.tar", 0, 10, shard="a.tar", policy=FAST)


def test_a_client_that_retries_itself_is_not_retried_again():
    fs = Retrying(skip_instance_cache=True)
    fs.pipe("/r/a.tar", DATA)
    fs.script = [ConnectionResetError("reset")] * 3
    with pytest.raises(RemoteReadError, match="5 attempts by Retrying"):
        remote.read_range(fs, "/r/a.tar", 0, 10, shard="a.tar", policy=FAST)
    assert fs.calls == 1
    fs.script, fs.calls = [ConnectionRefusedError("refused")] * 3, 0  # one it does not retry: we do
    with pytest.raises(RemoteReadError, match="failed \\(3 attempts\\): ConnectionRefusedError"):
        remote.read_range(fs, "/r/a.tar", 0, 10, shard="a.tar", policy=FAST)
    assert fs.calls == 3
    fs.script, fs.calls = ["short", "ok"], 0  # and lengths it never checks
    assert remote.read_range(fs, "/r/a.tar", 0, 10, shard="a.tar", policy=FAST) == DATA[:10]
    assert fs.calls == 2


def test_range_file_reads_through_the_primitive(fs):
    f = remote.RangeFile(fs, "/d/a.tar", len(DATA), shard="a.tar", policy=FAST)
    f.seek(100)
    assert f.read(10) == DATA[100:110] and f.tell() == 110
    assert f.seek(-5, 2) == len(DATA) - 5 and f.read() == DATA[-5:]
    f.seek(0)
    fs.script = ["short"] * 3
    with pytest.raises(RemoteReadError, match="short read"):
        f.read(50)
    ahead = remote.RangeFile(fs, "/d/a.tar", len(DATA), shard="a.tar", block_size=1024, policy=FAST)
    fs.calls = 0
    assert ahead.read(4) + ahead.read(4) == DATA[:8] and fs.calls == 1


def test_policy_and_timeouts_validate():
    assert list(remote.RetryPolicy(attempts=4, backoff_s=0.1, max_backoff_s=0.3).delays()) == [0.1, 0.2, 0.3]
    with pytest.raises(ValueError, match="at least 1"):
        remote.RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="positive"):
        remote.Timeouts(connect_s=0)


def test_with_timeouts_fills_only_what_the_user_left_out():
    s3 = remote.with_timeouts("s3://b/ds", {"endpoint_url": "http://h:1"})
    assert s3["config_kwargs"] == {
        "connect_timeout": 5.0,
        "read_timeout": 15.0,
        "retries": {"total_max_attempts": 1},
        "max_pool_connections": 32,
        "signature_version": "s3v4",
    }
    mine = remote.with_timeouts(
        "s3://b/ds", {"config_kwargs": {"read_timeout": 60, "signature_version": "s3"}}
    )
    assert mine["config_kwargs"]["signature_version"] == "s3"  # the user's choice, SigV2 included
    assert mine["config_kwargs"]["read_timeout"] == 60 and mine["config_kwargs"]["connect_timeout"] == 5.0
    http = remote.with_timeouts("https://h/ds", {})["client_kwargs"]["timeout"]
    assert (http.sock_connect, http.sock_read, http.total) == (5.0, 15.0, None)
    given = aiohttp.ClientTimeout(total=1)
    assert (
        remote.with_timeouts("http://h/ds", {"client_kwargs": {"timeout": given}})["client_kwargs"]["timeout"]
        is given
    )
    assert remote.with_timeouts("/local/ds", {"x": 1}) == {"x": 1}
    assert remote.with_timeouts("simplecache::s3://b/ds", {}) == {}
    opts = {"config_kwargs": {"read_timeout": 60}}
    remote.with_timeouts("s3://b", opts)
    assert opts == {"config_kwargs": {"read_timeout": 60}}  # the caller's dict is left alone


def test_exists_tells_not_found_from_could_not_ask(fs):
    assert remote.exists(fs, "/d/a.tar", shard="a.tar") and not remote.exists(fs, "/d/no", shard="no")

    class Dead(Scripted):
        def info(self, path, **kwargs):
            try:  # fsspec's HTTP info wraps the real failure in FileNotFoundError
                raise _500()
            except aiohttp.ClientResponseError as exc:
                raise FileNotFoundError(path) from exc

    with pytest.raises(RemoteReadError, match="looking up scripted:///x/manifest.json failed .*HTTP 500"):
        remote.exists(Dead(skip_instance_cache=True), "/x/manifest.json", shard="manifest.json", policy=FAST)


def test_with_session_shares_the_model_loader_not_the_session_across_fork():
    """One aiobotocore session per process (so fsspec's instance cache still finds a filesystem
    made with the same options), and after fork a new session on the parent's botocore model
    loader (its parsed JSON: ~100 ms of CPU a new client skips), never the parent's session."""
    first = remote.with_session("s3://b/ds", {"key": "k"})
    again = remote.with_session("s3a://b/other", {})
    assert first["session"] is again["session"] and first["key"] == "k"
    loader = first["session"].get_component("data_loader")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports: new session? same loader?
        child = remote.with_session("s3://b/ds", {})["session"]
        os.write(write, bytes([child is not first["session"], child.get_component("data_loader") is loader]))
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 2) == bytes([1, 1])
    os.close(read)
    mine = object()
    assert remote.with_session("s3://b/ds", {"session": mine})["session"] is mine
    assert "session" not in remote.with_session("s3://b/ds", {"profile": "p"})
    assert remote.with_session("https://h/ds", {}) == {} and remote.with_session("/local", {}) == {}
    assert remote.with_session("simplecache::s3://b/ds", {}) == {}
    fs_a = remote.url_to_fs("s3://b/ds", key="k", secret="s")[0]
    assert remote.url_to_fs("s3://b/ds", key="k", secret="s")[0] is fs_a  # instance cache still hits
