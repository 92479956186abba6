"""Suite-wide: the tests marked ``slow`` run first; a slow module's module-scoped fixtures are set up
once.

pytest-xdist hands tests to its workers in collection order, so a 30-second test collected late
starts when the other workers are nearly done, and the whole pass then waits on it alone. Started
first (longest-processing-time-first scheduling), the long tests overlap one another and the short
ones fill in at the end. The order of everything else is kept; a run without xdist only changes
when each test runs, not what it checks.

A module-scoped fixture is set up once per xdist worker that runs a test of its module, and xdist
spreads a module's tests over every worker: four Spark sessions and four Ray clusters started at
once, on two cores, where the module meant one. So the slow tests that use a module-scoped fixture
run on one worker per module (an ``xdist_group`` named after the module; scripts/test.sh runs
``--dist loadgroup``), unless they already name a group.
"""

from __future__ import annotations

import multiprocessing.util
import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow ones first
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("xdist_group") is None:
            if _uses_a_module_fixture(item):
                item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


class _GroupsForXdist:
    """Makes ``xdist_group`` work on pytest 9: pytest-xdist (3.8) sends a group to one worker by
    appending ``@group`` to each of its tests' node ids, which it does by setting ``item._nodeid``;
    pytest 9 keeps the id in ``item._id``, so every group was silently spread over all workers.
    Runs after xdist's hook, and only where xdist's suffix is missing."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not config.getvalue("loadgroup"):
            return
        from _pytest.nodeid import NodeId  # pytest 9's node-id type (private; only reached on pytest 9)

        for item in items:
            names = sorted(
                {
                    str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")
                }
            )
            if names and not item.nodeid.endswith("@" + "_".join(names)):
                item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadgroup") and int(pytest.__version__.split(".")[0]) >= 9:
        config.pluginmanager.register(_GroupsForXdist(), "stallfree-xdist-groups")


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)  # pytest's own record of the fixtures a test uses
    if info is None:
        return False
    return any(
        defs and defs[-1].scope == "module"
        for defs in (info.name2fixturedefs.get(n) for n in info.names_closure)
    )


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
