"""Unstaged remote reads are pinned to the version of each shard found when it was opened (issue
36 item 4): a shard rewritten in place with the same size mid-run is ``ObjectChangedError``
naming it on S3 (If-Match on the ETag), the old bytes on a versioned bucket (read by VersionId),
and ``ChecksumMismatchError`` (the ``.sums`` CRCs) on an HTTP server that sends no version;
never a sample with the new bytes. moto's S3 API and the HTTP server on loopback."""

import contextlib
import hashlib
import pickle
import random
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import fsspec
import pytest

import stallfree
from stallfree.errors import ChecksumMismatchError, RemoteReadError
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter
from stallfree.storage import remote, stamps
from stallfree.storage.remote import ObjectChangedError, Timeouts, VersionPin
from stallfree.testing.httpserve import serve_directory

N, SIZE = 20, 2000


def _samples(seed: int) -> list[dict]:
    """N samples of SIZE bytes; another seed gives other bytes at the same sizes and keys."""
    rng = random.Random(seed)
    return [{"__key__": f"s{i:03d}", "bin": rng.randbytes(SIZE)} for i in range(N)]


def _write(url: str, seed: int, **options) -> list[dict]:
    samples = _samples(seed)
    with ShardWriter(url, format="tar", max_samples=N // 2, **options) as w:
        for s in samples:
            w.write(s)
    return samples


def _rewrite_in_place(s3, bucket: str, tmp_path) -> None:
    """shard-000000.tar replaced by a shard of the same size and keys, other bytes."""
    _write(str(tmp_path / "other"), seed=2)
    data = (tmp_path / "other" / "shard-000000.tar").read_bytes()
    fs = s3.filesystem()
    assert fs.size(f"{bucket}/ds/shard-000000.tar") == len(data)
    fs.pipe_file(f"{bucket}/ds/shard-000000.tar", data)


def _read_all(ds, truth: list[dict]) -> tuple[list[str], int]:
    """Each sample read once: the outcome per index ("ok" or the error's type) and how many
    were delivered with bytes other than the truth."""
    outcomes, wrong = [], 0
    for i in range(len(truth)):
        try:
            got = ds[i]
        except RemoteReadError as exc:
            outcomes.append(type(exc).__name__)
            continue
        except ChecksumMismatchError as exc:
            outcomes.append(type(exc).__name__)
            continue
        wrong += got["bin"] != truth[i]["bin"]
        outcomes.append("ok")
    return outcomes, wrong


def test_same_size_rewrite_mid_run_is_object_changed(s3, bucket, tmp_path):
    url = f"s3://{bucket}/ds"
    truth = _write(url, seed=1, **s3.storage_options)
    ds = open_dataset(url, **s3.storage_options)
    assert [ds[i]["bin"] for i in (0, N // 2)] == [truth[0]["bin"], truth[N // 2]["bin"]]  # both open
    _rewrite_in_place(s3, bucket, tmp_path)
    outcomes, wrong = _read_all(ds, truth)
    assert wrong == 0
    assert outcomes == ["ObjectChangedError"] * (N // 2) + ["ok"] * (N // 2)
    with pytest.raises(ObjectChangedError) as info:
        ds.get_many([3, 4, 12])
    e = info.value
    key = f"{bucket}/ds/shard-000000.tar"
    assert (e.shard, e.key, e.url) == ("shard-000000.tar", "s003", f"s3://{key} (endpoint {s3.endpoint_url})")
    assert (
        e.pinned.startswith('ETag "')
        and "HTTP 412" in str(e)
        and "changed since its shard was opened" in str(e)
    )
    back = pickle.loads(pickle.dumps(e))  # a worker's error reaches the training loop whole
    assert type(back) is ObjectChangedError and (back.pinned, back.url, back.start) == (
        e.pinned,
        e.url,
        e.start,
    )


def test_same_size_rewrite_under_an_unstaged_loader(s3, bucket, tmp_path):
    """The reviewer's run: 0 workers, staging=False, order="global": the rewrite after the first
    batch is the typed error, and no sample of the new bytes reaches the loop."""
    url = f"s3://{bucket}/ds"
    truth = {s["__key__"]: s["bin"] for s in _write(url, seed=1, **s3.storage_options)}
    ds = open_dataset(url, **s3.storage_options)
    loader = stallfree.DataLoader(
        ds, batch_size=2, num_workers=0, staging=False, order="global", shuffle=True, collate_fn=list
    )
    delivered, wrong = 0, 0
    with pytest.raises(ObjectChangedError, match="shard-000000.tar"):
        for batch in loader:
            if delivered == 0:
                _rewrite_in_place(s3, bucket, tmp_path)
            delivered += len(batch)
            wrong += sum(s["bin"] != truth[s["__key__"]] for s in batch)
    assert wrong == 0 and delivered < N


def test_arrow_same_size_rewrite_mid_run_is_object_changed(s3, bucket, tmp_path):
    """An Arrow shard's remote reads are pinned as a tar's are: record batches read after an
    in-place rewrite of the same size are ObjectChangedError, never the new bytes."""
    url = f"s3://{bucket}/ds"
    samples = _samples(1)
    with ShardWriter(url, format="arrow", max_samples=N // 2, **s3.storage_options) as w:
        for s in samples:
            w.write(s)
    truth = samples
    ds = open_dataset(url, **s3.storage_options)
    assert [ds[i]["bin"] for i in (0, N // 2)] == [truth[0]["bin"], truth[N // 2]["bin"]]  # both open
    assert ds._reader(0).pin is not None
    with ShardWriter(str(tmp_path / "other"), format="arrow", max_samples=N // 2) as w:
        for s in _samples(2):
            w.write(s)
    name = ds.manifest.shards[0].path
    data = (tmp_path / "other" / name).read_bytes()
    fs = s3.filesystem()
    assert fs.size(f"{bucket}/ds/{name}") == len(data)
    fs.pipe_file(f"{bucket}/ds/{name}", data)
    outcomes, wrong = _read_all(ds, truth)
    assert wrong == 0
    assert outcomes == ["ObjectChangedError"] * (N // 2) + ["ok"] * (N // 2)


def test_a_versioned_bucket_serves_the_version_opened(s3, bucket, tmp_path):
    s3.filesystem().call_s3(
        "put_bucket_versioning", Bucket=bucket, VersioningConfiguration={"Status": "Enabled"}
    )
    url = f"s3://{bucket}/ds"
    truth = _write(url, seed=1, **s3.storage_options)
    ds = open_dataset(url, **s3.storage_options)
    assert ds[0]["bin"] == truth[0]["bin"]
    reader = ds._reader(0)
    assert reader.pin is not None and reader.pin.version_id not in (None, "null")
    _rewrite_in_place(s3, bucket, tmp_path)
    s3.reset()
    outcomes, wrong = _read_all(ds, truth)
    assert (outcomes, wrong) == (["ok"] * N, 0)  # the old version, still there
    gets = [r for r in s3.requests() if r.method == "GET" and r.path.endswith("shard-000000.tar")]
    assert gets and all(f"versionId={reader.pin.version_id}" in r.query for r in gets)


def test_http_without_a_version_checks_members_against_sums(tmp_path):
    """The loopback HTTP server sends no ETag or Last-Modified: nothing to pin, so each member
    read is checked against the shard's .sums by default."""
    truth = _write(str(tmp_path / "ds"), seed=1)
    _write(str(tmp_path / "other"), seed=2)
    with serve_directory(tmp_path) as server:
        ds = open_dataset(f"{server.url}/ds")
        assert ds[0]["bin"] == truth[0]["bin"] and ds._reader(0).pin is None
        shutil.copyfile(tmp_path / "other" / "shard-000000.tar", tmp_path / "ds" / "shard-000000.tar")
        outcomes, wrong = _read_all(ds, truth)
    assert wrong == 0
    assert outcomes == ["ChecksumMismatchError"] * (N // 2) + ["ok"] * (N // 2)


class _EtagHandler(BaseHTTPRequestHandler):
    """Serves ``server.files`` (path -> bytes) with ``Range``, a strong ``ETag`` per content and
    ``If-Match`` honoured (412 when it differs): what nginx or an object store's HTTP endpoint
    does, and the loopback server (``stallfree.testing.httpserve``) does not."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        data = self.server.files.get(self.path)
        if data is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        etag = f'"{hashlib.sha256(data).hexdigest()[:16]}"'
        wanted = self.headers.get("If-Match")
        if wanted is not None and wanted != etag:
            self.server.refused += 1
            self.send_response(412)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start, end, status = 0, len(data), 200
        if self.headers.get("Range"):
            a, b = self.headers["Range"].removeprefix("bytes=").split("-")
            start, end, status = int(a), min(len(data), int(b) + 1), 206
        self.send_response(status)
        self.send_header("ETag", etag)
        self.send_header("Content-Length", str(end - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
        if body:
            self.wfile.write(data[start:end])


@contextlib.contextmanager
def _etag_server(root):
    """The files under ``root``, served on loopback by ``_EtagHandler``."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _EtagHandler)
    httpd.daemon_threads = True
    httpd.files = {"/" + str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    httpd.refused = 0
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_http_with_an_etag_sends_if_match(tmp_path):
    truth = _write(str(tmp_path / "ds"), seed=1)
    _write(str(tmp_path / "other"), seed=2)
    with _etag_server(tmp_path) as (httpd, url):
        ds = open_dataset(f"{url}/ds")
        assert ds[0]["bin"] == truth[0]["bin"]
        pin = ds._reader(0).pin
        assert pin is not None and pin.etag.startswith('"') and ds._reader(0).member_check is None
        httpd.files["/ds/shard-000000.tar"] = (tmp_path / "other" / "shard-000000.tar").read_bytes()
        outcomes, wrong = _read_all(ds, truth)
        refused = httpd.refused
    assert wrong == 0 and refused == N // 2
    assert outcomes == ["ObjectChangedError"] * (N // 2) + ["ok"] * (N // 2)


def test_what_a_read_is_pinned_to():
    s3fs = pytest.importorskip("s3fs")
    s3 = s3fs.S3FileSystem(anon=True, skip_instance_cache=True)
    assert stamps.pin_for(s3, {"ETag": '"e1"', "VersionId": "v7"}) == VersionPin(etag='"e1"', version_id="v7")
    assert stamps.pin_for(s3, {"ETag": '"e1"', "VersionId": "null"}) == VersionPin(etag='"e1"')
    assert stamps.pin_for(s3, {"size": 3}) is None
    http = fsspec.filesystem("http", skip_instance_cache=True)
    day = "Sun, 06 Dec 2026 19:00:00 GMT"
    assert stamps.pin_for(http, {"ETag": '"x"', "Last-Modified": day}) == VersionPin(etag='"x"')
    # a weak ETag never satisfies If-Match: pinned by Last-Modified instead
    assert stamps.pin_for(http, {"ETag": 'W/"x"', "Last-Modified": day}) == VersionPin(last_modified=day)
    assert stamps.pin_for(http, {"size": 3}) is None
    local = fsspec.filesystem("memory")
    assert stamps.pin_for(local, {"ETag": '"x"'}) is None  # no way to ask: the .sums check instead
    assert remote._http_conditions(http, VersionPin(last_modified=day)) == {
        "headers": {"If-Unmodified-Since": day}
    }
    with pytest.raises(ValueError, match="needs an etag"):
        VersionPin()


def test_timeouts_deadline_scales_with_the_part_and_is_set_per_dataset(s3, bucket):
    t = Timeouts()
    assert t.deadline_s(0) == 30.0 and t.deadline_s(16 << 20) == 30.0 + 64.0
    with pytest.raises(ValueError, match="deadline must be positive"):
        Timeouts(part_min_bytes_per_s=0)
    mine = Timeouts(part_grace_s=5.0)
    fs, _ = remote.url_to_fs(f"s3://{bucket}/x", stallfree_timeouts=mine, **s3.storage_options)
    assert remote.timeouts_for(fs) is mine and fs.config_kwargs["read_timeout"] == mine.read_s
    plain, _ = remote.url_to_fs(f"s3://{bucket}/x", **s3.storage_options)
    assert remote.timeouts_for(plain) is remote.DEFAULT_TIMEOUTS
    with pytest.raises(TypeError, match="stallfree_timeouts must be a stallfree Timeouts"):
        remote.url_to_fs(f"s3://{bucket}/x", stallfree_timeouts=5, **s3.storage_options)


class _SameSecondHandler(BaseHTTPRequestHandler):
    """Serves ``server.files`` with ``Range`` and one ``Last-Modified`` (no ETag) that a rewrite
    within the same second keeps: what a server with one-second timestamps does then."""

    protocol_version = "HTTP/1.1"
    STAMP = "Sun, 06 Dec 2026 20:00:00 GMT"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        data = self.server.files.get(self.path)
        if data is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start, end, status = 0, len(data), 200
        if self.headers.get("Range"):
            a, b = self.headers["Range"].removeprefix("bytes=").split("-")
            start, end, status = int(a), min(len(data), int(b) + 1), 206
        self.send_response(status)
        self.send_header("Last-Modified", self.STAMP)
        self.send_header("Content-Length", str(end - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
        if body:
            self.wfile.write(data[start:end])


def test_http_rewritten_within_the_second_it_was_opened_is_caught_by_the_sums(tmp_path):
    """Last-Modified alone cannot see a rewrite in the same second (If-Unmodified-Since passes):
    such a pin is weak, and members are checked against the .sums as with no pin at all."""
    truth = _write(str(tmp_path / "ds"), seed=1)
    _write(str(tmp_path / "other"), seed=2)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _SameSecondHandler)
    httpd.daemon_threads = True
    httpd.files = {
        "/" + str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()
    }
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        ds = open_dataset(f"http://127.0.0.1:{httpd.server_address[1]}/ds")
        assert ds[0]["bin"] == truth[0]["bin"]
        assert ds._reader(0).pin == VersionPin(last_modified=_SameSecondHandler.STAMP)
        httpd.files["/ds/shard-000000.tar"] = (tmp_path / "other" / "shard-000000.tar").read_bytes()
        outcomes, wrong = _read_all(ds, truth)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert wrong == 0
    assert outcomes == ["ChecksumMismatchError"] * (N // 2) + ["ok"] * (N // 2)
