"""One resolved location per open: ``open_dataset`` turns the URL into a filesystem once
(``storage.fs.Location``) and hands it down, instead of asking fsspec again in each step
(the remote manifest, ``scan.resolve``, the bucket check, the dataset's own filesystem)."""

from __future__ import annotations

import pickle

import fsspec
import fsspec.core
import pytest

from stallfree.errors import MissingShardError
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter
from stallfree.storage import remote
from stallfree.storage.fs import Location, is_local
from stallfree.testing.httpserve import serve_directory

from .conftest import make_samples, tar_field


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("location")
    samples = make_samples(10, size=300)
    for fmt in ("tar", "arrow"):
        with ShardWriter(str(root / fmt), format=fmt, max_samples=4) as w:
            for s in samples:
                w.write(s)
    with serve_directory(root) as server:
        yield server, samples


@pytest.fixture
def made(monkeypatch):
    """Every filesystem made through fsspec's entrances, by URL: ours (``remote.url_to_fs``)
    and fsspec's own (``fsspec.core.url_to_fs``, ``fsspec.filesystem``)."""
    calls: dict[str, list[str]] = {"ours": [], "fsspec": [], "filesystem": []}
    ours, theirs, plain = remote.url_to_fs, fsspec.core.url_to_fs, fsspec.filesystem

    def count_ours(url, **kw):
        calls["ours"].append(url)
        return ours(url, **kw)

    def count_theirs(url, **kw):
        calls["fsspec"].append(url)
        return theirs(url, **kw)

    def count_plain(protocol, **kw):
        calls["filesystem"].append(protocol)
        return plain(protocol, **kw)

    monkeypatch.setattr(remote, "url_to_fs", count_ours)
    monkeypatch.setattr(fsspec.core, "url_to_fs", count_theirs)
    monkeypatch.setattr(fsspec, "filesystem", count_plain)
    return calls


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_remote_dataset_with_manifest_resolves_its_url_once(served, made, fmt):
    server, samples = served
    url = f"{server.url}/{fmt}"
    ds = open_dataset(url)
    assert made == {"ours": [url], "fsspec": [url], "filesystem": []}
    first = ds[0]
    assert first["__key__"] == samples[0]["__key__"]
    assert ds.get_many([9, 5]) and made["fsspec"] == [url]  # reads use the filesystem made at open


def test_remote_brace_pattern_resolves_once(served, made):
    server, samples = served
    url = f"{server.url}/tar/shard-{{000000..000002}}.tar"  # no manifest: indexed from .idx files
    ds = open_dataset(url)
    assert made == {"ours": [url], "fsspec": [url], "filesystem": []}
    assert [s["__key__"] for s in ds] == [s["__key__"] for s in samples]
    assert ds[3] == {k: (v if k == "__key__" else tar_field(v)) for k, v in samples[3].items()}
    assert len(made["fsspec"]) == 1


def test_missing_remote_dataset_resolves_once(served, made):
    server, _ = served
    url = f"{server.url}/nothing-here"
    with pytest.raises(MissingShardError, match="no dataset at"):
        open_dataset(url)
    assert made["fsspec"] == [url]  # the bucket check reuses it too (and http has no buckets)


def test_pickled_dataset_makes_its_filesystem_again_lazily(served, made):
    server, samples = served
    ds = open_dataset(f"{server.url}/tar")
    copy = pickle.loads(pickle.dumps(ds))
    assert len(made["fsspec"]) == 1  # unpickling makes nothing yet
    assert copy[7]["__key__"] == samples[7]["__key__"]
    assert len(made["fsspec"]) == 2  # the copy's own, on first read


def test_location_pickles_without_its_filesystem(tmp_path):
    where = Location.of(str(tmp_path))
    assert is_local(where.fs) and where.local and where.path == str(tmp_path)
    state = pickle.dumps(where)
    assert b"LocalFileSystem" not in state
    copy = pickle.loads(state)
    assert copy.path == where.path and copy.local
    child = where.child(str(tmp_path / "a.tar"))
    assert child.fs is where.fs and child.path == str(tmp_path / "a.tar")
    assert Location.of("memory://x/d-{0..2}.tar").expand() == [f"/x/d-{i}.tar" for i in range(3)]
