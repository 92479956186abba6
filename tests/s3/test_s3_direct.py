"""The direct route for staged parts (``storage/s3direct.py`` through ``file_copy.copy_parts``):
presigned GETs received straight into a file. Against moto's real S3 API for what S3 says (the
signature, missing objects, refusals, objects shorter than asked), and against the loopback HTTP
server's faults for what a transport does wrong (bodies cut short, ``Range`` ignored, 5xx, no
answer). Byte equality of every copy; the requests as the server logged them."""

import os

import pytest

from stallfree.errors import MissingShardError, RemoteReadError, ShardReadError
from stallfree.storage import file_copy, remote, s3direct
from stallfree.storage.remote import RetryPolicy
from stallfree.testing.httpserve import serve_directory

FAST = RetryPolicy(attempts=3, backoff_s=0.0)


def _object(s3, bucket, size=3 * 1000 + 17):
    data = os.urandom(size)
    fs, path = remote.url_to_fs(f"s3://{bucket}/obj.bin", **s3.storage_options)  # as open_dataset's
    fs.pipe_file(path, data)
    return fs, path, data


def _copy(fs, path, size, tmp_path, **kw):
    out = tmp_path / "copy"
    with open(out, "w+b") as f:
        file_copy.copy_parts(fs, path, size, f.fileno(), shard="obj.bin", policy=FAST, **kw)
    return out.read_bytes()


def test_parts_are_presigned_gets_written_at_their_offsets(s3, bucket, tmp_path):
    fs, path, data = _object(s3, bucket)
    s3.reset()
    assert _copy(fs, path, len(data), tmp_path, part_bytes=1000, concurrency=3) == data
    gets = [r for r in s3.requests() if r.method == "GET"]
    assert sorted(r.range for r in gets) == sorted(
        f"bytes={a}-{min(len(data), a + 1000) - 1}" for a in range(0, len(data), 1000)
    )
    assert all("X-Amz-Signature=" in r.query for r in gets)  # signed in the URL, not by s3fs
    s3.reset()
    assert _copy(fs, path, len(data), tmp_path, part_bytes=1000, direct=False) == data
    gets = [r for r in s3.requests() if r.method == "GET"]
    assert len(gets) == 4 and not any("X-Amz-Signature=" in r.query for r in gets)


def test_an_object_shorter_than_asked_is_retried_then_named(s3, bucket, tmp_path):
    fs, path, data = _object(s3, bucket)
    s3.reset()
    with pytest.raises(RemoteReadError) as info:
        _copy(fs, path, len(data) + 100, tmp_path, part_bytes=2000)
    e = info.value
    assert (e.shard, e.start, e.end, e.got) == ("obj.bin", 2000, len(data) + 100, len(data) - 2000)
    assert f"short read from s3://{path} (endpoint {s3.endpoint_url})" in str(e)
    last = [r for r in s3.requests() if r.method == "GET" and r.range.startswith("bytes=2000-")]
    assert len(last) == FAST.attempts


def test_a_missing_object_is_named_without_retries(s3, bucket, tmp_path):
    fs, _, _ = _object(s3, bucket)
    s3.reset()
    with pytest.raises(MissingShardError, match=f"s3://{bucket}/nothing.bin"):
        _copy(fs, f"{bucket}/nothing.bin", 10, tmp_path)
    assert sum(r.method == "GET" for r in s3.requests()) == 1


def test_a_refused_presigned_get_falls_back_to_the_client(s3, bucket, tmp_path, caplog):
    """A store may refuse query-string signatures (a bucket policy on ``s3:authType``, another
    region) and accept the client's own requests: the copy is read through s3fs then, and so is
    every later one; a refusal of both is access denied."""
    fs, path, data = _object(s3, bucket)
    s3.reset()
    s3.refuse(after=0, count=1, method="GET")
    assert _copy(fs, path, len(data), tmp_path, part_bytes=2000, concurrency=1) == data
    gets = [r for r in s3.requests() if r.method == "GET"]
    assert [("X-Amz-Signature=" in r.query, r.refused) for r in gets] == [
        (True, True),
        (False, False),
        (False, False),
    ]
    assert "presigned GETs refused" in caplog.text
    s3.reset()
    assert _copy(fs, path, len(data), tmp_path) == data
    assert not any("X-Amz-Signature=" in r.query for r in s3.requests())
    fs, path, data = _object(s3, bucket)  # a new filesystem: the route again, refused twice
    s3.reset()
    s3.refuse(after=0, count=2, method="GET")
    with pytest.raises(ShardReadError, match="access denied"):
        _copy(fs, path, len(data), tmp_path)
    assert [r.refused for r in s3.requests() if r.method == "GET"] == [True, True]


@pytest.mark.parametrize(
    ("options", "direct"),
    [
        ({}, False),  # botocore's presigned URLs are SigV2 unless SigV4 is asked for
        ({"config_kwargs": {"signature_version": "s3v4"}}, True),
        ({"anon": True}, True),  # unsigned URLs
        (
            {
                "client_kwargs": {"region_name": "us-east-1", "verify": False},
                "config_kwargs": {"signature_version": "s3v4"},
            },
            True,
        ),
        ({"s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": "k" * 32}}, False),
        ({"requester_pays": True}, False),
        ({"config_kwargs": {"signature_version": "s3v4", "proxies": {"http": "http://127.0.0.1:9"}}}, False),
    ],
)
def test_the_route_is_taken_only_where_a_presigned_get_says_it_all(s3, options, direct):
    fs = s3.filesystem(**options)
    route = s3direct.route_for(fs, connect_s=5, read_s=15)
    assert remote.url_to_fs("s3://b/k", **s3.storage_options)[0].config_kwargs["signature_version"] == "s3v4"
    assert (route is not None) == direct
    import fsspec

    assert s3direct.route_for(fsspec.filesystem("memory"), connect_s=5, read_s=15) is None


class _Signer:
    """What the route asks of a filesystem, ``url(path, expires)``, for a plain HTTP server: the
    transport is the real one, against the loopback server's faults."""

    def __init__(self, base: str) -> None:
        self.base = base

    def url(self, path: str, expires: int) -> str:
        return f"{self.base}/{path}"


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    data = os.urandom(50_000)
    (root / "obj.bin").write_bytes(data)
    with serve_directory(root) as server:
        signer = _Signer(server.url)
        route = s3direct.DirectRoute(signer, connect_s=2, read_s=0.5)
        yield server, signer, route, data


def _part(route, start, end, tmp_path):
    out = tmp_path / "part"
    with open(out, "w+b") as f:
        file_copy.copy_part(route, "obj.bin", start, end, f.fileno(), shard="obj.bin", policy=FAST)
        f.seek(start)
        return f.read(end - start)


def test_a_short_body_is_asked_again_and_a_good_answer_kept(served, tmp_path):
    server, _, route, data = served
    server.faults.set(short_by=100, count=1)  # the first answer lies consistently, the second is right
    assert _part(route, 1000, 41_000, tmp_path) == data[1000:41_000]
    assert server.faults.hit == 1 and server.stats.requests == 2


def test_a_server_that_ignores_range_is_an_error_not_data(served, tmp_path):
    server, _, route, _ = served
    server.faults.set(ignore_range=True)
    with pytest.raises(RemoteReadError, match="does not honour HTTP Range"):
        _part(route, 1000, 2000, tmp_path)
    assert server.stats.requests == 1  # asking again cannot help


def test_server_errors_and_silence_are_retried_then_named(served, tmp_path):
    server, _, route, data = served
    server.faults.set(status=503, count=2)
    assert _part(route, 0, 50_000, tmp_path) == data  # third attempt answered
    server.faults.set(hang=True)
    with pytest.raises(RemoteReadError, match=r"bytes 0\.\.10 of .*obj\.bin failed \(3 attempts\)"):
        _part(route, 0, 10, tmp_path)
    server.faults.clear()


def test_a_kept_alive_connection_the_server_closed_is_replaced(served, tmp_path):
    server, _, route, data = served
    assert _part(route, 0, 100, tmp_path) == data[:100]
    server.kill()  # every connection it had is gone; a new server takes the same directory
    with serve_directory(tmp_path / "root") as again:
        route.fs.base = again.url.rstrip("/")
        route._urls.clear()
        assert _part(route, 100, 200, tmp_path) == data[100:200]
        assert again.stats.requests == 1


def test_a_route_remembers_a_bounded_number_of_signed_urls(served):
    _, signer, route, _ = served
    signed = [route.url(f"shard-{i:06d}.tar") for i in range(s3direct.URLS_KEPT + 50)]
    assert signed[-1] == f"{signer.base}/shard-{s3direct.URLS_KEPT + 49:06d}.tar"
    assert len(route._urls) == s3direct.URLS_KEPT  # a dataset of 10^5 shards keeps no 10^5 URLs
    assert route.url("shard-000000.tar") == f"{signer.base}/shard-000000.tar"  # signed again


def test_a_server_dying_mid_body_is_an_error_not_data(tmp_path):
    """A body that stops before its ``Content-Length`` (the server killed while it sends 1 MB at
    ~0.5 MB/s, in 64 KB pieces): asked again, refused, then ``RemoteReadError``; whichever moment the kill lands
    on (before the request, mid-body), the outcome is the same error."""
    import threading
    import time

    root = tmp_path / "root"
    root.mkdir()
    size = 1 << 20
    (root / "obj.bin").write_bytes(os.urandom(size))
    with serve_directory(root, bandwidth_bytes_per_s=500_000) as server:
        signer = _Signer(server.url)  # the route holds it weakly, as it does a filesystem
        route = s3direct.DirectRoute(signer, connect_s=2, read_s=5)
        outcome: list[BaseException] = []

        def copy() -> None:
            try:
                _part(route, 0, size, tmp_path)
            except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
                outcome.append(exc)

        t = threading.Thread(target=copy)
        t.start()
        time.sleep(0.3)  # about a third of the body sent (not a timing assertion: see the docstring)
        server.kill()
        t.join(timeout=60)
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], RemoteReadError), outcome
    assert outcome[0].start == 0 and outcome[0].end == size


def test_the_lead_says_when_it_stages_nothing(tmp_path):
    """A ``LeadStaging`` whose set-up failed stages nothing, and says so: the loader then leaves
    the next window's shards in the workers' tasks (``Task.stage_ahead``)."""
    from stallfree.loader.lead_staging import LeadStaging
    from stallfree.storage.staging import Staging

    lead = LeadStaging(object(), Staging(root=str(tmp_path / "stage")), [0], [1])
    assert lead.ahead([2, 3]) is False
    lead.close()
