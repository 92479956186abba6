"""fsspec calls pass ranges by keyword: s3fs's ``cat_file`` takes ``version_id`` second, so a
positional ``cat_file(path, start, end)`` asked S3 for version ``start``. A memory filesystem with
that signature proves every ranged read (one sample, a batch, a header scan, verify) names them."""

from __future__ import annotations

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from stallfree.shards.open import open_dataset
from stallfree.shards.scan import scan_tar
from stallfree.shards.writer import ShardWriter

from .conftest import make_samples, tar_field


class VersionedMemoryFS(MemoryFileSystem):
    """Memory storage with s3fs's call shapes: ``cat_file(path, version_id=None, start=None,
    end=None)``; ``cat_ranges`` takes ``starts``/``ends``. Shares the memory filesystem's store."""

    protocol = "vmem"

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("vmem://") if isinstance(path, str) else path)

    def cat_file(self, path, version_id=None, start=None, end=None, **kwargs):
        if version_id is not None:
            raise TypeError(f"version_id={version_id!r}: a range was passed positionally")
        return super().cat_file(path, start=start, end=end, **kwargs)

    def cat_ranges(self, paths, starts, ends, max_gap=None, on_error="return", **kwargs):
        return [self.cat_file(p, start=s, end=e) for p, s, e in zip(paths, starts, ends, strict=True)]


@pytest.fixture
def vmem():
    fsspec.register_implementation("vmem", VersionedMemoryFS, clobber=True)
    samples = make_samples(12)
    with ShardWriter("memory://vmem-test/ds", max_samples=5) as w:
        for s in samples:
            w.write(s)
    yield samples
    MemoryFileSystem().rm("/vmem-test", recursive=True)


def _as_tar(sample: dict) -> dict:
    return {k: (v if k == "__key__" else tar_field(v)) for k, v in sample.items()}


def test_ranged_reads_name_start_and_end(vmem) -> None:
    samples = vmem
    ds = open_dataset("vmem://vmem-test/ds")
    assert isinstance(ds.fs, VersionedMemoryFS) and not ds._local
    assert ds[7] == _as_tar(samples[7])  # one cat_file
    assert ds.get_many([1, 0, 11, 3]) == [_as_tar(samples[i]) for i in (1, 0, 11, 3)]  # cat_ranges
    assert ds.verify() == []


def test_header_scans_name_start_and_end(vmem) -> None:
    samples = vmem
    fs = VersionedMemoryFS()
    for i in range(3):
        fs.rm(f"/vmem-test/ds/shard-{i:06d}.idx")
    fs.rm("/vmem-test/ds/manifest.json")
    assert [s.key for s in scan_tar(fs, "/vmem-test/ds/shard-000001.tar")] == [
        f"sample{i:05d}" for i in range(5, 10)
    ]
    ds = open_dataset("vmem://vmem-test/ds/shard-{000000..000002}.tar")  # indexed on the fly
    assert list(ds) == [_as_tar(s) for s in samples]
