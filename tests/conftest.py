"""Suite-wide: the tests marked ``slow`` run first.

pytest-xdist hands tests to its workers in collection order, so a 30-second test collected late
starts when the other workers are nearly done, and the whole pass then waits on it alone. Started
first (longest-processing-time-first scheduling), the long tests overlap one another and the short
ones fill in at the end. The order of everything else is kept; a run without xdist only changes
when each test runs, not what it checks.
"""

from __future__ import annotations

import multiprocessing.util
import shutil
import tempfile
from collections.abc import Iterator

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow ones first


_TEST_TEMP_DIRS: list[str] = []


@pytest.fixture(autouse=True)
def _own_temp_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Each test gets its own temp directory (also for the processes it starts, via TMPDIR).

    The loader's default staging area lives in the temp directory and is shared on purpose by
    every process of a node, across runs: in the suite, a test would otherwise be served shards a
    test before it staged (same data, same fingerprint) and count no GET. Short path (a Unix
    socket's path must fit in 108 bytes).

    Process-wide state made from the temp directory must not land in a test's one:
    - pytest's base directory for tmp_path (picked the first time a test asks for one; without
      xdist, which passes every worker its base directory, all later tests failed at set-up);
    - multiprocessing's own temp directory (made once per process, cached): the resource sharer
      that passes a slot's file descriptor to the main process binds its socket there, so with it
      inside a deleted test directory a later loader's first batch never arrived (a hang).
    Test directories are removed at the end of the session, not after each test: a leaked worker
    or server of one test must not lose its files under it."""
    tmp_path_factory.getbasetemp()
    multiprocessing.util.get_temp_dir()
    path = tempfile.mkdtemp(prefix="sft-", dir="/tmp")
    _TEST_TEMP_DIRS.append(path)
    monkeypatch.setenv("TMPDIR", path)
    monkeypatch.setattr(tempfile, "tempdir", path)
    yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for path in _TEST_TEMP_DIRS:
        shutil.rmtree(path, ignore_errors=True)
