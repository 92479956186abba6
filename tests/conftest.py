"""Suite-wide: the tests marked ``slow`` run first.

pytest-xdist hands tests to its workers in collection order, so a 30-second test collected late
starts when the other workers are nearly done, and the whole pass then waits on it alone. Started
first (longest-processing-time-first scheduling), the long tests overlap one another and the short
ones fill in at the end. The order of everything else is kept; a run without xdist only changes
when each test runs, not what it checks.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow ones first
