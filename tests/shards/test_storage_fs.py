"""``stallfree.storage.fs``: the one home of ``is_local``, ``is_object_store``, brace patterns and
``file_size`` (there were three ``file_size`` functions with three wordings)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from stallfree.errors import MissingShardError
from stallfree.storage import fs as storage_fs
from stallfree.storage.fs import expand_braces, file_size, is_local, is_object_store, open_read

PACKAGE = Path(__file__).resolve().parents[2] / "stallfree"


def _definitions(names: set[str]) -> dict[str, list[str]]:
    """Where each top-level function in ``names`` is defined in the package."""
    found: dict[str, list[str]] = {name: [] for name in names}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                found[node.name].append(str(path.relative_to(PACKAGE.parent)))
    return found


def test_each_filesystem_fact_is_defined_once_in_storage_fs():
    found = _definitions(
        {"file_size", "_file_size", "size_of", "is_local", "is_object_store", "expand_braces"}
    )
    where = "stallfree/storage/fs.py"
    assert found == {
        "file_size": [where],
        "_file_size": [],
        "size_of": [],
        "is_local": [where],
        "is_object_store": [where],
        "expand_braces": [where],
    }


def test_file_size_local(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 1234)
    fs = storage_fs.Location.of(str(tmp_path)).fs
    assert is_local(fs) and not is_object_store(fs)
    assert file_size(fs, str(tmp_path / "a.bin"), shard="a.bin") == 1234
    with pytest.raises(MissingShardError, match=r"shard not found \(shard gone.bin\)"):
        file_size(fs, str(tmp_path / "gone.bin"), shard="gone.bin", missing="shard not found")
    with pytest.raises(MissingShardError, match="gone.bin not found"):
        file_size(fs, str(tmp_path / "gone.bin"), shard="gone.bin")
    with open_read(fs, str(tmp_path / "a.bin"), 1234, shard="a.bin") as f:
        assert f.read() == b"x" * 1234


def test_file_size_remote_names_the_url():
    fs = MemoryFileSystem()
    fs.pipe("/fs-test/a.bin", b"y" * 77)
    try:
        assert not is_local(fs) and not is_object_store(fs)
        assert file_size(fs, "/fs-test/a.bin", shard="a.bin") == 77
        with pytest.raises(MissingShardError, match="memory:///fs-test/gone.bin not found"):
            file_size(fs, "/fs-test/gone.bin", shard="gone.bin")
        with open_read(fs, "/fs-test/a.bin", 77, shard="a.bin") as f:  # checked ranged reads
            assert f.read() == b"y" * 77
    finally:
        fs.rm("/fs-test", recursive=True)


def test_expand_braces():
    assert expand_braces("d-{000..002}.tar") == ["d-000.tar", "d-001.tar", "d-002.tar"]
    assert expand_braces("{a,b}/{8..10}") == ["a/8", "a/9", "a/10", "b/8", "b/9", "b/10"]
    assert expand_braces("{3..1}") == ["3", "2", "1"]
    assert expand_braces("plain.tar") == ["plain.tar"]
