"""Suite-wide: the tests marked ``slow`` run first.

pytest-xdist hands tests to its workers in collection order, so a 30-second test collected late
starts when the other workers are nearly done, and the whole pass then waits on it alone. Started
first (longest-processing-time-first scheduling), the long tests overlap one another and the short
ones fill in at the end. The order of everything else is kept; a run without xdist only changes
when each test runs, not what it checks.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow ones first


@pytest.fixture(autouse=True)
def _own_temp_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Each test gets its own temp directory (also for the processes it starts, via TMPDIR).

    The loader's default staging area lives in the temp directory and is shared on purpose by
    every process of a node, across runs: in the suite, a test would otherwise be served shards a
    test before it staged (same data, same fingerprint) and count no GET. Short path (a Unix
    socket's path must fit in 108 bytes)."""
    # pytest picks its own base directory from the temp directory the first time a test asks for
    # tmp_path: fix it first, or it lands inside this test's directory and goes with it (without
    # xdist, which passes every worker its base directory, all later tests then fail at set-up)
    tmp_path_factory.getbasetemp()
    path = tempfile.mkdtemp(prefix="sft-", dir="/tmp")
    monkeypatch.setenv("TMPDIR", path)
    monkeypatch.setattr(tempfile, "tempdir", path)
    yield
    shutil.rmtree(path, ignore_errors=True)
