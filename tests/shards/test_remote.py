"""Remote reads through fsspec's http:// against a real loopback HTTP server that counts bytes."""

import os
import pickle
import time

import pytest

from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter
from stallfree.testing.httpserve import serve_directory

from .conftest import make_samples, tar_field

N, SIZE = 24, 40_000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    samples = make_samples(N, size=SIZE)
    for fmt in ("tar", "arrow"):
        with ShardWriter(str(root / fmt), format=fmt, max_samples=12) as w:
            for s in samples:
                w.write(s)
    with serve_directory(root) as server:
        yield server, root, samples


def _settled(server):
    """The counters once the server has recorded every response: it records after writing the
    last byte, which can be just after the client already has everything."""
    while True:
        before = server.stats.requests
        time.sleep(0.05)
        if server.stats.requests == before:
            return server.stats


def _reset(server) -> None:
    _settled(server).reset()


def _span(sample) -> int:
    """Bytes one tar sample occupies from its first header to its last member's end."""
    sizes = [len(tar_field(sample[f])) for f in ("cls", "jpg", "txt")]
    return sum(512 + (n + 511) // 512 * 512 for n in sizes[:-1]) + 512 + sizes[-1]


def test_one_sample_reads_about_one_sample(served):
    server, root, samples = served
    shard_bytes = os.path.getsize(root / "tar" / "shard-000000.tar")
    ds = open_dataset(f"{server.url}/tar")
    _reset(server)
    # first use of the shard: size, .idx, .sums (this server sends no ETag: reads are checked
    # against the CRCs instead of pinned), two header checks, then the sample
    first = ds[3]
    assert first["jpg"] == samples[3]["jpg"] and first["cls"] == b"3"
    idx_bytes = os.path.getsize(root / "tar" / "shard-000000.idx")
    sums_bytes = os.path.getsize(root / "tar" / "shard-000000.sums")
    assert _settled(server).paths["/tar/shard-000000.sums"] == 1
    assert _settled(server).bytes_sent <= _span(samples[3]) + idx_bytes + sums_bytes + 2 * 512
    assert _settled(server).bytes_sent < shard_bytes / 4
    _reset(server)
    got = ds[7]
    assert got["jpg"] == samples[7]["jpg"] and got["txt"] == samples[7]["txt"].encode()
    assert _settled(server).requests == 1 and _settled(server).range_requests == 1
    assert _settled(server).bytes_sent == _span(samples[7])
    assert len(samples[7]["jpg"]) < server.stats.bytes_sent < len(samples[7]["jpg"]) + 3 * 1024


def test_get_many_coalesces_neighbours(served):
    server, _, samples = served
    ds = open_dataset(f"{server.url}/tar")
    ds[0], ds[12]  # open both shards
    _reset(server)
    got = ds.get_many([4, 5, 6, 7])
    assert [g["__key__"] for g in got] == [samples[i]["__key__"] for i in (4, 5, 6, 7)]
    assert _settled(server).requests == 1
    _reset(server)
    got = ds.get_many([20, 2, 13, 3])
    assert [g["jpg"] for g in got] == [samples[i]["jpg"] for i in (20, 2, 13, 3)]
    assert _settled(server).requests == 3  # shard 0: 2+3 adjacent -> one read; shard 1: 13 and 20 apart
    padding_between_2_and_3 = -_span(samples[2]) % 512
    assert (
        _settled(server).bytes_sent
        == sum(_span(samples[i]) for i in (20, 2, 13, 3)) + padding_between_2_and_3
    )


def test_iteration_and_pickle(served):
    server, _, samples = served
    ds = open_dataset(f"{server.url}/tar")
    assert [s["jpg"] for s in ds] == [s["jpg"] for s in samples]
    back = pickle.loads(pickle.dumps(ds))
    assert back[23]["jpg"] == samples[23]["jpg"]


def test_remote_without_manifest_scans_headers_only(served, tmp_path):
    server, root, samples = served
    os.makedirs(root / "bare", exist_ok=True)
    for i in range(2):
        name = f"shard-{i:06d}.tar"
        (root / "bare" / name).write_bytes((root / "tar" / name).read_bytes())
    _reset(server)
    ds = open_dataset(server.url + "/bare/shard-{000000..000001}.tar")
    total = sum(os.path.getsize(root / "bare" / f"shard-{i:06d}.tar") for i in range(2))
    assert _settled(server).bytes_sent < total / 10  # headers, not data
    assert len(ds) == N and ds[17]["jpg"] == samples[17]["jpg"]


def test_arrow_remote(served):
    server, root, samples = served
    ds = open_dataset(f"{server.url}/arrow")
    assert ds[5] == samples[5]
    shard_bytes = os.path.getsize(root / "arrow" / "shard-000000.arrow")
    _reset(server)
    assert ds[9] == samples[9]
    assert _settled(server).bytes_sent < len(samples[9]["jpg"]) + 4096
    assert _settled(server).bytes_sent < shard_bytes / 4
    assert ds.get_many([14, 1]) == [samples[14], samples[1]]


def test_remote_verify(served):
    server, _, _ = served
    assert open_dataset(f"{server.url}/tar").verify() == []
    assert open_dataset(f"{server.url}/arrow").verify() == []


def test_remote_missing_shard(served, tmp_path):
    server, root, _ = served
    os.makedirs(root / "gone", exist_ok=True)
    for name in ("manifest.json", "shard-000000.tar", "shard-000000.idx"):
        (root / "gone" / name).write_bytes((root / "tar" / name).read_bytes())
    from stallfree.errors import MissingShardError

    ds = open_dataset(f"{server.url}/gone")
    assert ds[0]["__key__"] == "sample00000"
    with pytest.raises(MissingShardError) as info:
        ds[12]
    assert info.value.shard == "shard-000001.tar"


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_concurrent_reads_from_threads(served, fmt):
    """The loader fetches from several threads at once; every sample must still come back whole."""
    from concurrent.futures import ThreadPoolExecutor

    server, _, samples = served
    ds = open_dataset(f"{server.url}/{fmt}")
    batches = [[(i * 7 + j) % N for j in range(5)] for i in range(12)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(ds.get_many, batches))
    for batch, got in zip(batches, results, strict=True):
        assert [g["jpg"] for g in got] == [samples[i]["jpg"] for i in batch]


def test_remote_shard_removed_after_open(served):
    """A ranged read of a file that went away names the shard, not an HTTP error."""
    server, root, _ = served
    os.makedirs(root / "removed", exist_ok=True)
    for name in (
        "manifest.json",
        "shard-000000.tar",
        "shard-000000.idx",
        "shard-000001.tar",
        "shard-000001.idx",
    ):
        (root / "removed" / name).write_bytes((root / "tar" / name).read_bytes())
    from stallfree.errors import MissingShardError

    ds = open_dataset(f"{server.url}/removed")
    assert ds[1]["__key__"] == "sample00001"  # shard 0 open, its index read
    os.remove(root / "removed" / "shard-000000.tar")
    with pytest.raises(MissingShardError, match=f"{server.url}/removed/shard-000000.tar not found") as info:
        ds[2]
    assert info.value.shard == "shard-000000.tar"
    with pytest.raises(MissingShardError) as info:
        ds.get_many([3, 4, 13])
    assert info.value.shard == "shard-000000.tar"
    assert ds[13]["__key__"] == "sample00013"  # the other shard still reads
