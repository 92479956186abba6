"""The staging root and its namespace directories are private and checked before use (issue 36):
a guessable default root another user made first, a symlink, a directory others may write, are
refused with a ``StagingDirError`` naming the path and the problem, before anything is read from
or written into them. The suite runs as root: "another user" is a chown to uid 65534."""

from __future__ import annotations

import os
import pickle

import pytest

from stallfree.storage.staging import StagingArea, StagingDirError

OTHER_UID = 65534


def _stage(area, name="shard.tar", data=b"x" * 100):
    return area.stage("fp", name, produce=lambda: data)


def test_a_new_root_and_namespace_are_0700_and_files_0600(tmp_path):
    root = tmp_path / "stage"
    area = StagingArea(str(root))
    with _stage(area) as staged:
        assert open(staged.path, "rb").read() == b"x" * 100
    assert os.stat(root).st_mode & 0o777 == 0o700
    assert os.stat(root / "fp").st_mode & 0o777 == 0o700
    assert os.stat(root / "fp" / "shard.tar").st_mode & 0o777 == 0o600
    assert os.stat(root / ".room").st_mode & 0o777 == 0o600


def test_a_root_owned_by_another_user_is_refused(tmp_path):
    root = tmp_path / "stage"
    root.mkdir(mode=0o700)
    os.chown(root, OTHER_UID, OTHER_UID)
    with pytest.raises(
        StagingDirError, match=rf"staging directory {root} is owned by uid {OTHER_UID}, not by"
    ) as info:
        StagingArea(str(root))
    assert info.value.path == str(root) and os.listdir(root) == []


def test_a_root_others_may_write_is_refused(tmp_path):
    root = tmp_path / "stage"
    root.mkdir()
    os.chmod(root, 0o1777)  # sticky, like /tmp: others can still add namespaces of their own
    with pytest.raises(StagingDirError, match=r"is writable by group or others \(mode 1777\)"):
        StagingArea(str(root))


def test_a_symlinked_root_is_refused_even_to_a_directory_of_ours(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "stage").symlink_to(tmp_path / "real")
    with pytest.raises(StagingDirError, match=r"stage is a symbolic link"):
        StagingArea(str(tmp_path / "stage"))


def test_a_symlinked_namespace_is_never_followed(tmp_path):
    """The reviewer's case: the namespace a dataset's shards go to is a symlink to a directory
    someone else chose; nothing is written there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o777)
    area = StagingArea(str(tmp_path / "stage"))
    (tmp_path / "stage" / "fp").symlink_to(elsewhere)
    with pytest.raises(StagingDirError, match=r"stage/fp is a symbolic link"):
        _stage(area)
    assert os.listdir(elsewhere) == []


def test_a_namespace_of_another_user_is_refused(tmp_path):
    area = StagingArea(str(tmp_path / "stage"))
    ns = tmp_path / "stage" / "fp"
    ns.mkdir(mode=0o700)
    (ns / "shard.tar").write_bytes(b"planted")
    os.chown(ns, OTHER_UID, OTHER_UID)
    with pytest.raises(StagingDirError, match=rf"fp is owned by uid {OTHER_UID}"):
        _stage(area)
    assert (ns / "shard.tar").read_bytes() == b"planted"


def test_a_namespace_from_before_is_made_private(tmp_path):
    """Areas staged before this check had 0755 directories and 0644 files: ours, so tightened."""
    area = StagingArea(str(tmp_path / "stage"))
    ns = tmp_path / "stage" / "fp"
    ns.mkdir(mode=0o755)
    os.chmod(ns, 0o755)
    with _stage(area):
        pass
    assert os.stat(ns).st_mode & 0o777 == 0o700


def test_the_error_keeps_its_fields_across_processes():
    err = pickle.loads(pickle.dumps(StagingDirError("/tmp/x", "is a symbolic link")))
    assert (err.path, err.problem) == ("/tmp/x", "is a symbolic link")
    assert str(err).startswith("staging directory /tmp/x is a symbolic link: refusing to stage there")
