"""Local tar shards are read with pread: nothing of the file stays mapped in the reader's process,
and a file cut short after it was opened is an error naming the shard, key and offset (through
a memory map it would be a SIGBUS that kills the process)."""

from __future__ import annotations

import os

import fsspec
import pytest

from stallfree.errors import CorruptShardError
from stallfree.shards.tar.reader import TarShardReader

from .test_handles import TAR, mapped, shard_info


def test_reads_equal_the_file_bytes_and_map_nothing(tar_dataset):
    path = tar_dataset / TAR
    reader = TarShardReader(fsspec.filesystem("file"), str(path), TAR, shard_info(tar_dataset, TAR))
    blob = path.read_bytes()
    rows = [reader.get(r) for r in range(len(reader))]
    assert [r["__key__"] for r in rows] == [r["__key__"] for r in reader.iter_rows()]
    for row in range(len(reader)):
        start, end = reader.span(row)
        for field, value in rows[row].items():
            if field != "__key__":
                assert isinstance(value, bytes) and value in blob[start:end]
    assert not mapped(path)
    reader.close()


def test_a_file_cut_short_after_open_is_an_error_not_a_crash(tar_dataset):
    path = tar_dataset / TAR
    reader = TarShardReader(fsspec.filesystem("file"), str(path), TAR, shard_info(tar_dataset, TAR))
    last = len(reader) - 1
    start, _ = reader.span(last)
    os.truncate(path, start + 600)  # inside the last sample's first member
    with pytest.raises(CorruptShardError) as info:
        reader.get(last)
    err = info.value
    assert err.shard == TAR and err.key == reader._keys[last]
    assert f"file ends at byte {start + 600}" in str(err) and err.offset == start + 600
    reader.close()
